"""Whoever can write the shared attestation store (the operator, whom the sealed broker trusts
for a result's status only) can neither add records of their own to the decision log nor stop
it (security review): an owed revocation record is rebuilt from checked fields
(``attestation/late.py``), an entry is parsed strictly (``AttestationEntry.from_json``) and a
record the log cannot encode fails alone (``audit/log.py``). Real SQLite and Redis stores
written as an operator would, a real decision log, and a running broker for the release path.
"""

from __future__ import annotations

import asyncio
import json
import pydoc
import secrets
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from broker.attestation.late import UNEXPECTED
from broker.attestation.stored import KEPT_WHILE_OWED, RECORD_GRACE, AttestationStore, revoke
from broker.audit.log import DecisionLog
from broker.core.errors import ErrorCode, UpstreamError
from broker.core.refs import store_ref
from broker.decisions.results import AttestationResults
from broker.policy.wasm import WasmPolicyEngine
from broker.stores.attestations import open_attestation_store
from broker.stores.attestations_shared import RedisAttestations
from tests.integration.attested import Runner, attest_broker
from tests.integration.conftest import RunningBroker
from tests.integration.decision_flows import RECORD_BODIES
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.integration.test_revocation_records import (
    INPUT,
    engine,  # noqa: F401 - the fixture
    opened_log,
    result,
    sqlite_store,
)

WHO = "token:0123456789ab"
LOG_MEMBERS = {"index", "seq", "prev", "hash"}  # what the log adds to every record
FACTS = {"trigger": "policy_change", "policy_digest": "sha256:" + "e" * 64, "reasons": ["r"]}
LEGIT = {"type": "attestation_revoked", "who": WHO, "reason": "its key leaked", **FACTS}
FORGED_KEY_ADMIN = {
    "type": "key_admin",
    "action": "destroy",
    "key": "models/llama",
    "who": "alice@example.com",
    "result": "ok",
}


def entry_text(jti: str, now: datetime, **changes: Any) -> str:
    """A revoked entry owing its record since a second ago, as an operator would write it
    (``json.dumps`` writes ``NaN`` for a float NaN, as Python's parser reads it)."""
    value = {
        "jti": jti,
        "expires_at": (now + timedelta(minutes=5)).timestamp(),
        "pop_thumbprint": "p" * 43,
        "policy_input": INPUT,
        "status": "revoked",
        "reason": "forged",
        "log_index": None,
        "record_due": (now - timedelta(seconds=1)).timestamp(),
        **changes,
    }
    return json.dumps(value)


async def forge(where: Path | str, jti: str, body: str) -> None:
    """Write ``body`` as ``jti``'s entry behind the broker's back, owed (kept past expiry), in
    the SQLite store's file or the Redis server at ``where``."""
    if isinstance(where, str):
        client = Redis.from_url(where)
        await client.set(RedisAttestations.PREFIX + jti, body.encode())
        await client.sadd(RedisAttestations.OWED, jti)  # type: ignore[misc]
        await client.aclose()
        return
    row = (jti, KEPT_WHILE_OWED.timestamp(), body)
    with sqlite3.connect(where) as db:
        db.execute(
            "INSERT OR REPLACE INTO attestations (jti, expires_at, body) VALUES (?,?,?)", row
        )


async def records(log: DecisionLog) -> list[dict[str, Any]]:
    lines = await asyncio.to_thread(log.read_lines, 0, log.committed_size)
    return [json.loads(line) for line in lines]


async def legit_owed(store: AttestationStore, now: datetime) -> str:
    """A result an admin revoked a grace ago whose record was never written (its revoker
    stopped): due now, for any pass."""
    jti = await result(store, now + timedelta(minutes=5))
    then = now - RECORD_GRACE - timedelta(seconds=1)
    assert await revoke(store, jti, "its key leaked", then, who=WHO, facts=FACTS)
    return jti


FORGED_RECORDS = {
    "a key_admin record": FORGED_KEY_ADMIN,
    "a policy_change record": {"type": "policy_change", "new_digest": "sha256:" + "f" * 64},
    "a member no revoker writes": {**LEGIT, "result": "ok"},
    "another result's jti": {**LEGIT, "jti": "another"},
    "a who that is not printable": {**LEGIT, "who": 'alice\n{"type":"key_admin"}'},
    "a time that is not an instant": {**LEGIT, "time": "yesterday"},
    "a reason that is not a string": {**LEGIT, "reason": {"nested": "x"}},
    "reasons that are not strings": {**LEGIT, "reasons": [{"nested": "x"}]},
    "a record too long": {**LEGIT, "reasons": ["x" * 1000] * 60},
}


@pytest.mark.parametrize("held", FORGED_RECORDS.values(), ids=FORGED_RECORDS)
async def test_an_owed_record_the_store_forged_is_never_written_as_it_holds_it(
    tmp_path: Path,
    engine: WasmPolicyEngine,  # noqa: F811
    held: dict[str, Any],
) -> None:
    """Repro 1 of the review: a row due in the past whose ``pending_record`` is a ``key_admin``
    record (or a ``policy_change``, which also moved the writer's policy digest) became that
    record at the next pass. Now the revocation the store says is recorded, minimal (the
    entry's jti, ``who`` ``broker``, ``UNEXPECTED``), and a genuine owed record beside it is
    written as its revoker made it."""
    now = datetime.now(UTC)
    store = sqlite_store(tmp_path)
    genuine = await legit_owed(store, now)
    forged = secrets.token_hex(8)
    held = {"jti": forged, "time": now.isoformat(), **held}
    await forge(tmp_path / "attestations.db", forged, entry_text(forged, now, pending_record=held))
    log = await opened_log(tmp_path)
    results = AttestationResults(store=store, audit=log, policy=engine)
    assert await results.write_owed(now) == 2
    written = {r["jti"]: r for r in await records(log)}
    assert {r["type"] for r in written.values()} == {"attestation_revoked"}
    assert {k: v for k, v in written[forged].items() if k not in LOG_MEMBERS} == {
        "type": "attestation_revoked",
        "jti": forged,
        "time": now.isoformat(),
        "who": "broker",
        "reason": UNEXPECTED,
        "written_late": True,
        "written_at": now.isoformat(),
    }
    then = now - RECORD_GRACE - timedelta(seconds=1)
    assert written[genuine] == {
        **written[genuine],
        **LEGIT,
        "jti": genuine,
        "time": then.isoformat(),
        "written_late": True,
    }
    assert await store.owed() == []  # both written: nothing owed any more
    # the writer's policy digest did not move: the next policy_change chains to none
    changed = await log.append_policy_change({"new_digest": "sha256:" + "f" * 64})
    assert changed is not None
    assert (await records(log))[changed.index]["old_digest"] is None
    await log.append({"type": "probe"})  # the log takes appends
    await log.close()
    await store.close()


MALFORMED = {
    "reason NaN": lambda jti, now: entry_text(jti, now, reason=float("nan")),
    "NaN in the owed record": lambda jti, now: entry_text(
        jti, now, pending_record={**LEGIT, "jti": jti, "time": now.isoformat(), "x": float("nan")}
    ),
    "a number out of range": lambda jti, now: entry_text(jti, now, log_index="B").replace(
        '"B"', "1e999"
    ),
    "an unknown status": lambda jti, now: entry_text(jti, now, status="maybe"),
    "a reason too long": lambda jti, now: entry_text(jti, now, reason="x" * 513),
    "a jti not a string": lambda jti, now: entry_text(jti, now).replace(f'"{jti}"', "7"),
    "an owed record not an object": lambda jti, now: entry_text(jti, now, pending_record=[1]),
    "duplicate members": lambda jti, now: entry_text(jti, now)[:-1] + ', "status": "active"}',
    "not JSON": lambda jti, now: "not json {",
    "not an object": lambda jti, now: "[1, 2]",
}


@pytest.mark.parametrize("form", MALFORMED.values(), ids=MALFORMED)
async def test_an_entry_no_broker_writes_stops_neither_the_log_nor_the_pass(
    tmp_path: Path,
    engine: WasmPolicyEngine,  # noqa: F811
    form: Callable[[str, datetime], str],
) -> None:
    """Repro 2: ``"reason": NaN`` failed the append inside the log's writer thread, which then
    refused every later append (every release), again after each restart. Now such an entry is
    the store answering nonsense: listings skip it (logged), the pass writes the genuine owed
    record and goes on, a re-decision re-decides the others, and reading it is 503
    ``attestation_store_mismatch``."""
    now = datetime.now(UTC)
    store = sqlite_store(tmp_path)
    genuine = await legit_owed(store, now)
    active = await result(store, now + timedelta(minutes=5))
    bad = secrets.token_hex(8)
    await forge(tmp_path / "attestations.db", bad, form(bad, now))
    log = await opened_log(tmp_path)
    results = AttestationResults(store=store, audit=log, policy=engine)
    for _ in range(2):  # each start's pass: the genuine record once, the bad entry skipped
        assert await results.write_owed(now) in {0, 1}
    assert [(r["type"], r["jti"]) for r in await records(log)] == [("attestation_revoked", genuine)]
    assert await results.revalidate(who="broker", now=now) == 1  # the active one, re-decided
    for refused in (results.status(bad, now), results.revoke(bad, reason="r", who=WHO, now=now)):
        with pytest.raises(UpstreamError) as caught:
            await refused
        assert (caught.value.code, caught.value.status) == (
            ErrorCode.ATTESTATION_STORE_MISMATCH,
            503,
        )
    assert await log.append({"type": "probe"})  # the log takes appends
    assert [r["jti"] for r in await records(log) if r["type"] == "attestation_revoked"] == [
        genuine,
        active,
    ]
    await log.close()
    await store.close()


async def test_a_shared_store_nan_entry_is_skipped_too(
    tmp_path: Path,
    engine: WasmPolicyEngine,  # noqa: F811
    redis_url: str,
) -> None:
    """The same with Redis: a ``NaN`` entry in the owed set is skipped, the genuine one
    written, and the log keeps taking appends."""
    now = datetime.now(UTC)
    store = open_attestation_store(store_ref(redis_url, "nonces.store"), timeout=5)
    genuine = await legit_owed(store, now)
    bad = secrets.token_hex(8)
    await forge(redis_url, bad, entry_text(bad, now, reason=float("nan")))
    log = await opened_log(tmp_path)
    results = AttestationResults(store=store, audit=log, policy=engine)
    assert await results.write_owed(now) == 1
    assert [r["jti"] for r in await records(log)] == [genuine]
    assert await log.append({"type": "probe"})
    await log.close()
    await store.close()


@pytest.mark.parametrize("body", ["nan", "garbage"])
async def test_a_release_on_an_entry_no_broker_writes_is_a_stable_refusal(
    start_broker: Callable[..., Any], body: str
) -> None:
    """A release whose entry the store holds with ``NaN`` (or as text that is not an entry) is
    refused 503 ``attestation_store_mismatch`` with an error record, never a 500 nor a log
    that stops: the same result released again once the entry is back."""
    store = '[nonces]\nstore = "sqlite:///attestations.db"\n'
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML + store, workdir_setup=with_result_key
    )
    database = broker.workdir / "attestations.db"
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        (jti, original) = await asyncio.to_thread(_rows, database)
        entry = json.loads(original)
        broken = "{" if body == "garbage" else json.dumps({**entry, "reason": float("nan")})
        await asyncio.to_thread(_rewrite, database, jti, broken)
        status, answer, headers = await runner.release(session, proof=runner.proof())
        assert (status, answer["error"]["code"]) == (503, "attestation_store_mismatch"), answer
        assert "wrapped_key" not in json.dumps(answer)
        (record,) = [r for r in broker.records() if r["type"] == "attested_release"]
        assert (record["result"], record["code"]) == ("error", "attestation_store_mismatch")
        await asyncio.to_thread(_rewrite, database, jti, original)
        runner.nonce = headers.get("DPoP-Nonce", runner.nonce)
        status, answer, _ = await runner.release(session, proof=runner.proof())
        assert status == 200, answer  # the log took every record since


def _rows(database: Path) -> tuple[str, str]:
    with sqlite3.connect(database) as db:
        ((jti, body),) = db.execute("SELECT jti, body FROM attestations").fetchall()
    return str(jti), str(body)


def _rewrite(database: Path, jti: str, body: str) -> None:
    with sqlite3.connect(database) as db:
        db.execute("UPDATE attestations SET body = ? WHERE jti = ?", (body, jti))


async def test_a_decision_record_that_cannot_be_encoded_is_written_minimal(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision kernel's own check (``kernel._record``): a plan's record body the log could
    not encode (``NaN``) is replaced by the minimal record (``internal_error``, no key), and the
    log takes every later record: the next release on the same result is released."""
    broker = await attest_broker(start_broker)
    path = RECORD_BODIES["attested_release"]
    body = pydoc.locate(path)
    assert callable(body)

    def unencodable(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {**body(*args, **kwargs), "x": float("nan")}

    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        monkeypatch.setattr(path, unencodable)
        status, answer, headers = await runner.release(session, proof=runner.proof())
        assert (status, answer["error"]["code"]) == (500, "internal_error"), answer
        monkeypatch.undo()
        (record,) = [r for r in broker.records() if r["type"] == "attested_release"]
        assert (record["result"], record["code"]) == ("error", "internal_error")
        assert "x" not in record
        assert "keys" not in record
        runner.nonce = headers.get("DPoP-Nonce", runner.nonce)
        status, answer, _ = await runner.release(session, proof=runner.proof())
        assert status == 200, answer
