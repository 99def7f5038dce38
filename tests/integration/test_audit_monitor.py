"""``broker audit monitor``: a cron job that follows a log checkpoint by checkpoint, against a live
broker's public audit API and against a log on disk, and says what broke when the log is not
the one it saw before (a forger who rewrites a record and re-signs, a truncation, a foreign key).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.audit.log import DecisionLog
from broker.audit.publisher import checkpoint_paths
from broker.audit.records import record_hash
from broker.core.encoding import canonical
from broker.crypto.checkpoint import Checkpoint, NoteSigner
from broker.crypto.merkle import MerkleTree
from tests.integration.conftest import RunningBroker
from tests.support.cli import Ran, run
from tests.support.constants import KEY

ORIGIN = "monitor.test/log"


def monitor(state: Path, source: str, *extra: str) -> tuple[int, dict[str, Any]]:
    done: Ran = run("audit", "monitor", "--state", str(state), source, *extra)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(lines[-1]) if lines else {"stderr": done.stderr}


def write_log(path: Path, records: int) -> None:
    async def write() -> None:
        log = DecisionLog(path)
        await log.open()
        for n in range(records):
            await log.append({"type": "release", "n": n})
        await log.close()

    asyncio.run(write())


def sign(path: Path, signer: NoteSigner) -> None:
    """A checkpoint of the whole file, as the publisher writes it."""
    tree = MerkleTree.from_lines(path.read_bytes().split(b"\n")[:-1])
    checkpoint_paths(path)[0].write_text(
        signer.sign(Checkpoint(ORIGIN, tree.size, tree.root()).body())
    )


def rewrite(path: Path, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    """Change records and recompute the chain, as a forger with the log file would."""
    records = change([json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]])
    for i, record in enumerate(records):
        record["prev"] = records[i - 1]["hash"] if i else "0" * 64
        record["index"] = record["seq"] = i
        record.pop("hash", None)
        record["hash"] = record_hash(record)
    path.write_bytes(b"".join(canonical(r) + b"\n" for r in records))


@pytest.fixture
def local(tmp_path: Path) -> tuple[Path, NoteSigner, Path]:
    path = tmp_path / "decisions.log"
    write_log(path, 20)
    signer = NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate())
    sign(path, signer)
    return path, signer, tmp_path / "state" / "monitor.json"


def test_a_growing_log_passes_and_the_key_is_pinned(local: tuple[Path, NoteSigner, Path]) -> None:
    path, signer, state = local
    code, first = monitor(state, str(path), "--key", signer.verifier_key())
    assert (code, first["ok"], first["size"], first["previous_size"]) == (0, True, 20, None)
    write_log(path, 5)  # the same log grows (DecisionLog appends)
    sign(path, signer)
    code, second = monitor(state, str(path))  # the pinned key from the state
    assert (code, second["ok"], second["size"], second["previous_size"]) == (0, True, 25, 20)
    stranger = NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate()).verifier_key()
    code, refused = monitor(state, str(path), "--key", stranger)
    assert code == 2
    assert "differs from the key this monitor pinned" in refused["stderr"]


def test_a_rewritten_record_is_caught_though_the_chain_and_signature_are_fresh(
    local: tuple[Path, NoteSigner, Path],
) -> None:
    path, signer, state = local
    assert monitor(state, str(path), "--key", signer.verifier_key())[0] == 0
    before = state.read_bytes()

    def forge(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records[3]["n"] = 999  # an old decision changed; the chain recomputed
        return [*records, {"type": "release", "n": 20}]

    rewrite(path, forge)
    sign(path, signer)  # even a checkpoint signed with the real key
    code, answer = monitor(state, str(path))
    assert (code, answer["ok"], answer["checked"]) == (1, False, True)
    assert "does not extend the 20 seen before" in answer["problem"]
    assert state.read_bytes() == before  # the last good state is kept


def test_a_truncated_log_and_a_changed_root_are_caught(
    local: tuple[Path, NoteSigner, Path],
) -> None:
    path, signer, state = local
    assert monitor(state, str(path), "--key", signer.verifier_key())[0] == 0
    rewrite(path, lambda records: records[:-2])
    sign(path, signer)
    code, shrank = monitor(state, str(path))
    assert (code, shrank["ok"]) == (1, False)
    assert "the log shrank: 18 records, 20 seen before" in shrank["problem"]
    rewrite(path, lambda records: [*records, {"type": "release", "n": 40}, {"n": 41}])
    sign(path, signer)
    code, other = monitor(state, str(path))
    assert "another root" in other["problem"]


def test_a_checkpoint_signed_by_another_key_is_caught(local: tuple[Path, NoteSigner, Path]) -> None:
    path, signer, state = local
    assert monitor(state, str(path), "--key", signer.verifier_key())[0] == 0
    sign(path, NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate()))
    code, answer = monitor(state, str(path))
    assert (code, answer["ok"]) == (1, False)
    assert "not signed by the pinned key" in answer["problem"]


def test_first_run_needs_a_key_and_an_unreachable_broker_is_exit_3(tmp_path: Path) -> None:
    state = tmp_path / "monitor.json"
    code, answer = monitor(state, str(tmp_path / "decisions.log"))
    assert code == 2
    assert "the first run pins the log's verifier key" in answer["stderr"]
    key = NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate()).verifier_key()
    code, answer = monitor(state, "http://127.0.0.1:9", "--key", key, "--timeout", "2")
    assert (code, answer["checked"]) == (3, False)
    assert not state.exists()


async def test_a_live_broker_is_followed_through_its_public_api(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker()
    key = (
        await asyncio.to_thread(
            run, "audit", "key", "--config", str(broker.workdir / "broker.toml")
        )
    ).stdout.strip()
    state = broker.workdir / "monitor.json"
    ca = str(broker.workdir / "tls" / "ca.pem")
    code, first = await asyncio.to_thread(monitor, state, broker.url, "--key", key, "--ca", ca)
    assert (code, first["ok"]) == (0, True), first
    async with broker.client() as client:
        for _ in range(3):
            await client.release(KEY, broker.token_source())
    for _ in range(100):  # checkpoints are published every few seconds
        code, later = await asyncio.to_thread(monitor, state, broker.url, "--ca", ca)
        assert (code, later["ok"]) == (0, True), later
        if later["size"] >= first["size"] + 3:
            break
        await asyncio.sleep(0.2)
    assert later["previous_size"] >= first["size"]
    assert later["size"] >= first["size"] + 3


def test_plain_http_is_allowed_only_to_a_loopback_host_parsed_as_a_url(tmp_path: Path) -> None:
    """``http://127.0.0.1@evil.example/`` (user info, then a remote host) and
    ``http://127.0.0.1.evil.example/`` (a remote name that starts like loopback) are remote:
    refused before any request; a real loopback host is allowed (and here unreachable, exit 3)."""
    state = tmp_path / "monitor.json"
    key = NoteSigner(ORIGIN, ed25519.Ed25519PrivateKey.generate()).verifier_key()
    for remote in (
        "http://127.0.0.1@evil.example/",
        "http://127.0.0.1.evil.example/",
        "http://127.0.0.1:80@evil.example:8080/",
        "http://evil.example/?127.0.0.1",
    ):
        code, answer = monitor(state, remote, "--key", key)
        assert code == 2, remote
        assert "http:// only on loopback" in answer["stderr"] or "user name" in answer["stderr"]
    for local in ("http://127.0.0.1:9", "http://[::1]:9", "http://localhost:9"):
        code, answer = monitor(state, local, "--key", key, "--timeout", "2")
        assert (code, answer["checked"]) == (3, False), local
    assert not state.exists()


def test_a_state_of_the_single_log_monitor_is_carried_over(
    local: tuple[Path, NoteSigner, Path],
) -> None:
    """A state file written before monitors followed several logs (version 1) still pins its
    key and size: a rewritten log is caught against it."""
    path, signer, state = local
    tree = MerkleTree.from_lines(path.read_bytes().split(b"\n")[:-1])
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(
        json.dumps(
            {
                "version": 1,
                "verifier_key": signer.verifier_key(),
                "size": tree.size,
                "root": base64.b64encode(tree.root()).decode(),
                "checkpoint": checkpoint_paths(path)[0].read_text(),
            }
        )
    )
    rewrite(path, lambda records: records[:-2])
    sign(path, signer)
    code, answer = monitor(state, str(path))
    assert (code, answer["ok"]) == (1, False)
    assert "the log shrank: 18 records, 20 seen before" in answer["problem"]


def test_several_logs_are_followed_each_with_its_own_key_and_state(tmp_path: Path) -> None:
    """Two replicas' logs on disk, one key each: both are followed; one rewritten is reported
    for its origin while the other's state still advances."""
    signers, paths = [], []
    for replica in ("r0", "r1"):
        path = tmp_path / replica / "decisions.log"
        path.parent.mkdir()
        write_log(path, 4)
        signer = NoteSigner(f"monitor.test/{replica}", ed25519.Ed25519PrivateKey.generate())
        tree = MerkleTree.from_lines(path.read_bytes().split(b"\n")[:-1])
        body = Checkpoint(signer.name, tree.size, tree.root()).body()
        checkpoint_paths(path)[0].write_text(signer.sign(body))
        signers.append(signer)
        paths.append(path)
    state = tmp_path / "monitor.json"
    keys = [arg for s in signers for arg in ("--key", s.verifier_key())]
    code, answer = monitor(state, *map(str, paths), *keys)
    assert code == 0, answer
    assert sorted(log["origin"] for log in answer["logs"]) == ["monitor.test/r0", "monitor.test/r1"]
    rewrite(paths[0], lambda records: records[:-1])  # r0 truncated and re-signed
    write_log(paths[1], 2)  # r1 grew
    for signer, path in zip(signers, paths, strict=True):
        tree = MerkleTree.from_lines(path.read_bytes().split(b"\n")[:-1])
        body = Checkpoint(signer.name, tree.size, tree.root()).body()
        checkpoint_paths(path)[0].write_text(signer.sign(body))
    code, answer = monitor(state, *map(str, paths))
    assert code == 1
    by_origin = {log["origin"]: log for log in answer["logs"]}
    assert "the log shrank" in by_origin["monitor.test/r0"]["problem"]
    assert (by_origin["monitor.test/r1"]["ok"], by_origin["monitor.test/r1"]["size"]) == (True, 6)
    pinned = json.loads(state.read_text())["logs"]
    assert (pinned["monitor.test/r0"]["size"], pinned["monitor.test/r1"]["size"]) == (4, 6)
