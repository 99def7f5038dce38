"""A revocation takes effect before its record is written, and its record is never lost
(issue 30, ``decisions/results.py``): when the log fails after the store revoked a result, the
entry says its record is owed; the re-decision after ``RECORD_GRACE`` writes it, once, however
many processes re-decide at the same moment. Real decision log, real SQLite attestation store,
the shipped policy compiled by OPA (it allows no image here, so every result is revoked).
"""

from __future__ import annotations

import asyncio
import errno
import json
import secrets
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from broker.attestation.stored import RECORD_GRACE, REVOKED, AttestationEntry
from broker.audit.log import DecisionLog
from broker.core.errors import UpstreamError
from broker.core.refs import store_ref
from broker.decisions.results import AttestationResults, RecordsOwed
from broker.policy.build import compile_policy_dir
from broker.policy.testing import find_opa
from broker.policy.wasm import WasmPolicyEngine
from broker.stores.attestations import open_attestation_store

SHIPPED = Path(__file__).parents[2] / "policies"


@pytest.fixture
def engine(tmp_path: Path) -> WasmPolicyEngine:
    shutil.copytree(SHIPPED, tmp_path / "policies")
    (tmp_path / "audit").mkdir()
    return WasmPolicyEngine(compile_policy_dir(tmp_path / "policies", opa=find_opa()))


def disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DecisionLog, "_seal_and_write", full)


async def revocations(log: DecisionLog) -> list[dict[str, Any]]:
    lines = await asyncio.to_thread(log.read_lines, 0, log.committed_size)
    return [r for r in map(json.loads, lines) if r["type"] == "attestation_revoked"]


async def test_a_revocation_whose_record_failed_is_recorded_once_later(
    tmp_path: Path, engine: WasmPolicyEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = datetime.now(UTC)
    uri = f"sqlite:///{tmp_path / 'attestations.db'}"
    store = open_attestation_store(store_ref(uri, "nonces.store"), timeout=5)
    jti = secrets.token_hex(8)
    policy_input = {"request": {"kind": "attest"}, "tee": {"debug": False}}
    await store.put(AttestationEntry(jti, now + timedelta(minutes=30), "p" * 43, policy_input))
    path = tmp_path / "audit" / "decisions.jsonl"
    crashed = DecisionLog(path)
    await crashed.open()
    disk_full(monkeypatch)
    results = AttestationResults(store=store, audit=crashed, policy=engine)
    with pytest.raises(UpstreamError):  # revoked, but the record could not be written
        await results.revalidate(who="broker", now=now)
    monkeypatch.undo()
    await crashed.close()
    entry = await store.get(jti, now)
    assert entry is not None
    assert (entry.status, entry.record_due) == (REVOKED, now + RECORD_GRACE)

    # restarted: the revoker may still be writing it, so not yet
    log = DecisionLog(path)
    await log.open()
    replicas = [
        AttestationResults(
            store=open_attestation_store(store_ref(uri, "nonces.store"), timeout=5),
            audit=log,
            policy=engine,
        )
        for _ in range(4)
    ]
    with pytest.raises(RecordsOwed):
        await replicas[0].revalidate(who="broker", now=now + timedelta(seconds=1))
    assert await revocations(log) == []

    # due: four processes re-deciding at once write it once
    due = now + RECORD_GRACE
    done = await asyncio.gather(
        *(r.revalidate(who="broker", now=due) for r in replicas), return_exceptions=True
    )
    assert all(d == 0 or isinstance(d, RecordsOwed) for d in done), done
    written = await revocations(log)
    assert [(r["jti"], r["trigger"], r["reason"]) for r in written] == [
        (jti, "record", entry.reason)
    ]
    later = await store.get(jti, due)
    assert later is not None
    assert later.record_due is None
    # nothing owed now: every replica's next run is done and writes nothing more
    for replica in replicas:
        assert await replica.revalidate(who="broker", now=due + RECORD_GRACE) == 0
    assert len(await revocations(log)) == 1
    await log.close()
    for replica in replicas:
        await replica.store.close()
    await store.close()


async def test_a_revocation_written_at_once_owes_nothing(
    tmp_path: Path, engine: WasmPolicyEngine
) -> None:
    now = datetime.now(UTC)
    store = open_attestation_store(store_ref("memory", "nonces.store"), timeout=5)
    jti = secrets.token_hex(8)
    await store.put(AttestationEntry(jti, now + timedelta(minutes=30), "p" * 43, {}))
    log = DecisionLog(tmp_path / "audit" / "decisions.jsonl")
    await log.open()
    results = AttestationResults(store=store, audit=log, policy=engine)
    assert await results.revalidate(who="broker", now=now) == 1
    entry = await store.get(jti, now)
    assert entry is not None
    assert (entry.status, entry.record_due) == (REVOKED, None)
    assert await results.revalidate(who="broker", now=now + RECORD_GRACE) == 0
    assert [r["jti"] for r in await revocations(log)] == [jti]
    await log.close()
    await store.close()


def test_an_entry_revoked_before_record_due_existed_owes_nothing() -> None:
    """Entries an older broker revoked carry no ``record_due``: their record was written then
    (after the revocation), so they are not written again."""
    old = json.dumps(
        {
            "jti": "j",
            "expires_at": 2e9,
            "pop_thumbprint": "p",
            "policy_input": {},
            "status": "revoked",
            "reason": "r",
            "log_index": 3,
        }
    )
    entry = AttestationEntry.from_json(old)
    assert entry.record_due is None
    assert entry.to_json() == json.dumps(json.loads(old), separators=(",", ":"), sort_keys=True)
