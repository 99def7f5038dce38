"""A revocation takes effect before its record is written, and its record is never lost nor
changed (issue 30 review, ``decisions/results.py``, ``decisions/owed.py``): when the log fails
after the store revoked a result, the entry keeps the record its revoker made (who, when, why)
and the store keeps the entry, past its expiry if need be; each process's periodic pass writes
it once, marked ``written_late``, however many processes pass at the same moment, with no
re-decision needed. Real decision log, real SQLite (and Redis) attestation stores, the shipped
policy compiled by OPA (it allows no image here, so every re-decided result is revoked).
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import secrets
import shutil
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from broker.attestation.late import late_record
from broker.attestation.service import VerifiedEvidence
from broker.attestation.stored import (
    RECORD_GRACE,
    REVOKED,
    AttestationEntry,
    AttestationStore,
    revoke,
)
from broker.audit.log import DecisionLog
from broker.audit.ocsf import ocsf_events
from broker.core.errors import NotFound, UpstreamError
from broker.core.refs import store_ref
from broker.decisions.owed import OwedRecordPass
from broker.decisions.results import AttestationResults
from broker.policy.build import compile_policy_dir
from broker.policy.testing import find_opa
from broker.policy.wasm import WasmPolicyEngine
from broker.stores.attestations import open_attestation_store

SHIPPED = Path(__file__).parents[2] / "policies"
INPUT = {"request": {"kind": "attest"}, "tee": {"debug": False}}


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


async def opened_log(tmp_path: Path) -> DecisionLog:
    log = DecisionLog(tmp_path / "audit" / "decisions.jsonl")
    await log.open()
    return log


def sqlite_store(tmp_path: Path) -> AttestationStore:
    uri = f"sqlite:///{tmp_path / 'attestations.db'}"
    return open_attestation_store(store_ref(uri, "nonces.store"), timeout=5)


async def result(store: AttestationStore, expires_at: datetime, **policy: Any) -> str:
    jti = secrets.token_hex(8)
    await store.put(AttestationEntry(jti, expires_at, "p" * 43, {**INPUT, **policy}))
    return jti


async def until(condition: Callable[[], Any], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while True:
            met = condition()
            if await met if inspect.isawaitable(met) else met:
                return
            await asyncio.sleep(0.01)


async def test_an_admin_revocation_the_log_refused_is_written_later_as_the_admin_made_it(
    tmp_path: Path, engine: WasmPolicyEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admin gets 503, the revocation is in effect, and the record is handed to the passes
    at once: the failing process's own pass is woken (and fails: its log is still down), and a
    process whose log works writes it on its periodic pass, with no re-decision, as the admin's
    record (who, the revocation's time, the reason), marked ``written_late``."""
    now = datetime.now(UTC)
    store = sqlite_store(tmp_path)
    jti = await result(store, now + timedelta(minutes=5))
    crashed = await opened_log(tmp_path)
    disk_full(monkeypatch)
    failing = AttestationResults(store=store, audit=crashed, policy=engine)
    passes: list[int] = []

    async def write_owed(at: datetime) -> int:
        passes.append(written := await failing.write_owed(at))
        return written

    own = OwedRecordPass(write_owed, lambda: now, interval=3600, soon=0)
    failing.on_owed(own.wake)
    own.start()
    await until(lambda: passes == [0])  # the start-up pass: nothing owed
    with pytest.raises(UpstreamError) as caught:
        await failing.revoke(jti, reason="its key leaked", who="token:0123456789ab", now=now)
    assert caught.value.code == "audit_log_unavailable"  # 503 to the admin
    assert (await failing.status(jti, now)).status == REVOKED  # in effect all the same
    await until(lambda: passes == [0, 0])  # woken, not an hour later: its log still refuses
    await own.close()
    owed = await store.get(jti, now)
    assert owed is not None
    assert owed.record_due == now  # handed back: due for any process
    monkeypatch.undo()
    await crashed.close()

    log = await opened_log(tmp_path)  # another process, or this one restarted
    working = AttestationResults(store=sqlite_store(tmp_path), audit=log, policy=engine)
    clock = [now - timedelta(seconds=1)]  # not due yet: the start-up pass writes nothing
    periodic = OwedRecordPass(working.write_owed, lambda: clock[0], interval=0.05, soon=0)
    periodic.start()
    await asyncio.sleep(0.2)
    assert await revocations(log) == []
    later = clock[0] = now + timedelta(seconds=1)
    await until(lambda: revocations(log))  # a periodic pass, nothing woke it
    await asyncio.sleep(0.2)  # a few more passes: nothing more to write
    await periodic.close()
    (record,) = await revocations(log)
    assert record == {
        **record,  # what the log adds to every record
        "type": "attestation_revoked",
        "jti": jti,
        "time": now.isoformat(),
        "who": "token:0123456789ab",
        "reason": "its key leaked",
        "written_late": True,
        "written_at": later.isoformat(),
    }
    assert "trigger" not in record  # an admin's, not a re-decision's
    (event,) = ocsf_events(record)  # a SIEM sees when it happened, who did it, and the delay
    assert event["time"] == int(now.timestamp() * 1000)
    assert event["actor"]["user"]["uid"] == "token:0123456789ab"
    assert event["unmapped"]["written_late"] is True
    assert event["unmapped"]["written_at"] == later.isoformat()
    assert await store.owed() == []
    await log.close()
    await working.store.close()
    await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_result_revoked_in_its_last_second_is_recorded_after_it_expired(
    kind: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    engine: WasmPolicyEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Revoked with the log full a second before it expires (``attest.ttl_seconds`` ≤ 60 makes
    every revocation one of these): the store's clean-up and expiry leave it alone until a pass
    writes its record; its status meanwhile is 404, as for any expired result."""
    if kind == "redis":
        uri = str(request.getfixturevalue("redis_url"))
        store = open_attestation_store(store_ref(uri, "nonces.store"), timeout=5)
    else:
        store = sqlite_store(tmp_path)
    now = datetime.now(UTC)
    jti = await result(store, now + timedelta(seconds=1))
    crashed = await opened_log(tmp_path)
    disk_full(monkeypatch)
    revoker = AttestationResults(store=store, audit=crashed, policy=engine)
    with pytest.raises(UpstreamError):
        await revoker.revoke(jti, reason="compromised", who="token:0123456789ab", now=now)
    monkeypatch.undo()
    await crashed.close()
    await asyncio.sleep(2.2)  # expired by every clock, Redis's whole-second EXAT too
    after = datetime.now(UTC)
    await result(store, after + timedelta(seconds=1))  # where SQLite deletes expired rows
    log = await opened_log(tmp_path)
    results = AttestationResults(store=store, audit=log, policy=engine)
    with pytest.raises(NotFound):
        await results.status(jti, after)
    assert await results.write_owed(after) == 1
    (record,) = [r for r in await revocations(log) if r["jti"] == jti]
    assert (record["who"], record["time"], record["reason"]) == (
        "token:0123456789ab",
        now.isoformat(),
        "compromised",
    )
    assert (record["written_late"], record["written_at"]) == (True, after.isoformat())
    assert jti not in {e.jti for e in await store.owed()}
    await log.close()
    await store.close()


async def test_four_processes_passing_at_once_write_one_record(
    tmp_path: Path, engine: WasmPolicyEngine
) -> None:
    """A re-decision revoked a result and its process stopped before the record (only the
    store's update happened): nothing is written while the revoker may still write it, and
    meanwhile a re-decision neither fails nor writes it (issue D); once due, four processes
    passing at the same moment write it once, with the re-decision's trigger, policy and
    reasons."""
    now = datetime.now(UTC)
    store = sqlite_store(tmp_path)
    jti = await result(store, now + timedelta(minutes=30))
    facts = {"trigger": "policy_change", "policy_digest": "sha256:" + "e" * 64, "reasons": ["r"]}
    assert await revoke(store, jti, "policy denies it", now, who="alice", facts=facts)
    log = await opened_log(tmp_path)
    replicas = [
        AttestationResults(store=sqlite_store(tmp_path), audit=log, policy=engine) for _ in range(4)
    ]
    soon = now + timedelta(seconds=1)
    assert await replicas[0].revalidate(who="broker", now=soon) == 0  # revoked: skipped
    assert [await r.write_owed(soon) for r in replicas] == [0, 0, 0, 0]  # the revoker's, still
    assert await revocations(log) == []

    due = now + RECORD_GRACE
    done = await asyncio.gather(*(r.write_owed(due) for r in replicas))
    assert sorted(done) == [0, 0, 0, 1]
    (record,) = await revocations(log)
    assert record == {
        **record,
        "jti": jti,
        "time": now.isoformat(),
        "who": "alice",
        "reason": "policy denies it",
        **facts,
        "written_late": True,
        "written_at": due.isoformat(),
    }
    for replica in replicas:  # nothing owed now
        assert await replica.write_owed(due + 2 * RECORD_GRACE) == 0
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
    jti = await result(store, now + timedelta(minutes=30))
    log = await opened_log(tmp_path)
    results = AttestationResults(store=store, audit=log, policy=engine)
    assert await results.revalidate(who="broker", now=now) == 1
    entry = await store.get(jti, now)
    assert entry is not None
    assert (entry.status, entry.record_due, entry.pending_record) == (REVOKED, None, None)
    assert await store.owed() == []
    assert await results.write_owed(now + RECORD_GRACE) == 0
    (record,) = await revocations(log)
    assert (record["jti"], record["who"], record["trigger"]) == (jti, "broker", "policy_change")
    assert "written_late" not in record
    await log.close()
    await store.close()


async def test_an_ocsp_revocation_the_log_refused_is_written_later(
    tmp_path: Path, engine: WasmPolicyEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OCSP sweep (``seen``) revokes every result that used a revoked GPU even while the
    log refuses their records (the revocations stand; the records are owed, this process's pass
    woken); a pass writes them later, ``who`` ``ocsp`` and what was revoked."""
    now = datetime.now(UTC)
    store = sqlite_store(tmp_path)
    gpu = {"gpus": [{"ueid": "4242", "verifier": "nras"}]}
    used = [await result(store, now + timedelta(minutes=5), **gpu) for _ in range(2)]
    other = await result(store, now + timedelta(minutes=5))
    crashed = await opened_log(tmp_path)
    disk_full(monkeypatch)
    sweeping = AttestationResults(store=store, audit=crashed, policy=engine)
    woken: list[bool] = []
    sweeping.on_owed(lambda: woken.append(True))
    revoked_gpu = [{"verifier": "nras", "ocsp": "revoked", "ueid": "4242"}]
    await sweeping.seen(VerifiedEvidence(tee={}, raw_claims={}, identity={}, gpus=revoked_gpu), now)
    monkeypatch.undo()
    await crashed.close()
    assert woken == [True, True]  # each record it could not write
    statuses = {j: (await store.get(j, now)) for j in [*used, other]}
    assert {j: e.status for j, e in statuses.items() if e is not None} == {
        **dict.fromkeys(used, REVOKED),
        other: "active",
    }

    log = await opened_log(tmp_path)
    results = AttestationResults(store=store, audit=log, policy=engine)
    assert await results.write_owed(now) == 2  # handed over: due at once
    written = {r["jti"]: r for r in await revocations(log)}
    assert set(written) == set(used)
    for record in written.values():
        assert (record["who"], record["revoked"], record["written_late"]) == (
            "ocsp",
            ["gpu:4242"],
            True,
        )
        assert record["time"] == now.isoformat()
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
    assert (entry.record_due, entry.pending_record, entry.owed) == (None, None, False)
    assert entry.to_json() == json.dumps(json.loads(old), separators=(",", ":"), sort_keys=True)


def test_a_record_owed_without_its_body_is_written_with_what_the_entry_says() -> None:
    """An entry a broker owing only ``record_due`` left (before records were kept whole): the
    record says the reason, ``who`` ``broker`` and ``trigger`` ``record``, marked late."""
    due = datetime(2026, 1, 1, tzinfo=UTC)
    entry = AttestationEntry("j", due, "p", {}, REVOKED, "r", record_due=due)
    assert late_record(entry, due) == {
        "type": "attestation_revoked",
        "jti": "j",
        "time": due.isoformat(),
        "who": "broker",
        "reason": "r",
        "trigger": "record",
        "written_late": True,
        "written_at": due.isoformat(),
    }
