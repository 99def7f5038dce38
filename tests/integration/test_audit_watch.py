"""Watch rules (issue 34) run by ``broker audit monitor --rules`` over a live broker's log: each
rule kind reports the records it should and no other, a hit is reported once (the state
remembers how far the rules ran), exits 4, and reaches a loopback syslog collector as a
structured event; records a source serves that do not hash to the signed checkpoint are refused
(exit 1), a rules file that cannot be used is exit 2 naming it and the rule."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from broker.audit.publisher import checkpoint_paths
from broker.client import BrokerClientError
from tests.integration.attested import ADMIN, DENIED_KEY, admin_post, attest_broker
from tests.integration.conftest import RunningBroker
from tests.integration.kbs import kbs_broker, kbs_records
from tests.integration.watch import covered, log_key, monitor
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY
from tests.support.syslog import syslog_collector

OTHER_IMAGE = "sha256:" + "0" * 64
MISSES = {"llama to its image", "any hour", "identity CAs", "wide fan-out", "refusal burst"}


def rules(now: datetime) -> str:
    """Hit and not-hit rules of every kind: "not now" is an hour that excludes the test's."""
    start, end = (now.hour + 2) % 24, (now.hour + 3) % 24
    return f"""
[[rule]]
name = "llama to its image"
kind = "key_images"
key = "{KEY}"
images = ["{ALLOWED}"]

[[rule]]
name = "models to another image"
kind = "key_images"
key = "models/*"
images = ["{OTHER_IMAGE}"]

[[rule]]
name = "any hour"
kind = "release_hours"
hours = "00:00-24:00"

[[rule]]
name = "not now"
kind = "release_hours"
hours = "{start:02d}:00-{end:02d}:00"

[[rule]]
name = "refused reloads"
kind = "record_type"
type = "policy_reload_failed"

[[rule]]
name = "identity CAs"
kind = "record_type"
type = "identity_ca"

[[rule]]
name = "fan-out"
kind = "recipients"
key = "{KEY}"
max = 2
window_seconds = 3600

[[rule]]
name = "refusal burst"
kind = "deny_rate"
max = 1
window_seconds = 3600

[[rule]]
name = "wide fan-out"
kind = "recipients"
key = "{KEY}"
max = 50
window_seconds = 3600
"""


async def releases_and_a_refused_reload(broker: RunningBroker) -> None:
    """Three releases of KEY to three recipient keys, a refusal, a refused policy reload."""
    async with broker.client() as client:
        for _ in range(2):
            await client.release(KEY, broker.token_source())  # a fresh runner key each
        with pytest.raises(BrokerClientError):
            await client.release(DENIED_KEY, broker.token_source())  # denied: never a hit
        attestation = await client.attest(broker.token_source())
        await attestation.release(KEY)  # the attestation's encryption key: a third recipient
    broken = broker.workdir / "policies" / "broker" / "broken.rego"
    broken.write_text("package broker.release\nthis is not rego\n")
    status, body = await admin_post(broker, "/v1/admin/policy/reload")
    assert status >= 400, body
    broken.unlink()


def by_rule(hits: list[dict[str, Any]]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for hit in hits:
        found.setdefault(hit["rule"], []).append(hit["index"])
    return found


async def test_each_rule_kind_hits_what_it_should_once_and_reaches_the_sink(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    broker = await attest_broker(start_broker)
    (tmp_path / "rules.toml").write_text(rules(datetime.now(UTC)))
    (tmp_path / "auditor").write_text(ADMIN)
    key = await log_key(broker)
    state = tmp_path / "monitor.json"
    common = [
        *("--state", str(state), "--rules", str(tmp_path / "rules.toml")),
        *(
            "--token-file",
            str(tmp_path / "auditor"),
            "--ca",
            str(broker.workdir / "tls" / "ca.pem"),
        ),
        broker.url,
    ]
    messages: list[bytes] = []
    transport, port = await syslog_collector(messages)
    try:
        await releases_and_a_refused_reload(broker)
        size = await covered(broker)
        records = broker.records()
        released = [
            r["index"]
            for r in records
            if r["type"] in ("release", "attested_release") and r["result"] == "allow"
        ]
        (failed,) = [r["index"] for r in records if r["type"] == "policy_reload_failed"]
        sink = ["--sink", f"syslog://127.0.0.1:{port}"]
        code, hits, report = await asyncio.to_thread(monitor, *common, "--key", key, *sink)
        assert code == 4, report
        assert report["ok"] is True
        assert report["watch"] == {"checked": True, "from": 0, "to": size, "hits": len(hits)}
        assert by_rule(hits) == {
            "models to another image": released,
            "not now": released,
            "refused reloads": [failed],
            "fan-out": [released[2]],  # the third distinct recipient key
        }
        assert not MISSES & set(by_rule(hits))
        hit = next(h for h in hits if h["rule"] == "models to another image")
        assert (hit["key"], hit["image"], hit["origin"]) == (KEY, ALLOWED, key.split("+")[0])
        for _ in range(100):  # UDP on loopback: received at once, read by this loop
            if len(messages) >= len(hits):
                break
            await asyncio.sleep(0.02)
        assert len(messages) == len(hits)
        for message in messages:  # auth.warning, MSGID watch, the hit as JSON
            header, _, body = message.partition(b" - watch - ")
            assert header.startswith(b"<36>1 ")
            event = json.loads(body)
            assert event["event"] == "broker.watch_hit"
        assert sorted((json.loads(m.partition(b" - watch - ")[2])["index"]) for m in messages) == (
            sorted(h["index"] for h in hits)
        )

        code, hits, report = await asyncio.to_thread(monitor, *common)  # nothing new
        assert (code, hits) == (0, [])
        assert report["watch"] == {"checked": True, "from": size, "to": size, "hits": 0}

        async with broker.client() as client:  # a fourth recipient; fan-out stays quiet
            await client.release(KEY, broker.token_source())
        grown = await covered(broker)
        environ = {"BROKER_AUDIT_SINK": f"syslog://127.0.0.1:{port}"}
        config = ["--config", str(broker.workdir / "broker.toml")]  # its [audit] sink
        code, hits, report = await asyncio.to_thread(monitor, *common, *config, env=environ)
        assert code == 4, report
        assert by_rule(hits) == {"models to another image": [size], "not now": [size]}
        assert grown == size + 1
        for _ in range(100):
            if len(messages) == len(released) * 2 + 2 + 2:
                break
            await asyncio.sleep(0.02)
        assert len(messages) == len(released) * 2 + 2 + 2
    finally:
        transport.close()
    saved = json.loads(state.read_text())["watch"]  # what the console reads
    assert [r["name"] for r in saved["rules"]][:2] == [
        "llama to its image",
        "models to another image",
    ]
    assert len(saved["hits"]) == len(released) * 2 + 2 + 2
    assert saved["logs"][key.split("+")[0]]["index"] == grown


async def test_records_that_do_not_hash_to_the_checkpoint_are_refused_and_exit_codes(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    broker = await attest_broker(start_broker)
    await releases_and_a_refused_reload(broker)
    await covered(broker)
    key = await log_key(broker)
    (tmp_path / "rules.toml").write_text(rules(datetime.now(UTC)))
    log = broker.settings.audit.log
    copy = tmp_path / "copy" / log.name
    copy.parent.mkdir()
    shutil.copyfile(checkpoint_paths(log)[0], checkpoint_paths(copy)[0])
    lines = log.read_bytes().splitlines(keepends=True)
    forged = [line.replace(ALLOWED.encode(), OTHER_IMAGE.encode()) for line in lines]
    copy.write_bytes(b"".join(forged))  # every release now names another image
    state = tmp_path / "monitor.json"
    watch = ["--rules", str(tmp_path / "rules.toml")]
    code, hits, report = await asyncio.to_thread(
        monitor, "--state", str(state), str(copy), "--key", key, *watch
    )
    assert (code, hits, report["ok"]) == (1, [], False)
    assert "do not hash to the signed checkpoint's root" in report["problem"]
    assert json.loads(state.read_text())["watch"]["logs"] == {}  # the rules did not advance
    copy.write_bytes(b"".join(lines))  # the log as written: the same hits as from the broker
    code, hits, report = await asyncio.to_thread(monitor, "--state", str(state), str(copy), *watch)
    assert code == 4, report
    assert set(by_rule(hits)) == {
        "models to another image",
        "not now",
        "refused reloads",
        "fan-out",
    }

    (tmp_path / "bad.toml").write_text('[[rule]]\nname = "office"\nkind = "release_hours"\n')
    done = run(
        "audit", "monitor", "--state", str(state), str(copy), "--rules", str(tmp_path / "bad.toml")
    )
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: {tmp_path / 'bad.toml'}: rule #1 ('office'): hours:"), line
    typo = tmp_path / "typo.toml"  # a result its type never has: it would never match
    typo.write_text('[[rule]]\nname = "refusals"\nkind = "record_type"\ntype = "release"\n'
                    'result = "denied"\n')  # fmt: skip
    done = run("audit", "monitor", "--state", str(state), str(copy), "--rules", str(typo))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(
        f"error: {typo}: rule #1 ('refusals'): result 'denied' is not one of release's"
    ), done.stderr
    for refused, flag in (
        (["--sink", "syslog://127.0.0.1:514"], "--sink"),  # without --rules
        ([*watch, "--sink", "ftp://siem.example/"], "--sink"),
        (["--rules", str(tmp_path / "absent.toml")], "absent.toml: cannot be read"),
    ):
        done = run("audit", "monitor", "--state", str(state), str(copy), *refused)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert flag in done.stderr
    ca = ["--ca", str(broker.workdir / "tls" / "ca.pem")]
    done = run("audit", "monitor", "--state", str(state), broker.url, *watch, *ca)
    assert done.returncode == 2  # a broker's records need an auditor token
    assert "--token-file" in done.stderr
    (tmp_path / "stranger").write_text("not-a-token-of-this-broker")
    remote = tmp_path / "remote.json"
    token = ["--token-file", str(tmp_path / "stranger")]
    code, hits, report = await asyncio.to_thread(
        monitor, "--state", str(remote), broker.url, "--key", key, *watch, *token, *ca
    )
    assert (code, hits, report["ok"]) == (3, [], True)  # the log checked, its records unread
    assert report["watch"]["checked"] is False
    assert "HTTP 401" in report["watch"]["problem"]


async def test_a_key_released_to_a_kbs_guest_is_a_release_to_the_rules(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    """A KBS guest's resource is a release of its key: "key K only to these images" and the
    hours hold for it as for a runner's release. The guest's evidence names no image (a
    ``sample`` guest, as a raw TDX or SEV-SNP one): in no list, a hit (fail closed)."""
    broker = await kbs_broker(start_broker)
    await kbs_records(broker)
    await covered(broker)
    records = broker.records()
    (released,) = [
        r["index"] for r in records if r["type"] == "kbs_resource" and r["result"] == "allow"
    ]
    assert not records[released]["identity"]["image_digest"]  # the guest's evidence names none
    now = datetime.now(UTC)
    start, end = (now.hour + 2) % 24, (now.hour + 3) % 24
    (tmp_path / "rules.toml").write_text(
        f'[[rule]]\nname = "llama to its image"\nkind = "key_images"\nkey = "{KEY}"\n'
        f'images = ["{ALLOWED}"]\n'
        f'[[rule]]\nname = "not now"\nkind = "release_hours"\nkeys = ["{KEY}"]\n'
        f'hours = "{start:02d}:00-{end:02d}:00"\n'
    )
    code, hits, report = await asyncio.to_thread(
        monitor,
        *("--state", str(tmp_path / "monitor.json"), str(broker.settings.audit.log)),
        *("--key", await log_key(broker), "--rules", str(tmp_path / "rules.toml")),
    )
    assert code == 4, report
    assert by_rule(hits) == {"llama to its image": [released], "not now": [released]}
    hit = next(h for h in hits if h["rule"] == "llama to its image")
    assert (hit["type"], hit["key"]) == ("kbs_resource", KEY)
    assert "released to image (none recorded), not in the list" in hit["detail"]
