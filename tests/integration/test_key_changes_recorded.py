"""Key administration records each change as an intent, then an outcome (issue 30 review,
keys/changes.py).

A change the decision log cannot take is not made (and the 503 says so); a change recorded and
then not made (another replica took the version, a bug in the store) has an ``error`` outcome
naming its intent; a commit that fails after the store made it (a lost reply) is re-read and
recorded ``ok``; one whose store cannot be read back is ``unknown``; an admin hanging up
mid-change cannot leave it half done, nor an unretrieved exception behind. Every case runs on a
real decision log, a real SQLite key store and a real local KEK; the faults are the log's disk
filling, a second key service on the same store (another replica), and store calls that fail
around their real work.
"""

from __future__ import annotations

import asyncio
import errno
import gc
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
from broker.core.errors import BrokerError, Conflict, ErrorCode, UpstreamError
from broker.keys.kek.local import LocalKek, create_kek_file
from broker.keys.kek.ring import KekRing
from broker.keys.service import KeyService
from broker.keys.store.base import Purpose, VersionState
from broker.keys.store.sqlite import SqliteKeyStore
from tests.support.key_changes import key_admin_records, outcomes, unanswered
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
        return await key_admin_records(self.log)


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
    keys = KeyService(store, ring, change_log=log.append_entry)
    try:
        yield World(log, store, keys, ring)
    finally:
        await store.close()
        await log.close()


def disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DecisionLog, "_seal_and_write", full)


def store_down() -> UpstreamError:
    return UpstreamError("key store is unavailable", code=ErrorCode.KEY_STORE_UNAVAILABLE)


async def test_a_change_the_log_cannot_take_is_not_made(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    disk_full(monkeypatch)
    with pytest.raises(BrokerError) as caught:
        await world.keys.create("models/other", Purpose.MODEL_WEIGHTS, now=NOW)
    # a key change's refusal says the change was not made (not "nothing was released")
    assert caught.value.code is ErrorCode.AUDIT_LOG_UNAVAILABLE
    assert "was not made" in caught.value.message
    assert "released" not in caught.value.message
    with pytest.raises(BrokerError):
        await world.keys.destroy(KEY, 1, now=NOW)
    with pytest.raises(BrokerError):
        await world.keys.rotate(KEY, now=NOW)
    versions = await world.store.list_versions()
    assert [(v.name, v.version, v.state) for v in versions] == [(KEY, 1, VersionState.ENABLED)]
    assert versions[0].wrapped_dek  # not destroyed
    monkeypatch.undo()
    assert outcomes(await world.records()) == [("create", 1, "ok", None)]


async def test_a_change_recorded_then_refused_by_the_store_is_recorded_as_failed(
    world: World,
) -> None:
    """Another replica rotates between this one's intent and its commit: this rotation is
    refused (``conflict``) and its outcome says so, naming its intent."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    other = world.service(world.log.append_entry)
    raced = False

    async def then_the_other_replica(entry: Any) -> Any:
        nonlocal raced
        appended = await world.log.append_entry(entry)
        if not raced:
            raced = True
            await other.rotate(KEY, now=NOW)
        return appended

    racing = world.service(then_the_other_replica)
    with pytest.raises(Conflict) as caught:
        await racing.rotate(KEY, now=NOW)
    assert caught.value.code is ErrorCode.CONFLICT
    records = await world.records()
    rotations = [r for r in records if r["action"] == "rotate"]
    assert [(r["version"], r.get("result"), r.get("code")) for r in rotations] == [
        (2, None, None),  # this replica's intent
        (2, None, None),  # the other replica's intent
        (2, "ok", None),  # ... made
        (2, "error", "conflict"),  # this replica's: not made
    ]
    assert rotations[3]["intent"] == rotations[0]["index"]
    assert rotations[2]["intent"] == rotations[1]["index"]
    assert outcomes(records)[1:] == [("rotate", 2, "ok", None), ("rotate", 2, "error", "conflict")]
    assert [v.version for v in await world.store.list_versions(KEY)] == [1, 2]
    (failed,) = ocsf_events(parse_record(rotations[3]))
    assert (failed["status"], failed["status_code"]) == ("Failure", "conflict")
    assert failed["unmapped"]["intent"] == rotations[0]["index"]
    (made,) = ocsf_events(parse_record(rotations[2]))
    assert made["status"] == "Success"
    # an intent is marked: Unknown (it says what is about to happen, not that it happened) ...
    assert rotations[0]["phase"] == "intent"
    (intended,) = ocsf_events(parse_record(rotations[0]))
    assert (intended["status"], intended["severity_id"]) == ("Unknown", 1)
    # ... one from a log older than the marker is read as it was (Success)
    older = {k: v for k, v in rotations[0].items() if k != "phase"}
    assert ocsf_events(parse_record(older))[0]["status"] == "Success"
    assert [syslog_severity(r) for r in rotations] == [5, 5, 5, 3]  # notice x3, error


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
        ("error", "internal_error"),  # re-read: the store shows it was not made
    ]
    assert "a bug in the store" not in json.dumps(disables)  # a bug's text stays out of the log
    monkeypatch.undo()
    assert (await world.store.get_version(KEY, 1)).state is VersionState.ENABLED  # type: ignore[union-attr]


async def test_a_commit_whose_reply_was_lost_is_recorded_as_made(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store commits, then the call fails (a timeout after an autocommit UPDATE): the
    store is read back, shows exactly the change, and the change is ``ok`` for the log and the
    caller alike."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    replace, add = world.store.replace, world.store.add_version

    async def committed_then_timed_out(*args: Any, **kwargs: Any) -> bool:
        await replace(*args, **kwargs)
        raise store_down()

    async def added_then_timed_out(*args: Any, **kwargs: Any) -> None:
        await add(*args, **kwargs)
        raise store_down()

    monkeypatch.setattr(world.store, "replace", committed_then_timed_out)
    monkeypatch.setattr(world.store, "add_version", added_then_timed_out)
    destroyed = await world.keys.destroy(KEY, 1, now=NOW)  # no error: it was made
    rotated = await world.keys.rotate(KEY, now=NOW)
    monkeypatch.undo()
    assert destroyed.state is VersionState.DESTROYED
    stored = await world.store.get_version(KEY, 1)
    assert stored is not None
    assert (stored.state, stored.wrapped_dek) == (VersionState.DESTROYED, b"")
    assert await world.store.get_version(KEY, 2) == rotated
    assert outcomes(await world.records())[1:] == [
        ("destroy", 1, "ok", None),
        ("rotate", 2, "ok", None),
    ]


async def test_a_failed_commit_the_store_cannot_confirm_is_unknown(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fails before writing: read back, it shows the change not made (``error``
    with the store's code); when it cannot be read back either, ``unknown`` with that code;
    the caller gets the store's error both times."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)

    async def down(*_: Any, **__: Any) -> Any:
        raise store_down()

    monkeypatch.setattr(world.store, "replace", down)
    with pytest.raises(UpstreamError) as first:
        await world.keys.set_enabled(KEY, 1, False, now=NOW)
    real_get = world.store.get_version
    reads = 0

    async def first_read_only(*args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        if reads > 1:  # the service's own read works, the read back does not
            raise store_down()
        return await real_get(*args, **kwargs)

    monkeypatch.setattr(world.store, "get_version", first_read_only)
    with pytest.raises(UpstreamError) as second:
        await world.keys.destroy(KEY, 1, now=NOW)
    monkeypatch.undo()
    assert first.value.code is second.value.code is ErrorCode.KEY_STORE_UNAVAILABLE
    records = await world.records()
    assert outcomes(records)[1:] == [
        ("disable", 1, "error", "key_store_unavailable"),
        ("destroy", 1, "unknown", "key_store_unavailable"),
    ]
    (unknown,) = ocsf_events(parse_record(records[-1]))
    assert (unknown["status"], unknown["status_code"]) == ("Unknown", "key_store_unavailable")
    assert syslog_severity(records[-1]) == 4  # warning: look at the store
    assert (await real_get(KEY, 1)).state is VersionState.ENABLED  # type: ignore[union-attr]


async def test_an_outcome_the_log_cannot_take_leaves_the_intent_alone(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent lands, the change is made, the outcome's append fails: the intent stands
    alone (unknown: the store says) and the caller is told the change was made."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    appends = 0

    async def full_after_the_intent(entry: Any) -> Any:
        nonlocal appends
        appends += 1
        if appends > 1:
            disk_full(monkeypatch)
        return await world.log.append_entry(entry)

    disabled = await world.service(full_after_the_intent).set_enabled(KEY, 1, False, now=NOW)
    assert disabled.state is VersionState.DISABLED
    assert (await world.store.get_version(KEY, 1)) == disabled
    records = await world.records()
    assert [(r["action"], r.get("result")) for r in unanswered(records)] == [("disable", None)]


async def test_an_admin_hanging_up_mid_change_leaves_it_whole(world: World) -> None:
    """The caller is cancelled while the intent is being written: the intent lands, the change
    is made and its outcome recorded all the same (never one without the other)."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_log(entry: Any) -> Any:
        entered.set()
        await release.wait()
        return await world.log.append_entry(entry)

    destroying = asyncio.create_task(world.service(slow_log).destroy(KEY, 1, now=NOW))
    await entered.wait()
    destroying.cancel()
    with pytest.raises(asyncio.CancelledError):
        await destroying
    release.set()
    for _ in range(200):  # the shielded change finishes on its own
        records = await world.records()
        if len(records) == 4:
            break
        await asyncio.sleep(0.01)
    record = await world.store.get_version(KEY, 1)
    assert record is not None
    assert record.state is VersionState.DESTROYED
    assert record.wrapped_dek == b""
    assert outcomes(records) == [("create", 1, "ok", None), ("destroy", 1, "ok", None)]


async def test_a_caller_gone_before_a_failed_commit_leaves_no_unretrieved_exception(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller is cancelled, then the shielded commit fails: the failure is in the log (its
    outcome), and nothing reports "Task exception was never retrieved"."""
    await world.keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_log(entry: Any) -> Any:
        entered.set()
        await release.wait()
        return await world.log.append_entry(entry)

    async def broken(*_: Any, **__: Any) -> bool:
        raise RuntimeError("a bug in the store")

    monkeypatch.setattr(world.store, "replace", broken)
    try:
        disabling = asyncio.create_task(world.service(slow_log).set_enabled(KEY, 1, False, now=NOW))
        await entered.wait()
        disabling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await disabling
        release.set()
        for _ in range(200):
            if len(await world.records()) == 4:
                break
            await asyncio.sleep(0.01)
        del disabling
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert outcomes(await world.records())[1:] == [("disable", 1, "error", "internal_error")]
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported
