"""Key administration records each change before it makes it (issue 30, keys/service.py).

A change the decision log cannot take is not made; a change recorded and then not made (another
replica took the version, a bug in the store) is followed by the same action with ``result:
error``; an admin hanging up mid-change cannot leave it half done. Every case runs on a real
decision log, a real SQLite key store and a real local KEK; the faults are the log's disk
filling, a second key service on the same store (another replica), and a store bug.
"""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from broker.audit.envelope import parse_record
from broker.audit.log import DecisionLog
from broker.audit.ocsf import ocsf_events
from broker.audit.sink import syslog_severity
from broker.core.errors import BrokerError, Conflict, ErrorCode
from broker.keys.kek.local import LocalKek, create_kek_file
from broker.keys.kek.ring import KekRing
from broker.keys.service import KeyService
from broker.keys.store.base import Purpose, VersionState
from broker.keys.store.sqlite import SqliteKeyStore
from tests.vectors.tokens import NOW

KEY = "models/recorded"


@dataclass
class World:
    log: DecisionLog
    store: SqliteKeyStore
    keys: KeyService
    ring: KekRing

    def service(self, change_log: Any) -> KeyService:
        return KeyService(self.store, self.ring, change_log=change_log)

    async def records(self) -> list[dict[str, Any]]:
        lines = await asyncio.to_thread(self.log.read_lines, 0, self.log.committed_size)
        return [json.loads(line) for line in lines if b'"key_admin"' in line]


@pytest.fixture
def ring(tmp_path: Path) -> KekRing:
    create_kek_file(tmp_path / "kek")
    (tmp_path / "audit").mkdir()
    return KekRing(LocalKek(tmp_path / "kek"))


@pytest.fixture
async def world(tmp_path: Path, ring: KekRing) -> AsyncIterator[World]:
    log = DecisionLog(tmp_path / "audit" / "decisions.jsonl")
    await log.open()
    store = SqliteKeyStore(tmp_path / "keys.db")
    await store.open()
    keys = KeyService(store, ring, change_log=log.append)
    try:
        yield World(log, store, keys, ring)
    finally:
        await store.close()
        await log.close()


def disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DecisionLog, "_seal_and_write", full)


async def test_a_change_the_log_cannot_take_is_not_made(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    disk_full(monkeypatch)
    with pytest.raises(BrokerError):
        await world.keys.create("models/other", Purpose.MODEL_WEIGHTS, now=NOW)
    with pytest.raises(BrokerError):
        await world.keys.destroy(KEY, 1, now=NOW)
    with pytest.raises(BrokerError):
        await world.keys.rotate(KEY, now=NOW)
    versions = await world.store.list_versions()
    assert [(v.name, v.version, v.state) for v in versions] == [(KEY, 1, VersionState.ENABLED)]
    assert versions[0].wrapped_dek  # not destroyed
    monkeypatch.undo()
    assert [r["action"] for r in await world.records()] == ["create"]


async def test_a_change_recorded_then_refused_by_the_store_is_recorded_as_failed(
    world: World,
) -> None:
    """Another replica rotates between this one's record and its commit: this rotation is
    refused (``conflict``) and the log says so right after its record."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    other = world.service(world.log.append)
    raced = False

    async def then_the_other_replica(entry: Any) -> str:
        nonlocal raced
        index = await world.log.append(entry)
        if not raced:
            raced = True
            await other.rotate(KEY, now=NOW)
        return index

    racing = world.service(then_the_other_replica)
    with pytest.raises(Conflict) as caught:
        await racing.rotate(KEY, now=NOW)
    assert caught.value.code is ErrorCode.CONFLICT
    rotations = [r for r in await world.records() if r["action"] == "rotate"]
    assert [(r["version"], r.get("result"), r.get("code")) for r in rotations] == [
        (2, None, None),  # this replica's record
        (2, None, None),  # the other replica's, made
        (2, "error", "conflict"),  # this replica's: not made
    ]
    assert [v.version for v in await world.store.list_versions(KEY)] == [1, 2]
    (failed,) = ocsf_events(parse_record(rotations[2]))
    assert (failed["status"], failed["status_code"]) == ("Failure", "conflict")
    (made,) = ocsf_events(parse_record(rotations[1]))
    assert made["status"] == "Success"
    assert [syslog_severity(r) for r in rotations] == [5, 5, 3]  # notice, notice, error


async def test_a_store_bug_after_the_record_is_recorded_as_internal_error(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)

    async def broken(*_: Any, **__: Any) -> bool:
        raise RuntimeError("a bug in the store")

    monkeypatch.setattr(world.store, "replace", broken)
    with pytest.raises(RuntimeError):
        await world.keys.set_enabled(KEY, 1, False, now=NOW)
    disables = [r for r in await world.records() if r["action"] == "disable"]
    assert [(r.get("result"), r.get("code")) for r in disables] == [
        (None, None),
        ("error", "internal_error"),
    ]
    assert "a bug in the store" not in json.dumps(disables)  # a bug's text stays out of the log
    monkeypatch.undo()
    assert (await world.store.get_version(KEY, 1)).state is VersionState.ENABLED  # type: ignore[union-attr]


async def test_an_admin_hanging_up_mid_change_leaves_it_whole(world: World) -> None:
    """The caller is cancelled while the record is being written: the record lands and the
    change is made all the same (never one without the other)."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_log(entry: Any) -> str:
        entered.set()
        await release.wait()
        return await world.log.append(entry)

    destroying = asyncio.create_task(world.service(slow_log).destroy(KEY, 1, now=NOW))
    await entered.wait()
    destroying.cancel()
    with pytest.raises(asyncio.CancelledError):
        await destroying
    release.set()
    for _ in range(200):  # the shielded change finishes on its own
        record = await world.store.get_version(KEY, 1)
        assert record is not None
        if record.state is VersionState.DESTROYED:
            break
        await asyncio.sleep(0.01)
    assert record is not None
    assert record.state is VersionState.DESTROYED
    assert record.wrapped_dek == b""
    assert [r["action"] for r in await world.records()] == ["create", "destroy"]
