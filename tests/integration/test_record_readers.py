"""Every reader over a log holding every record type the broker writes (issue 30, item 2).

A live broker writes every decision and change it records (``test_audit_feeds``), plus a release
on a result cut short by a bug after its first key (the real writer, a fault injected into the
key lookup of the second key); the real repair and key hand-over writers add theirs. Then every
reader reads that one log through the record envelope (``broker/audit/envelope.py``):
``audit query`` (each filter), ``audit export --format ocsf`` (one event per key, each naming its
key: a key asked on a result and never decided used to have no event, and ``query --key`` missed
a release refused before its keys), ``policy replay``, the syslog sink's severities, and the
monitor (it reads checkpoints and leaf hashes, no record members) with ``audit verify``. A record
of a type this version does not know is read as unknown by each; a line that is not a record is
refused in one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.envelope import RecordError, parse_record
from broker.audit.identity import adopt_signing_key, claim_origin
from broker.audit.log import DecisionLog
from broker.audit.publisher import CheckpointPublisher
from broker.audit.sink import syslog_message
from broker.core.records import RecordType
from broker.crypto.checkpoint import NoteSigner
from tests.integration.attested import DENIED_KEY
from tests.integration.every_record import (
    NEWER_TYPE,
    a_bug_after_the_first_key,
    append_record,
    every_kind_of_record,
    with_a_repair,
)
from tests.integration.kbs import every_record_broker
from tests.integration.test_audit_feeds import CHECKS, written_types
from tests.support.cli import Ran, run
from tests.support.constants import KEY

ORIGIN = "readers.it.invalid/decisions"
NOW = "2026-12-02T12:00:01+00:00"
# RFC 5424 severities by (type, result as written): info, notice, warning, error
SEVERITY = {
    ("release", "allow"): 6,
    ("release", "deny"): 4,
    ("attestation", "allow"): 6,
    ("attested_release", "allow"): 6,
    ("attested_release", "partial"): 5,
    ("attested_release", "deny"): 4,
    ("attested_release", "error"): 3,
    ("attestation_revoked", None): 5,
    ("identity", "allow"): 6,
    ("identity_ca", None): 5,  # the CA in force changed
    ("kbs_auth", "allow"): 6,
    ("kbs_attest", "allow"): 6,
    ("kbs_resource", "allow"): 6,
    ("kbs_resource", "deny"): 4,
    ("policy_change", None): 5,
    ("key_admin", None): 5,  # a key change's intent (or a read: backup, weights-*)
    ("key_admin", "ok"): 5,  # its outcome: made
    ("key_admin", "error"): 3,  # not made
    ("key_admin", "unknown"): 4,  # may be made: look at the store
    ("log_key_rotation", None): 5,
    ("policy_reload_failed", None): 4,
    ("log_repair", None): 4,
}


async def _rotate_and_publish(log: Path) -> str:
    """A checkpoint-key hand-over (the real writer), then a checkpoint of the whole log signed
    by the new key; that key's note verifier key."""
    await asyncio.to_thread(claim_origin, log, origin=ORIGIN, replica="readers")
    decisions = DecisionLog(log, replica="readers")
    await decisions.open()
    try:
        old = NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate())
        new = NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate())
        assert await adopt_signing_key(decisions, old, None, now=NOW) is None
        assert await adopt_signing_key(decisions, new, old, now=NOW) is not None
        await CheckpointPublisher(decisions, new, interval=1).publish()
    finally:
        await decisions.close()
    return new.verifier_key()


async def test_every_reader_reads_every_record_type(
    start_broker: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = await every_record_broker(start_broker)
    jti = await every_kind_of_record(broker)
    await a_bug_after_the_first_key(broker, monkeypatch)
    log = tmp_path / "decisions.log"
    await asyncio.to_thread(with_a_repair, broker.settings.audit.log, log)
    verifier_key = await _rotate_and_publish(log)
    records = [json.loads(line) for line in (await asyncio.to_thread(log.read_bytes)).splitlines()]
    assert {r["type"] for r in records} == written_types()  # every type a writer writes
    assert {r["type"] for r in records} == {t.value for t in RecordType} - {"unknown"}
    policies = broker.workdir / "policies"
    await asyncio.to_thread(_every_reader, log, records, jti, policies, verifier_key)
    newer = tmp_path / "newer.log"
    await asyncio.to_thread(shutil.copyfile, log, newer)
    await append_record(newer, {"type": NEWER_TYPE, "time": NOW, "who": "broker v99"})
    await asyncio.to_thread(_an_unknown_type_is_read_as_unknown, newer, len(records), policies)


def _every_reader(
    log: Path, records: list[dict[str, Any]], jti: str, policies: Path, verifier_key: str
) -> None:
    _export(log, records, jti)
    _query(log, records, jti)
    _replay(log, policies)
    _syslog(log, records)
    _monitor_and_verify(log, verifier_key, len(records))


def _ok(ran: Ran) -> list[dict[str, Any]]:
    assert ran.returncode == 0, ran.stderr
    return [json.loads(line) for line in ran.stdout.splitlines()]


def _named_keys(record: dict[str, Any]) -> list[str]:
    """Every key name a record holds: its own ``key``, each key decided, each key asked (a
    name the request gave more than once counts once)."""
    names = [record.get("key")]
    names += [k.get("key") for k in record.get("keys") or []]
    names += [a.get("key") for a in record.get("asked") or []]
    return sorted({n for n in names if n is not None})


def _is_bug(record: dict[str, Any]) -> bool:
    return bool(record["type"] == "attested_release" and record["code"] == "internal_error")


def _export(log: Path, records: list[dict[str, Any]], jti: str) -> None:
    events = _ok(run("audit", "export", str(log), "--format", "ocsf"))
    by_record: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        by_record.setdefault(event["metadata"]["sequence"], []).append(event)
        assert all(r.get("name", "") is not None for r in event["resources"])  # never null
    assert sorted(by_record) == [r["index"] for r in records]  # every record, in order
    for record in records:
        produced = by_record[record["index"]]
        keys = [r["name"] for e in produced for r in e["resources"] if r["type"] == "key"]
        assert sorted(set(keys)) == _named_keys(record), record["type"]  # each key, named
        if record["type"] in ("release", "attested_release"):
            assert len(produced) == max(1, len(keys))  # one event per key
        if not _is_bug(record):  # the mappings, field by field (test_audit_feeds)
            CHECKS[record["type"]](record, produced, jti)
    (bug,) = [r for r in records if _is_bug(r)]
    decided, never = by_record[bug["index"]]  # the key decided, then the one never decided
    assert [r["name"] for r in decided["resources"]] == [KEY]
    assert [r["name"] for r in never["resources"]] == [DENIED_KEY]  # had no event before
    for n, event in enumerate((decided, never)):
        assert (event["status"], event["severity_id"]) == ("Failure", 4)
        assert event["status_code"] == "internal_error"
        assert event["metadata"]["uid"] == f"{bug['decision_id']}#{n}"
        assert event["actor"]["session"] == {"uid": bug["attestation"]["jti"]}


def _rows(*args: str) -> list[dict[str, Any]]:
    return _ok(run("audit", "query", *args))


def _query(log: Path, records: list[dict[str, Any]], jti: str) -> None:
    releases = [r for r in records if r["type"] in ("release", "attested_release", "kbs_resource")]
    by_key = _rows(str(log), "--key", KEY)
    assert [r["index"] for r in by_key] == [r["index"] for r in releases if KEY in _named_keys(r)]
    assert {r["key"] for r in by_key} == {KEY}
    (refused,) = [r for r in by_key if r["result"] == "deny"]  # refused before its key
    assert (refused["code"], refused["release_result"]) == ("dpop_proof_invalid", "deny")
    partial = _rows(str(log), "--result", "partial")
    assert [(r["key"], r["result"]) for r in partial] == [(KEY, "allow"), (DENIED_KEY, "deny")]
    failed = _rows(str(log), "--result", "error")
    assert [(r["key"], r["result"], r["code"]) for r in failed] == [
        (KEY, "error", "internal_error"),
        (DENIED_KEY, "error", "internal_error"),  # asked, never decided: the request's
    ]
    since = releases[3]["time"]  # the partial release's (microseconds: no two alike)
    later = _rows(str(log), "--since", since, "--until", releases[-1]["time"])
    assert [r["index"] for r in later][:1] == [releases[3]["index"]]
    assert {r["index"] for r in later} == {r["index"] for r in releases[3:]}
    table = run("audit", "query", str(log), "--key", DENIED_KEY, "--table")
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["index", "time", "type", "result", "code", "key"]
    assert [line.split()[3:] for line in lines[1:]] == [
        ["deny", "policy_denied", DENIED_KEY],  # the full-evidence release
        ["deny", "policy_denied", DENIED_KEY],  # the partial release's second key
        ["deny", "policy_denied", DENIED_KEY],
        ["error", "internal_error", DENIED_KEY],
    ]
    story = _rows(str(log), "--attestation", jti)
    assert [(r["type"], r.get("key"), r.get("result")) for r in story] == [
        ("attestation", None, "allow"),
        ("attested_release", KEY, "allow"),
        ("attested_release", KEY, "allow"),
        ("attested_release", DENIED_KEY, "deny"),
        ("attested_release", DENIED_KEY, "deny"),
        ("attestation_revoked", None, None),
    ]


def _replay(log: Path, policies: Path) -> None:
    lines = _ok(run("policy", "replay", "--log", str(log), "--policy", str(policies)))
    # 2 full-evidence releases, 3 attestations, 4 keys decided on results, 1 workload
    # certificate, a KBS guest's attestation and its resource, all re-decided the same; skipped:
    # the key withdrawn by the bug (error), the key it never decided, the release and the KBS
    # resource refused before their key
    assert lines[-1]["summary"] == {
        "decisions": 12, "unchanged": 12, "allow_to_deny": 0, "deny_to_allow": 0,
        "spiffe_id_changed": 0, "reasons_changed": 0, "skipped": 4,
    }  # fmt: skip
    denied = _ok(run("policy", "replay", "--log", str(log), "--policy", str(policies),
                     "--key", DENIED_KEY))  # fmt: skip
    assert (denied[-1]["summary"]["decisions"], denied[-1]["summary"]["skipped"]) == (3, 1)
    naive = run("policy", "replay", "--log", str(log), "--policy", str(policies),
                "--since", "2026-12-01T00:00:00")  # fmt: skip
    assert (naive.returncode, naive.stdout) == (2, "")  # which instant? (was a TypeError)
    assert "with a zone" in naive.stderr


def _syslog(log: Path, records: list[dict[str, Any]]) -> None:
    for line, record in zip(log.read_bytes().splitlines(), records, strict=True):
        message = syslog_message(line)
        priority = int(message[1 : message.index(b">")])
        assert divmod(priority, 8) == (4, SEVERITY[record["type"], record.get("result")])
        assert message.endswith(b" - decision - " + line)


def _monitor_and_verify(log: Path, verifier_key: str, size: int) -> None:
    """The monitor reads the checkpoint and leaf hashes (no record members): it follows the
    log of every record type; ``audit verify`` still verifies it (hashes only)."""
    state = log.with_name("monitor.json")
    (report,) = _ok(run("audit", "monitor", "--state", str(state), "--key", verifier_key, str(log)))
    assert (report["ok"], report["origin"], report["size"]) == (True, ORIGIN, size)
    checkpoint = log.with_name(log.name + ".checkpoint")
    (verified,) = _ok(
        run("audit", "verify", str(log), "--checkpoint", str(checkpoint), "--key", verifier_key)
    )
    assert (verified["ok"], verified["records"]) == (True, size)


def _an_unknown_type_is_read_as_unknown(log: Path, known: int, policies: Path) -> None:
    line = log.read_bytes().splitlines()[known]
    envelope = parse_record(line)
    assert (envelope.kind, envelope.type, envelope.who) == (
        RecordType.UNKNOWN, "from_a_newer_broker", "broker v99"
    )  # fmt: skip
    event = _ok(run("audit", "export", str(log), "--format", "ocsf"))[-1]
    assert (event["api"]["operation"], event["activity_id"], event["status"]) == (
        "from_a_newer_broker", 99, "Unknown"
    )  # fmt: skip
    assert event["metadata"]["sequence"] == known
    rows = _rows(str(log), "--who", "broker v99")
    assert [r["type"] for r in rows] == ["from_a_newer_broker"]
    replayed = _ok(run("policy", "replay", "--log", str(log), "--policy", str(policies)))
    assert replayed[-1]["summary"]["decisions"] == 12  # not a decision it can re-decide
    assert syslog_message(line).startswith(b"<37>1 ")  # auth, notice
    with pytest.raises(RecordError, match="not a record"):
        parse_record(b"[1]")
    assert syslog_message(b"not a record").startswith(b"<36>1 ")  # sent, as a warning
    damaged = log.with_name("damaged.log")
    damaged.write_bytes(log.read_bytes() + b"[1]\n")
    refused = run("audit", "query", str(damaged))
    assert refused.returncode == 2
    assert (
        refused.stderr.strip() == f"error: {damaged}: record {known + 2}: not a record "
        "(a JSON object)"
    )
