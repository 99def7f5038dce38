"""The attestation store's contract on every backend, against real servers where there is one
(redis-server and PostgreSQL on loopback): put, get, revoke (the first reason stays), expiry,
two clients of one store (replicas) seeing each other's revocation, workload certificates
listed by several replicas at once (none lost), an entry whose revocation
record is owed kept past its expiry until the record is written, and 503 when the store is
down — never an attestation treated as active."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from redis.asyncio import Redis

from broker.attestation.issued import IssuedCertificate
from broker.attestation.stored import (
    ACTIVE,
    RECORD_GRACE,
    REVOKED,
    AttestationEntry,
    AttestationStore,
    claim_record,
    hand_over,
    note_certificate,
    note_log_index,
    record_written,
    revoke,
)
from broker.core.errors import ErrorCode, UpstreamError
from broker.core.refs import store_ref
from broker.stores.attestations import open_attestation_store
from broker.stores.attestations_shared import RedisAttestations

NOW = datetime.now(UTC)


@pytest.fixture(autouse=True)
def fresh_now() -> None:
    """Each test's clock reading. It was taken once at import: on a loaded CI machine the suite
    reached these tests more than the entries' 300 s later, and the stores (which also honour
    real time: Redis and PostgreSQL expire by the server's clock) had dropped them."""
    global NOW  # noqa: PLW0603 - one reading per test, used by entry() and the tests
    NOW = datetime.now(UTC)


def entry(expires_in: float = 300) -> AttestationEntry:
    return AttestationEntry(
        jti=secrets.token_hex(8),
        expires_at=NOW + timedelta(seconds=expires_in),
        pop_thumbprint="p" * 43,
        policy_input={"request": {"kind": "attest"}, "tee": {"debug": False}},
    )


@pytest.fixture(params=["memory", "sqlite", "redis", "postgresql"])
async def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return await store_uri(request.param, request, tmp_path)


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
async def shared_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The stores several processes or replicas share (memory is one process's)."""
    return await store_uri(request.param, request, tmp_path)


async def store_uri(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite://{tmp_path / 'nonces.db'}"
    if kind == "redis":
        return str(request.getfixturevalue("redis_url"))
    if kind == "postgresql":  # a fresh database on the session's server
        server = str(request.getfixturevalue("postgresql_url"))
        name = f"attest_{secrets.token_hex(6)}"
        admin = await asyncpg.connect(server)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        return urlunsplit(urlsplit(server)._replace(path=f"/{name}"))
    return "memory"


@pytest.fixture
async def stores(uri: str) -> AsyncIterator[Callable[[], AttestationStore]]:
    """Opens clients of the store ``uri`` names (two of them: two replicas)."""
    opened: list[AttestationStore] = []

    def open_one() -> AttestationStore:
        store = open_attestation_store(store_ref(uri, "nonces.store"), timeout=5)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        await settle(store)
        await store.close()


async def settle(store: AttestationStore) -> None:
    """Every record still owed taken as written: an owed entry never expires, and the brokers
    of later tests sharing this Redis would write its record into their logs."""
    for owed in await store.owed():
        await record_written(store, owed.jti, NOW)


async def test_put_get_revoke_and_expiry(stores: Callable[[], AttestationStore]) -> None:
    store = stores()
    live, short = entry(), entry(expires_in=1)
    await store.put(live)
    await store.put(short)
    got = await store.get(live.jti, NOW)
    assert got == live
    assert got is not None
    assert got.status == ACTIVE
    assert live.jti in {e.jti for e in await store.unexpired(NOW)}  # short may be gone already
    revoked = await revoke(store, live.jti, "policy v2 denies it", NOW, who="admin")
    assert revoked is not None
    assert (revoked.entry.status, revoked.entry.reason, revoked.newly) == (
        REVOKED,
        "policy v2 denies it",
        True,
    )
    again = await revoke(store, live.jti, "a later reason", NOW, who="someone else")
    assert again is not None
    assert (again.entry.reason, again.newly) == ("policy v2 denies it", False)  # the first stays
    listed = {e.jti: e for e in await store.unexpired(NOW)}
    assert listed[live.jti].status == REVOKED  # revoked: listed, not re-decided
    # its record is owed until it is written; after the grace, one claimant at a time takes it
    assert listed[live.jti].record_due == NOW + RECORD_GRACE
    assert listed[live.jti].pending_record == {
        "type": "attestation_revoked",
        "jti": live.jti,
        "time": NOW.isoformat(),
        "who": "admin",  # the first revoker's, as the reason
        "reason": "policy v2 denies it",
    }
    assert [e.jti for e in await store.owed()] == [live.jti]
    assert await claim_record(store, live.jti, NOW) is None  # the revoker's to write, for now
    due = NOW + RECORD_GRACE
    assert await claim_record(store, live.jti, due) is not None
    assert await claim_record(store, live.jti, due) is None  # taken: due again a grace later
    taken = await store.get(live.jti, due)
    assert taken is not None
    assert taken.record_due == due + RECORD_GRACE
    await hand_over(store, live.jti, due)  # its claimant could not write it: due at once
    assert await claim_record(store, live.jti, due) is not None
    await record_written(store, live.jti, NOW)
    written = await store.get(live.jti, NOW)
    assert written is not None
    assert (written.record_due, written.pending_record) == (None, None)
    assert await store.owed() == []
    assert await claim_record(store, live.jti, due + 2 * RECORD_GRACE) is None  # none owed
    await note_log_index(store, live.jti, 41, NOW)
    kept = await store.get(live.jti, NOW)
    assert kept is not None
    assert (kept.log_index, kept.status) == (41, REVOKED)  # the index noted, the status kept
    assert await store.get("unknown", NOW) is None
    assert await revoke(store, "unknown", "x", NOW, who="admin") is None
    assert await store.get(short.jti, NOW + timedelta(seconds=2)) is None  # expired
    assert await revoke(store, short.jti, "x", NOW + timedelta(seconds=2), who="admin") is None
    later = await store.unexpired(NOW + timedelta(seconds=2))
    mine = {live.jti, short.jti}  # the session's Redis holds other tests' entries too
    assert [(e.jti, e.status) for e in later if e.jti in mine] == [(live.jti, REVOKED)]


async def test_a_revocation_is_seen_by_every_client(shared_uri: str) -> None:
    first = open_attestation_store(store_ref(shared_uri, "nonces.store"), timeout=5)
    second = open_attestation_store(store_ref(shared_uri, "nonces.store"), timeout=5)
    shared = entry()
    await first.put(shared)
    assert (await second.get(shared.jti, NOW)) == shared
    await revoke(second, shared.jti, "revoked by an admin", NOW, who="admin")
    seen = await first.get(shared.jti, NOW)
    owed = await first.owed()
    await settle(first)
    await first.close()
    await second.close()
    assert seen is not None
    assert seen.status == REVOKED
    assert [e.jti for e in owed] == [shared.jti]  # any replica's pass may write its record


async def test_concurrent_revocations_keep_one_reason(
    uri: str, stores: Callable[[], AttestationStore]
) -> None:
    store = stores()
    shared = entry()
    await store.put(shared)
    clients = [store] * 8 if uri == "memory" else [stores() for _ in range(8)]  # replicas
    results = await asyncio.gather(
        *(
            revoke(client, shared.jti, f"reason {i}", NOW, who=f"admin {i}")
            for i, client in enumerate(clients)
        )
    )
    reasons = {r.entry.reason for r in results if r is not None}
    assert [r.newly for r in results if r is not None].count(True) == 1  # one logs it
    final = await store.get(shared.jti, NOW)
    assert final is not None
    assert final.reason in reasons
    assert len(reasons) == 1  # whoever won, everyone read the same first reason
    assert final.pending_record is not None
    i = final.pending_record["who"].removeprefix("admin ")
    assert final.pending_record["reason"] == final.reason == f"reason {i}"  # the winner's record


async def test_concurrent_certificates_are_each_listed_once(
    uri: str, stores: Callable[[], AttestationStore]
) -> None:
    """Issue 32: eight replicas list a workload certificate each on one result at once; the
    atomic update loses none, and none is listed once the result is revoked."""
    store = stores()
    shared = entry()
    await store.put(shared)
    clients = [store] * 8 if uri == "memory" else [stores() for _ in range(8)]  # replicas

    def issued(n: int) -> IssuedCertificate:
        return IssuedCertificate(
            format(n + 1, "x"), "spiffe://td/w", f"{n:064x}", shared.expires_at
        )

    await asyncio.gather(
        *(note_certificate(c, shared.jti, issued(n), NOW) for n, c in enumerate(clients))
    )
    listed = await store.get(shared.jti, NOW)
    assert listed is not None
    assert sorted(c.sha256 for c in listed.identities) == [f"{n:064x}" for n in range(8)]
    await revoke(clients[-1], shared.jti, "revoked", NOW, who="admin")
    after = await note_certificate(store, shared.jti, issued(8), NOW)
    assert after is not None
    assert (after.status, len(after.identities)) == (REVOKED, 8)


async def test_an_entry_owing_its_record_is_kept_past_its_expiry(
    stores: Callable[[], AttestationStore],
) -> None:
    """Revoked in the last second of its life, its record not written: the entry outlives its
    expiry through each backend's own clean-up (SQL rows deleted at the next put, Redis
    ``EXAT``) until the record is written, listed only as owed; a release or a status asking
    for it still finds it expired. An entry owing nothing goes at its expiry, as before."""
    store = stores()
    owing, plain = entry(expires_in=1), entry(expires_in=1)
    await store.put(owing)
    await store.put(plain)
    facts = {"trigger": "policy_change", "policy_digest": "sha256:" + "d" * 64, "reasons": ["x"]}
    revoked = await revoke(store, owing.jti, "no longer allowed", NOW, who="broker", facts=facts)
    assert revoked is not None
    await asyncio.sleep(2.2)  # past both expiries by every clock (Redis's EXAT is whole seconds)
    now = datetime.now(UTC)
    await store.put(entry())  # where the SQL stores delete expired rows
    assert await store.get(owing.jti, now) is None  # expired, for a release or a status
    assert await revoke(store, owing.jti, "again", now, who="admin") is None
    assert owing.jti not in {e.jti for e in await store.unexpired(now)}  # nor re-decided
    assert await store.update(plain.jti, now, lambda e: e, expired_too=True) is None  # gone
    kept = {e.jti: e for e in await store.owed()}
    assert kept[owing.jti].pending_record == {
        "type": "attestation_revoked",
        "jti": owing.jti,
        "time": NOW.isoformat(),
        "who": "broker",
        "reason": "no longer allowed",
        **facts,
    }
    claimed = await claim_record(store, owing.jti, NOW + RECORD_GRACE)
    assert claimed is not None
    assert claimed.pending_record == kept[owing.jti].pending_record
    await record_written(store, owing.jti, now)
    assert owing.jti not in {e.jti for e in await store.owed()}
    await store.put(entry())
    assert await store.update(owing.jti, now, lambda e: e, expired_too=True) is None  # gone now


async def test_an_owed_entry_redis_dropped_is_logged(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing of ours deletes an entry whose record is owed (its key has no expiry); a Redis
    that evicts keys anyway (``allkeys-*``) loses the record, and the next listing says so, at
    error, once."""
    store = open_attestation_store(store_ref(redis_url, "nonces.store"), timeout=5)
    raw = Redis.from_url(redis_url)
    dropped, kept = entry(), entry()
    for owing in (dropped, kept):
        await store.put(owing)
        assert await revoke(store, owing.jti, "stolen", NOW, who="admin") is not None
    assert await raw.ttl(RedisAttestations.PREFIX + kept.jti) == -1  # kept until written
    await raw.delete(RedisAttestations.PREFIX + dropped.jti)  # as an eviction would
    with caplog.at_level(logging.ERROR, logger="broker.stores.attestations_shared"):
        listed = {e.jti for e in await store.owed()}
        assert {dropped.jti, kept.jti} & listed == {kept.jti}
        assert {dropped.jti, kept.jti} & {e.jti for e in await store.owed()} == {kept.jti}
    (lost,) = [r for r in caplog.records if dropped.jti in r.getMessage()]  # once
    assert lost.levelno == logging.ERROR
    assert "lost" in lost.getMessage()
    await record_written(store, kept.jti, NOW)
    assert await raw.ttl(RedisAttestations.PREFIX + kept.jti) > 0  # expires with the result again
    assert not await raw.sismember(RedisAttestations.OWED, kept.jti)  # type: ignore[misc]
    await raw.aclose()
    await store.close()


async def test_a_store_that_does_not_answer_is_503(tmp_path: Path) -> None:
    for uri in ("redis://127.0.0.1:9/0", "postgresql://broker@127.0.0.1:9/none"):
        store = open_attestation_store(store_ref(uri, "nonces.store"), timeout=1)
        try:
            with pytest.raises(UpstreamError) as caught:
                await store.get("x", NOW)
            assert caught.value.code is ErrorCode.NONCE_STORE_UNAVAILABLE
        finally:
            await store.close()
    (tmp_path / "dir.db").mkdir()  # a directory where the SQLite file should be
    store = open_attestation_store(
        store_ref(f"sqlite://{tmp_path / 'dir.db'}", "nonces.store"), timeout=1
    )
    with pytest.raises(UpstreamError):
        await store.put(entry())
    await store.close()
