"""Two replicas changing one key version at once never undo each other (issue 30 review).

A change rests on the row it read: ``KeyStore.replace`` writes only over that exact row (state,
wrapped DEK, KEK, public half) and never over a destroyed one, atomically on every backend
(SQLite and PostgreSQL: ``UPDATE … WHERE``; Secret Manager: the ``current`` alias moved with the
secret's etag). Each race runs two key services (two replicas) on two clients of one real store,
with a real decision log and real local KEKs: replica B's change runs inside replica A's
change-log hook, after A read the version and recorded its intent, before A writes. The
destroyed version stays destroyed without material, nothing B did is silently reverted, A's
outcome says it was not made (a rewrap counts the DEK ``lost`` and the next run moves it).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from broker.audit.log import DecisionLog
from broker.core.errors import Conflict, ErrorCode, UpstreamError
from broker.keys.kek.local import LocalKek, create_kek_file
from broker.keys.kek.ring import KekRing
from broker.keys.service import KeyService
from broker.keys.store.base import KeyStore, KeyVersionRecord, Purpose, VersionState
from broker.keys.store.postgres import PostgresKeyStore, migrate
from broker.keys.store.secretmanager import SecretManagerKeyStore
from broker.keys.store.sqlite import SqliteKeyStore
from tests.fakes.google_secretmanager import FakeSecretManager
from tests.support.key_changes import key_admin_records, outcomes
from tests.vectors.tokens import NOW

KEY = "models/raced"
PROJECT = "projects/broker-test"
Change = Callable[[KeyService], Awaitable[Any]]


@pytest.fixture(params=["sqlite", "postgresql", "secretmanager"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """The backend's kind and where it is (a file, a fresh database, a Secret Manager)."""
    if request.param == "postgresql":
        return "postgresql", str(request.getfixturevalue("database"))
    if request.param == "secretmanager":
        return "secretmanager", request.getfixturevalue("fake_secretmanager").endpoint
    return "sqlite", str(tmp_path / "keys.db")


def client(kind: str, where: str) -> KeyStore:
    if kind == "postgresql":
        return PostgresKeyStore(where, timeout=5)
    if kind == "secretmanager":
        return SecretManagerKeyStore(PROJECT, endpoint=where)
    return SqliteKeyStore(Path(where))


@dataclass
class Replicas:
    log: DecisionLog
    stores: tuple[KeyStore, KeyStore]
    old: KekRing  # the KEK the key was made under
    new: KekRing  # a new primary KEK, the old one still known (a rewrap's ring)

    def replica(self, which: int, ring: KekRing, change_log: Any = None) -> KeyService:
        logged = self.log.append_entry if change_log is None else change_log
        return KeyService(self.stores[which], ring, change_log=logged)

    async def version(self) -> KeyVersionRecord:
        record = await self.stores[0].get_version(KEY, 1)
        assert record is not None
        return record


def local_kek(path: Path) -> LocalKek:
    create_kek_file(path)
    return LocalKek(path)


@pytest.fixture
def keks(tmp_path: Path) -> tuple[LocalKek, LocalKek]:
    """The KEK keys are made under, and the one a rewrap moves them to."""
    (tmp_path / "audit").mkdir()
    return local_kek(tmp_path / "old.kek"), local_kek(tmp_path / "new.kek")


@pytest.fixture
async def replicas(
    backend: tuple[str, str], keks: tuple[LocalKek, LocalKek], tmp_path: Path
) -> AsyncIterator[Replicas]:
    kind, where = backend
    if kind == "postgresql":
        await migrate(where, timeout_seconds=5)
    old, new = keks
    log = DecisionLog(tmp_path / "audit" / "decisions.jsonl")
    await log.open()
    stores = (client(kind, where), client(kind, where))
    for store in stores:
        await store.open()  # type: ignore[attr-defined]
    try:
        yield Replicas(log, stores, KekRing(old), KekRing(new, [old]))
    finally:
        for store in stores:
            await store.close()
        await log.close()


async def race(replicas: Replicas, a: Change, b: Change, a_ring: KekRing) -> Any:
    """Run A's change; B's runs to completion inside A's first change-log append (after A
    read the version and recorded its intent, before A writes). A's result, or its error."""
    b_replica = replicas.replica(1, replicas.old)
    raced = False

    async def hook(entry: Any) -> Any:
        nonlocal raced
        appended = await replicas.log.append_entry(entry)
        if not raced:
            raced = True
            await b(b_replica)
        return appended

    try:
        return await a(replicas.replica(0, a_ring, hook))
    except Conflict as refused:
        return refused


def disable(keys: KeyService) -> Awaitable[Any]:
    return keys.set_enabled(KEY, 1, False, now=NOW)


def destroy(keys: KeyService) -> Awaitable[Any]:
    return keys.destroy(KEY, 1, now=NOW)


def rewrap(keys: KeyService) -> Awaitable[Any]:
    return keys.rewrap(now=NOW)


async def made(replicas: Replicas) -> bytes:
    """Version 1 under the old KEK; its DEK."""
    keys = replicas.replica(0, replicas.old)
    return await keys.unwrap(await keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW))


async def test_a_stale_disable_does_not_undo_a_destroy(replicas: Replicas) -> None:
    await made(replicas)
    refused = await race(replicas, disable, destroy, replicas.old)
    assert isinstance(refused, Conflict)
    stored = await replicas.version()
    assert (stored.state, stored.wrapped_dek) == (VersionState.DESTROYED, b"")  # crypto-shred kept
    assert outcomes(await key_admin_records(replicas.log))[1:] == [
        ("destroy", 1, "ok", None),
        ("disable", 1, "error", "conflict"),
    ]


async def test_a_stale_destroy_is_refused_after_a_disable_and_can_be_retried(
    replicas: Replicas,
) -> None:
    await made(replicas)
    refused = await race(replicas, destroy, disable, replicas.old)
    assert isinstance(refused, Conflict)
    assert (await replicas.version()).state is VersionState.DISABLED
    await destroy(replicas.replica(0, replicas.old))  # read afresh: made
    stored = await replicas.version()
    assert (stored.state, stored.wrapped_dek) == (VersionState.DESTROYED, b"")
    with pytest.raises(Exception, match="destroyed"):  # terminal: no change over it
        await disable(replicas.replica(0, replicas.old))
    assert (await replicas.version()).state is VersionState.DESTROYED


async def test_a_rewrap_does_not_enable_a_version_disabled_meanwhile(replicas: Replicas) -> None:
    dek = await made(replicas)
    report = await race(replicas, rewrap, disable, replicas.new)
    assert (report.rewrapped, report.lost) == (0, 1)
    stored = await replicas.version()
    assert stored.state is VersionState.DISABLED  # not re-enabled with its old row
    assert stored.kek_ref == replicas.old.primary.reference  # left for the next run
    again = await rewrap(replicas.replica(0, replicas.new))
    assert (again.rewrapped, again.lost) == (1, 0)
    moved = await replicas.version()
    assert (moved.state, moved.kek_ref) == (VersionState.DISABLED, replicas.new.primary.reference)
    keys = replicas.replica(0, replicas.new)
    assert await keys.unwrap(moved.evolve(state=VersionState.ENABLED)) == dek
    records = await key_admin_records(replicas.log)
    assert outcomes(records)[1:] == [
        ("disable", 1, "ok", None),
        ("rewrap", None, "ok", None),
        ("rewrap", None, "ok", None),
    ]
    closings = [(r["rewrapped"], r["lost"]) for r in records if r["action"] == "rewrap"]
    assert closings == [(0, 1), (1, 0)]


async def test_a_rewrap_does_not_bring_back_a_destroyed_dek(replicas: Replicas) -> None:
    await made(replicas)
    report = await race(replicas, rewrap, destroy, replicas.new)
    assert (report.rewrapped, report.lost) == (0, 1)
    stored = await replicas.version()
    assert (stored.state, stored.wrapped_dek) == (VersionState.DESTROYED, b"")
    assert stored.kek_ref == replicas.old.primary.reference
    again = await rewrap(replicas.replica(0, replicas.new))
    assert (again.rewrapped, again.skipped_destroyed) == (0, 1)
    assert (await replicas.version()).wrapped_dek == b""


async def test_a_stale_destroy_does_not_undo_a_rewrap_of_the_same_version(
    replicas: Replicas,
) -> None:
    """B rewraps while A destroys: A was read before the move, so it is refused (retry) and
    the DEK stays wrapped once, under the new KEK, decryptable."""
    dek = await made(replicas)

    async def b_rewraps(_: KeyService) -> Any:
        return await rewrap(replicas.replica(1, replicas.new))

    refused = await race(replicas, destroy, b_rewraps, replicas.old)
    assert isinstance(refused, Conflict)
    stored = await replicas.version()
    assert (stored.state, stored.kek_ref) == (VersionState.ENABLED, replicas.new.primary.reference)
    assert await replicas.replica(0, replicas.new).unwrap(stored) == dek


async def test_a_rewrap_cut_short_by_a_kek_error_is_closed_as_failed(
    replicas: Replicas, tmp_path: Path
) -> None:
    """The second DEK's KEK is not configured: the rewrap stops, its closing record says
    ``error`` with the code and what moved before it."""
    await made(replicas)
    third = KekRing(await asyncio.to_thread(local_kek, tmp_path / "third.kek"))
    await replicas.replica(0, third).create("models/zz-third", Purpose.GENERIC, now=NOW)
    with pytest.raises(UpstreamError) as caught:
        await rewrap(replicas.replica(0, replicas.new))
    assert caught.value.code is ErrorCode.KEK_UNAVAILABLE
    records = await key_admin_records(replicas.log)
    (closing,) = [r for r in records if r["action"] == "rewrap"]
    assert (closing["result"], closing["code"], closing["rewrapped"], closing["lost"]) == (
        "error",
        "kek_unavailable",
        1,
        0,
    )
    assert outcomes(records)[-1] == ("rewrap", None, "error", "kek_unavailable")
    assert (await replicas.version()).kek_ref == replicas.new.primary.reference


async def test_concurrent_replaces_of_one_row_have_exactly_one_winner(
    replicas: Replicas, backend: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    """Eight writers on two clients replace the same row at once (each a different record):
    one wins, the store holds its record, the others are told they lost. On Secret Manager the
    losers' payloads are destroyed, never followed by a reader."""
    await made(replicas)
    row = await replicas.version()
    attempts = [
        row.evolve(wrapped_dek=row.wrapped_dek + bytes([n]), updated_at=NOW) for n in range(8)
    ]
    won = await asyncio.gather(
        *(
            replicas.stores[n % 2].replace(attempt, expected=row)
            for n, attempt in enumerate(attempts)
        )
    )
    assert won.count(True) == 1
    winner = attempts[won.index(True)]
    for store in replicas.stores:
        stored = await store.get_version(KEY, 1)
        assert stored is not None
        assert stored.wrapped_dek == winner.wrapped_dek
    if backend[0] == "secretmanager":
        fake = request.getfixturevalue("fake_secretmanager")
        (secret,) = [s for name, s in fake.secrets.items() if name.endswith("-v1")]
        kept = [v for v in secret.versions if v is not None]
        assert len(kept) == 2  # the original record and the winner's; the losers' destroyed


async def test_a_rewrap_interrupted_is_closed_as_unknown(replicas: Replicas) -> None:
    """Ctrl-C (the task cancelled) after the first move: the closing record says ``unknown``
    (the DEK in flight may or may not have moved) with what moved before."""
    await made(replicas)
    await replicas.replica(0, replicas.old).create("models/zz-second", Purpose.GENERIC, now=NOW)

    def interrupt(moved: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()

    rewrapping = asyncio.create_task(
        replicas.replica(0, replicas.new).rewrap(now=NOW, on_progress=interrupt)
    )
    with pytest.raises(asyncio.CancelledError):
        await rewrapping
    records = await key_admin_records(replicas.log)
    (closing,) = [r for r in records if r["action"] == "rewrap"]
    assert (closing["result"], closing["rewrapped"], closing["message"]) == (
        "unknown",
        1,
        "interrupted",
    )
    assert outcomes(records)[-1] == ("rewrap", None, "unknown", None)


def enabled_deks(fake: FakeSecretManager) -> list[bytes]:
    """The wrapped DEKs of every enabled secret version of ``KEY`` version 1."""
    (secret,) = [s for name, s in fake.secrets.items() if name.endswith("-v1")]
    records = [json.loads(data) for data in secret.versions if data is not None]
    return [base64.b64decode(r["wrapped_dek"]) for r in records if r["wrapped_dek"]]


@pytest.mark.parametrize("backend", ["secretmanager"], indirect=True)
async def test_a_stale_rewrap_left_after_a_destroy_is_shredded_by_the_next_read(
    replicas: Replicas, fake_secretmanager: FakeSecretManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Secret Manager: A's rewrap reads version 1 and B destroys it before A adds its secret
    version (after B's shredding listed the versions); A loses the alias and its best-effort
    discard fails once. Its version, the DEK wrapped, stays enabled, and the ``broker-shredded``
    annotation already names B's record, so nothing shreds again: the next read of the
    destroyed record destroys it."""
    await made(replicas)
    stale = replicas.stores[0]
    assert isinstance(stale, SecretManagerKeyStore)
    call = stale._call  # the stale client's own calls, faults around them
    discards = 0

    async def destroyed_meanwhile_then_discard_fails(method: str, request: Any) -> Any:
        nonlocal discards
        if method == "add_secret_version":  # A read version 1; B destroys it now
            await destroy(replicas.replica(1, replicas.old))
        if method == "destroy_secret_version":  # A's discard of the version it added
            discards += 1
            if discards == 1:
                raise UpstreamError("Secret Manager: down", code=ErrorCode.KEY_STORE_UNAVAILABLE)
        return await call(method, request)

    monkeypatch.setattr(stale, "_call", destroyed_meanwhile_then_discard_fails)
    report = await rewrap(replicas.replica(0, replicas.new))
    monkeypatch.undo()
    assert (report.rewrapped, report.lost, discards) == (0, 1, 1)
    assert len(enabled_deks(fake_secretmanager)) == 1  # A's version: the DEK, wrapped, enabled
    stored = await replicas.stores[1].get_version(KEY, 1)  # a read, by either replica
    assert stored is not None
    assert (stored.state, stored.wrapped_dek) == (VersionState.DESTROYED, b"")
    assert enabled_deks(fake_secretmanager) == []
    assert await replicas.stores[0].get_version(KEY, 1) == stored  # idempotent
    assert enabled_deks(fake_secretmanager) == []
