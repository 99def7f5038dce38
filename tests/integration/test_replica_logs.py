"""One honest log per replica, and auditors who follow all of them through the Service (issue 27,
item 2), tested as deployed: two ``broker serve`` replicas on one PostgreSQL store, each with its
own log directory, behind a round-robin proxy on loopback (``tests/support/proxy.py``: every
request goes to the other replica than the one before).

The attack these stop: replicas that signed different trees under one origin and one key, so that
through the Service a monitor saw the log "shrink", a runner's inclusion proof failed, and a
witness keyed by origin saw a fork. Now each replica signs its own origin; every answer names the
log (origin) and index it wrote; a request naming an origin is served by whichever replica the
proxy picks (it forwards to the one holding that log).
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.audit.identity import claim_origin
from broker.client import BrokerClient, ReleasedDek
from broker.config import load_settings
from broker.core.errors import ConfigError
from broker.crypto.checkpoint import NoteSigner
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from tests.integration.conftest import write_config
from tests.support.cli import Ran, run
from tests.support.constants import ALLOWED, KEY
from tests.support.issuers import dev_issuer
from tests.support.processes import free_port, serve, stop_replicas, wait_ready
from tests.support.proxy import round_robin_proxy
from tests.support.witness import OriginWitness, serve_witness

ORIGIN_PREFIX = "broker.dev.invalid/decisions/"


def cli(*args: str, environ: dict[str, str] | None = None) -> Ran:
    return run(*args, env=environ)


def monitor(state: Path, *args: str) -> tuple[int, dict[str, Any]]:
    done = run("audit", "monitor", "--state", str(state), *args)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(lines[-1]) if lines else {"stderr": done.stderr}


@pytest.mark.timeout(240)
async def test_monitor_prove_and_answers_follow_each_replicas_own_log_through_the_service(
    database: str, tmp_path: Path
) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    env = {"BROKER_KEYS_STORE": database, "BROKER_NONCES_STORE": database}
    for args in (
        ("keys", "migrate", "--config", str(config)),
        ("keys", "create", KEY, "--purpose", "model-weights", "--config", str(config)),
    ):
        done = await asyncio.to_thread(cli, *args, environ=env)
        assert done.returncode == 0, done.stderr
    ports = [free_port(), free_port()]
    origins = [ORIGIN_PREFIX + str(port) for port in ports]
    signing_key = tmp_path / "b" / "log-ed25519.pem"  # one KMS key for the deployment is fine:
    keys = [  # the origin is the note key's name, so each log has its own verifier key
        (await asyncio.to_thread(NoteSigner.from_pem, origin, signing_key)).verifier_key()
        for origin in origins
    ]
    witness = OriginWitness(dict(zip(origins, keys, strict=True)))
    async with serve_witness(witness, free_port()) as witness_url:
        replicas = _start_replicas(config, ports, tmp_path, database, witness, witness_url)
        try:
            runs = await _audit_through_the_service(tmp_path, ports, origins, keys, issuer)
        finally:
            await stop_replicas(replicas)  # each offers its last checkpoint to the witness
    code, report = runs[0]
    assert code == 0, report
    assert sorted(log["origin"] for log in report["logs"]) == sorted(origins)
    code, report = runs[1]
    assert code == 0, report
    for log in report["logs"]:  # every log only grew: no "the log shrank"
        assert log["ok"], log
        assert log["size"] >= log["previous_size"]
    logs = [tmp_path / f"replica-{i}" / "decisions.log" for i in range(2)]
    for port, log in zip(ports, logs, strict=True):  # each log: its own replica's records only
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert {r["replica"] for r in records} == {str(port)}
        identity = json.loads(log.with_name(log.name + ".identity").read_text())
        assert identity["origin"] == ORIGIN_PREFIX + str(port)
    # the witness, keyed by origin, saw two logs that only grew: no fork
    assert witness.refused == []
    assert set(witness.seen) == set(origins)
    pinned = [arg for key in keys for arg in ("--key", key)]  # one per replica, by origin
    verified = await asyncio.to_thread(
        cli, "audit", "verify", *map(str, logs), *pinned, "--witness-key", witness.verifier_key
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert [log["witnesses"] for log in json.loads(verified.stdout)["logs"]] == [
        [witness.name],
        [witness.name],
    ]


def _start_replicas(
    config: Path,
    ports: list[int],
    tmp_path: Path,
    database: str,
    witness: OriginWitness,
    witness_url: str,
) -> list[Any]:
    """Two ``broker serve`` replicas on one PostgreSQL store, each with its own log directory."""
    tls_dir = tmp_path / "b" / "tls"
    replica_env = {
        "BROKER_KEYS_STORE": database,
        "BROKER_NONCES_STORE": database,
        # the replica id is its port here, so that the peers' URL pattern reaches it on loopback
        # (deployed: https://{replica}.broker-headless.<namespace>.svc.cluster.local:8443)
        "BROKER_AUDIT_PEER_URL": "https://127.0.0.1:{replica}",
        "BROKER_AUDIT_PEER_CA": str(tls_dir / "ca.pem"),
        "BROKER_NONCES_CHALLENGE_KEY": str(tmp_path / "challenge.key"),  # one Secret for all
        "BROKER_AUDIT_WITNESSES": witness_url,
        "BROKER_AUDIT_WITNESS_KEYS": witness.verifier_key,
    }
    logs = [tmp_path / f"replica-{i}" / "decisions.log" for i in range(2)]  # a volume each
    return [
        serve(config, port, log, database, {**replica_env, "BROKER_SERVER_REPLICA_ID": str(port)})
        for port, log in zip(ports, logs, strict=True)
    ]


async def _audit_through_the_service(
    tmp_path: Path, ports: list[int], origins: list[str], keys: list[str], issuer: DevIssuer
) -> list[tuple[int, dict[str, Any]]]:
    """Releases, the monitor and ``client.prove()`` through the round-robin proxy; the two
    monitor runs' answers."""
    tls_dir = tmp_path / "b" / "tls"
    tls = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    for port in ports:
        await asyncio.to_thread(wait_ready, port, tls)
    proxy_port = free_port()
    service = f"https://127.0.0.1:{proxy_port}"
    upstreams = [f"https://127.0.0.1:{port}" for port in ports]
    async with round_robin_proxy(upstreams, tls_dir=tls_dir, port=proxy_port) as answered:
        released = await _release_through(service, tls, issuer, count=6)
        assert set(Counter(answered)) == set(upstreams)  # both replicas served
        # every answer names the log (origin) and index it was written to
        assert {r.log_origin for r in released} == set(origins)
        state = tmp_path / "monitor.json"
        ca = str(tls_dir / "ca.pem")
        first_run = await asyncio.to_thread(
            monitor, state, "--key", keys[0], "--key", keys[1], "--ca", ca, service
        )
        async with BrokerClient(service, ssl_context=tls) as client:
            for release in released:  # each proven against its own replica's log
                key = keys[origins.index(release.log_origin)]
                proven = await client.prove(release, key, wait_seconds=60)
                assert proven.tree_size > release.log_index
        more = await _release_through(service, tls, issuer, count=4)
        assert {r.log_origin for r in more} == set(origins)
        second_run = await _monitor_until_grown(state, service, ca, first_run[1])
    return [first_run, second_run]


async def _release_through(
    service: str, tls: ssl.SSLContext, issuer: DevIssuer, *, count: int
) -> list[ReleasedDek]:
    """``count`` releases by the SDK through the proxy. A release is two requests (challenge,
    release), so a health check after every other one shifts which replica gets the release."""
    source = DevTokenSource(issuer, Workload(image_digest=ALLOWED), lambda: datetime.now(UTC))
    released = []
    async with BrokerClient(service, ssl_context=tls) as client, aiohttp.ClientSession() as http:
        for turn in range(count):
            released.append(await client.release(KEY, source))
            if turn % 2 == 0:
                async with http.get(service + "/healthz", ssl=tls) as answer:
                    assert answer.status == 200
    return released


async def _monitor_until_grown(
    state: Path, service: str, ca: str, first: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """Run the monitor (as cron would) until both logs' checkpoints cover the new records."""
    sizes = {log["origin"]: log["size"] for log in first["logs"]}
    answer: tuple[int, dict[str, Any]] = (-1, {})
    for _ in range(150):
        answer = await asyncio.to_thread(monitor, state, "--ca", ca, service)
        code, report = answer
        if code != 0:
            return answer
        if all(log["size"] >= sizes[log["origin"]] + 2 for log in report["logs"]):
            return answer
        await asyncio.sleep(0.2)
    return answer


# --- one origin per replica: refused where the broker can tell --------------------------------


def test_replicas_sharing_a_store_under_one_origin_are_refused(tmp_path: Path) -> None:
    """The shipped shape before: two replicas on one PostgreSQL (or Redis) store, each signing
    checkpoints of its own tree under the one origin. Such a config does not load."""
    config = write_config(tmp_path / "b", dev_issuer())
    for store in ("postgresql://broker@127.0.0.1/broker", "redis://127.0.0.1:6379/0"):
        shared = {"BROKER_NONCES_STORE": store, "BROKER_SERVER_REPLICA_ID": "broker-1"}
        with pytest.raises(ConfigError, match=r"audit\.origin.*\{replica\}"):
            load_settings(config, {**shared, "BROKER_AUDIT_ORIGIN": "broker.example/decisions"})
        settings = load_settings(config, shared)  # the default: the replica id ends the origin
        assert settings.audit.origin == "broker.dev.invalid/decisions/broker-1"
    with pytest.raises(ConfigError, match=r"audit\.origin"):  # only as the last part
        load_settings(config, {"BROKER_AUDIT_ORIGIN": "b.example/{replica}/decisions"})
    for bad in ("https://peers.example:8443", "http://{replica}.peers.example:8443"):
        with pytest.raises(ConfigError, match=r"audit\.peer_url"):
            load_settings(config, {"BROKER_AUDIT_PEER_URL": bad})


def test_a_log_is_never_continued_under_another_origin(tmp_path: Path) -> None:
    """A log created by replica broker-0 (its volume re-attached to a pod configured as another
    replica, or an origin edited in place) is refused: its checkpoints would otherwise be
    signed under two origins, or two logs under one."""
    log = tmp_path / "decisions.log"
    claim_origin(log, origin="b.example/decisions/broker-0", replica="broker-0")
    assert claim_origin(log, origin="b.example/decisions/broker-0", replica="broker-0")
    refused = re.escape("is the log of origin 'b.example/decisions/broker-0'")
    with pytest.raises(ConfigError, match=refused):
        claim_origin(log, origin="b.example/decisions/broker-1", replica="broker-1")


async def test_only_this_deployments_logs_are_forwarded(start_broker: Any) -> None:
    """``?origin=`` reaches another replica only for an origin of this deployment (its prefix and
    a replica id: no host, port or path can be smuggled into the peer URL), never twice (a
    forwarded request is not forwarded again), and a peer that does not answer is a 503 with a
    stable code, never a traceback."""
    broker = await start_broker(environ={"BROKER_AUDIT_PEER_URL": "https://127.0.0.1:{replica}"})
    prefix = broker.settings.audit.origin.rpartition("/")[0] + "/"
    async with aiohttp.ClientSession() as session:

        async def get(origin: str, **headers: str) -> tuple[int, str]:
            url = f"{broker.url}/v1/log/checkpoint"
            params = {"origin": origin}
            async with session.get(url, params=params, ssl=broker.client_tls, headers=headers) as r:
                body = await r.json() if r.content_type == "application/json" else {}
                return r.status, body.get("error", {}).get("code", "")

        own = await get(broker.settings.audit.origin)
        assert own[0] == 200
        for origin in (
            "elsewhere.example/decisions/1",  # another deployment's
            prefix + "1@evil.example",  # not a replica id
            prefix + "1/../../admin",
            prefix + "",
            prefix + "evil.attacker",  # several DNS labels under peer_url's domain
            prefix + "-1",
        ):
            assert await get(origin) == (404, "not_found"), origin
        assert await get(prefix + "1", **{"Broker-Log-Forwarded": "1"}) == (404, "not_found")
        assert await get(prefix + "1") == (503, "log_peer_unavailable")  # nothing on port 1
