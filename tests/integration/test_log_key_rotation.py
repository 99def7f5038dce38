"""Rotating the checkpoint-signing key (issue 27, item 2): a documented procedure the log records
and ``broker audit monitor`` follows, tested as deployed (``broker serve --workers 2``, restarted
on the new key with the old one as ``previous_signing_key``).

The attacks these stop: a key changed silently (monitors then fail, and nothing in the log says
why, or an operator's slip replaces the key with any key at all), and a forged hand-over (a key
that is not the pinned one naming its own successor).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.handover import Handover, follow_handovers
from broker.audit.identity import handovers_path
from broker.client import BrokerClient
from broker.crypto.checkpoint import Checkpoint, NoteSigner
from broker.crypto.merkle import MerkleTree
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from broker.dev.workspace import private_pem
from tests.integration.conftest import write_config
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    create_key_with_cli,
    free_port,
    serve,
    stop_replicas,
    wait_ready,
)


def monitor(state: Path, *args: str) -> tuple[int, dict[str, Any]]:
    done = run("audit", "monitor", "--state", str(state), *args)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(lines[-1]) if lines else {"stderr": done.stderr}


def new_key(path: Path) -> Path:
    path.write_bytes(private_pem(ed25519.Ed25519PrivateKey.generate()))
    return path


async def release(url: str, tls: ssl.SSLContext, issuer: DevIssuer, count: int) -> None:
    source = DevTokenSource(issuer, Workload(image_digest=ALLOWED), lambda: datetime.now(UTC))
    async with BrokerClient(url, ssl_context=tls) as client:
        for _ in range(count):
            await client.release(KEY, source)


async def checkpoint_covers(url: str, tls: ssl.SSLContext, size: int) -> None:
    """Until the broker's checkpoint covers ``size`` records (published every 0.2 s here)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            async with session.get(url + "/v1/log/checkpoint", ssl=tls) as answer:
                if int((await answer.text()).split("\n")[1]) >= size:
                    return
            await asyncio.sleep(0.1)
    pytest.fail(f"no checkpoint covered {size} records")


@pytest.mark.timeout(240)
async def test_a_rotated_log_key_is_handed_over_recorded_and_followed(tmp_path: Path) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    await asyncio.to_thread(create_key_with_cli, config)
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    ca = str(tmp_path / "b" / "tls" / "ca.pem")
    log = tmp_path / "decisions.log"
    store = f"sqlite:///{tmp_path / 'nonces.db'}"
    workers = {"BROKER_SERVER_WORKERS": "2", "BROKER_SERVER_REPLICA_ID": "r0"}
    origin = "broker.dev.invalid/decisions/r0"
    old_pem = tmp_path / "b" / "log-ed25519.pem"
    new_pem = await asyncio.to_thread(new_key, tmp_path / "log-new.pem")
    old = (await asyncio.to_thread(NoteSigner.from_pem, origin, old_pem)).verifier_key()
    new = (await asyncio.to_thread(NoteSigner.from_pem, origin, new_pem)).verifier_key()
    state = tmp_path / "monitor.json"

    port = free_port()
    first = serve(config, port, log, store, workers)
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        await release(f"https://127.0.0.1:{port}", tls, issuer, 2)
        url = f"https://127.0.0.1:{port}"
        before = await asyncio.to_thread(monitor, state, "--key", old, "--ca", ca, url)
    finally:
        await stop_replicas([first])
    assert before[0] == 0, before

    rotated_env = {
        **workers,
        "BROKER_AUDIT_SIGNING_KEY": str(new_pem),
        "BROKER_AUDIT_PREVIOUS_SIGNING_KEY": str(old_pem),
    }
    port = free_port()
    second = serve(config, port, log, store, rotated_env)
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        await release(f"https://127.0.0.1:{port}", tls, issuer, 1)
        size = len((await asyncio.to_thread(log.read_text)).splitlines())
        await checkpoint_covers(f"https://127.0.0.1:{port}", tls, size)
        url = f"https://127.0.0.1:{port}"
        after = await asyncio.to_thread(monitor, state, "--ca", ca, url)
    finally:
        await stop_replicas([second])
    code, report = after
    assert code == 0, report
    assert report["key_rotated"] == [
        {"old_key": old, "new_key": new, "at_size": report["key_rotated"][0]["at_size"]}
    ]
    assert json.loads(state.read_text())["logs"][origin]["verifier_key"] == new
    records = [json.loads(line) for line in log.read_text().splitlines()]
    rotations = [r for r in records if r.get("type") == "log_key_rotation"]
    assert len(rotations) == 1  # two workers started on the new key: one hand-over
    assert (rotations[0]["old_key"], rotations[0]["new_key"]) == (old, new)
    verified = await asyncio.to_thread(run, "audit", "verify", str(log), "--key", new)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # a key the log does not know (no hand-over from the recorded one): the broker refuses
    other = await asyncio.to_thread(new_key, tmp_path / "other.pem")
    # (one process: a supervisor would restart a worker that fails to start)
    stranger = {"BROKER_SERVER_REPLICA_ID": "r0", "BROKER_AUDIT_SIGNING_KEY": str(other)}
    refused = serve(config, free_port(), log, store, stranger)
    try:
        _, stderr = await asyncio.to_thread(refused.communicate, timeout=60)
    finally:
        if refused.poll() is None:
            refused.kill()
            await asyncio.to_thread(refused.wait)
    assert refused.returncode != 0
    assert "previous_signing_key" in stderr


def test_a_forged_handover_is_not_followed(tmp_path: Path) -> None:
    """A hand-over signed by any key but the pinned one is ignored: the monitor says the
    checkpoint is not signed by the pinned key (exit 1) and keeps its state."""
    origin = "monitor.test/r0"
    pinned = NoteSigner(origin, ed25519.Ed25519PrivateKey.generate())
    forger = NoteSigner(origin, ed25519.Ed25519PrivateKey.generate())
    successor = NoteSigner(origin, ed25519.Ed25519PrivateKey.generate())
    log = tmp_path / "decisions.log"
    log.write_bytes(b"".join(b'{"n":%d}\n' % n for n in range(5)))
    tree = MerkleTree.from_lines(log.read_bytes().split(b"\n")[:-1])
    checkpoint = log.with_name(log.name + ".checkpoint")
    checkpoint.write_text(pinned.sign(Checkpoint(origin, 5, tree.root()).body()))
    state = tmp_path / "monitor.json"
    assert monitor(state, "--key", pinned.verifier_key(), str(log))[0] == 0
    before = state.read_bytes()
    forged = Handover(origin, pinned.verifier_key(), successor.verifier_key(), 5).body()
    handovers_path(log).write_text(json.dumps({"note": forger.sign(forged)}) + "\n")
    checkpoint.write_text(successor.sign(Checkpoint(origin, 5, tree.root()).body()))
    code, answer = monitor(state, str(log))
    assert (code, answer["ok"]) == (1, False)
    assert "not signed by the pinned key" in answer["problem"]
    assert state.read_bytes() == before
    assert follow_handovers(pinned.verifier_key(), [forger.sign(forged)]) == []
    assert len(follow_handovers(pinned.verifier_key(), [pinned.sign(forged)])) == 1


def test_an_old_key_signing_past_its_handover_is_a_fork(tmp_path: Path) -> None:
    """The pinned key handed over at size 3 but the monitor saw it sign 5 records: two
    histories under one origin, refused even though the hand-over itself is genuine."""
    origin = "monitor.test/r0"
    old = NoteSigner(origin, ed25519.Ed25519PrivateKey.generate())
    new = NoteSigner(origin, ed25519.Ed25519PrivateKey.generate())
    log = tmp_path / "decisions.log"
    log.write_bytes(b"".join(b'{"n":%d}\n' % n for n in range(6)))
    tree = MerkleTree.from_lines(log.read_bytes().split(b"\n")[:-1])
    checkpoint = log.with_name(log.name + ".checkpoint")
    checkpoint.write_text(old.sign(Checkpoint(origin, 5, tree.root(5)).body()))
    state = tmp_path / "monitor.json"
    assert monitor(state, "--key", old.verifier_key(), str(log))[0] == 0
    handover = Handover(origin, old.verifier_key(), new.verifier_key(), 3).body()
    handovers_path(log).write_text(json.dumps({"note": old.sign(handover)}) + "\n")
    checkpoint.write_text(new.sign(Checkpoint(origin, 6, tree.root()).body()))
    code, answer = monitor(state, str(log))
    assert code == 1
    assert "past its hand-over" in answer["problem"]
