"""Decision log: durability, group commit, and detection of every kind of tampering."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.audit.log import DecisionLog, RecordNotEncodable
from broker.audit.records import LogCorrupt, record_hash, sealed_line
from broker.audit.segments import read_head, repair_torn_tail, verify_file
from broker.core.encoding import canonical
from broker.core.errors import ErrorCode, UpstreamError


async def write_log(path: Path, count: int) -> list[str]:
    log = DecisionLog(path)
    await log.open()
    hashes = [await log.append({"decision_id": f"d{i}", "result": "deny"}) for i in range(count)]
    await log.close()
    return hashes


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


async def test_intact_log_verifies_and_reopens_at_its_head(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    hashes = await write_log(path, 5)
    report = verify_file(path)
    assert report.head.size == 5
    assert report.head.hash == hashes[-1]
    more = await write_log(path, 2)  # reopen continues the chain
    assert verify_file(path).head.size == 7
    assert json.loads(lines(path)[5])["prev"] == hashes[-1]
    assert more[-1] == read_head(path).hash


async def test_concurrent_appends_share_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    log = DecisionLog(path)
    await log.open()
    results = await asyncio.gather(*(log.append({"n": i}) for i in range(200)))
    await log.close()
    assert len(set(results)) == 200
    assert verify_file(path).head.size == 200
    assert [json.loads(line)["seq"] for line in lines(path)] == list(range(200))


async def test_appends_queued_during_a_write_share_its_successor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit on the writer thread: 200 appends cost far fewer than 200 fsyncs."""
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counted(fd: int) -> None:
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr("broker.audit.log.os.fsync", counted)
    log = DecisionLog(tmp_path / "d.log")
    await log.open()
    before = len(fsyncs)
    await asyncio.gather(*(log.append({"n": i}) for i in range(200)))
    await log.close()
    assert 1 <= len(fsyncs) - before < 50
    assert verify_file(tmp_path / "d.log").head.size == 200


async def test_close_writes_what_was_queued_then_refuses(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "d.log")
    await log.open()
    pending = [asyncio.ensure_future(log.append({"n": i})) for i in range(20)]
    await asyncio.sleep(0)  # queued, not necessarily written
    await log.close()
    assert len(await asyncio.gather(*pending)) == 20
    assert verify_file(tmp_path / "d.log").head.size == 20
    with pytest.raises(UpstreamError):
        await log.append({"n": "late"})


async def test_an_idle_writer_thread_ends_and_the_next_append_starts_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("broker.audit.log.WRITER_IDLE_SECONDS", 0.05)
    log = DecisionLog(tmp_path / "d.log")
    await log.open()
    await log.append({"n": 0})
    name = f"decision-log-writer {tmp_path / 'd.log'}"

    def running() -> bool:
        return any(thread.name == name for thread in threading.enumerate())

    for _ in range(100):
        if not running():
            break
        await asyncio.sleep(0.02)
    assert not running()
    await log.append({"n": 1})
    await log.close()
    assert verify_file(tmp_path / "d.log").head.size == 2


async def test_changed_record_detected(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 4)
    content = lines(path)
    content[2] = content[2].replace('"result":"deny"', '"result":"allow"')
    path.write_text("".join(content))
    with pytest.raises(LogCorrupt) as caught:
        verify_file(path)
    assert caught.value.line == 3
    assert "changed" in caught.value.problem


async def test_removed_record_detected(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 4)
    content = lines(path)
    del content[1]
    path.write_text("".join(content))
    with pytest.raises(LogCorrupt) as caught:
        verify_file(path)
    assert caught.value.line == 2


async def test_reordered_records_detected(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 4)
    content = lines(path)
    content[1], content[2] = content[2], content[1]
    path.write_text("".join(content))
    with pytest.raises(LogCorrupt) as caught:
        verify_file(path)
    assert caught.value.line == 2


async def test_truncated_mid_record_detected(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 3)
    data = path.read_bytes()
    path.write_bytes(data[:-20])
    with pytest.raises(LogCorrupt) as caught:
        verify_file(path)
    assert caught.value.line == 3
    assert "truncated" in caught.value.problem


async def test_broker_refuses_to_open_a_log_with_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 2)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(LogCorrupt):
        await DecisionLog(path).open()


async def test_removed_tail_detected_against_known_head(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    hashes = await write_log(path, 4)
    path.write_text("".join(lines(path)[:3]))
    assert verify_file(path).head.size == 3  # a shorter chain is still a chain …
    with pytest.raises(LogCorrupt):
        verify_file(path, expected_head=hashes[3])  # … but not the one the auditor saw


async def test_write_failure_fails_closed_and_stays_closed() -> None:
    # /dev/full accepts open() and fails every write with ENOSPC: a real I/O failure.
    log = DecisionLog(Path("/dev/full"))
    await log.open()
    with pytest.raises(UpstreamError) as caught:
        await log.append({"decision_id": "d"})
    assert caught.value.code is ErrorCode.AUDIT_LOG_UNAVAILABLE
    assert caught.value.status == 503
    with pytest.raises(UpstreamError):
        await log.append({"decision_id": "e"})
    await log.close()


async def test_a_record_that_cannot_be_encoded_fails_alone_and_the_log_goes_on(
    tmp_path: Path,
) -> None:
    """A record canonical JSON refuses (NaN, infinity, a key not a str, an object) fails its own
    append with ``internal_error`` and writes nothing; the appends around it, in the same batch
    too, are written and chained, and the log takes appends after it (a store's ``NaN`` once
    stopped every release until a restart)."""
    path = tmp_path / "d.log"
    log = DecisionLog(path)
    await log.open()
    await log.append({"n": 0})
    for bad in ({"n": float("nan")}, {"n": float("inf")}, {"n": {1: 1, "a": 2}}, {"n": object()}):
        with pytest.raises(RecordNotEncodable) as caught:
            await asyncio.wait_for(log.append(bad), timeout=10)
        assert (caught.value.code, caught.value.status) == (ErrorCode.INTERNAL, 500)
    together = await asyncio.gather(
        log.append({"n": 1}),
        log.append({"n": float("nan")}),
        log.append_policy_change({"new_digest": float("nan")}),
        log.append({"n": 2}),
        return_exceptions=True,
    )
    assert [type(r) for r in together] == [str, RecordNotEncodable, RecordNotEncodable, str]
    assert await log.append_policy_change({"new_digest": "sha256:a"}) is not None  # tracked still
    assert await log.append({"n": 3})
    await log.close()
    written = [json.loads(line) for line in lines(path)]
    assert [r.get("n", r.get("new_digest")) for r in written] == [0, 1, 2, "sha256:a", 3]
    assert written[3]["old_digest"] is None  # the refused policy_change moved nothing
    assert verify_file(path).head.size == 5


async def test_a_writer_bug_stops_the_log_without_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any other failure on the writer thread (a bug: the file's state is unknown) must not leave
    the appender waiting forever: it and every later append get 503, as after a write failure."""
    log = DecisionLog(tmp_path / "d.log")
    await log.open()
    await log.append({"n": 0})

    def bug(*_: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(DecisionLog, "_write_lines", bug)
    with pytest.raises(UpstreamError) as caught:
        await asyncio.wait_for(log.append({"n": 1}), timeout=10)
    assert caught.value.code is ErrorCode.AUDIT_LOG_UNAVAILABLE
    monkeypatch.undo()
    with pytest.raises(UpstreamError):
        await asyncio.wait_for(log.append({"n": 2}), timeout=10)
    await log.close()
    assert verify_file(tmp_path / "d.log").head.size == 1


async def test_log_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 1)
    assert path.stat().st_mode & 0o077 == 0


async def test_torn_tail_is_cut_and_the_cut_logged(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 3)
    intact = path.read_bytes()
    path.write_bytes(intact + b'{"decision_id":"half-writ')
    report = repair_torn_tail(path, now="2026-11-30T00:00:00+00:00")
    assert report is not None
    assert report.removed_bytes == len(b'{"decision_id":"half-writ')
    assert verify_file(path).head.size == 4
    last = json.loads(lines(path)[-1])
    assert (last["type"], last["removed_bytes"]) == ("log_repair", report.removed_bytes)
    await write_log(path, 1)  # the broker opens and appends again
    assert verify_file(path).head.size == 5


async def test_repair_refuses_damage_other_than_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 3)
    content = lines(path)
    content[0] = content[0].replace('"deny"', '"allow"')
    path.write_text("".join(content) + '{"torn')
    before = path.read_bytes()
    with pytest.raises(LogCorrupt) as caught:
        repair_torn_tail(path, now="2026-11-30T00:00:00+00:00")
    assert caught.value.line == 1
    assert path.read_bytes() == before  # nothing changed


async def test_repair_of_an_intact_log_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    await write_log(path, 2)
    before = path.read_bytes()
    assert repair_torn_tail(path, now="x") is None
    assert path.read_bytes() == before


async def test_head_found_behind_a_record_longer_than_the_first_read(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    log = DecisionLog(path)
    await log.open()
    await log.append({"n": 0})
    last = await log.append({"reasons": ["x" * 1000] * 40})  # ~40 KiB, longer than 16 KiB
    await log.close()
    assert read_head(path).hash == last
    assert read_head(path).size == 2


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),  # lone surrogates included
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
_keys = st.sampled_from(["", "Hash", "h", "has", "hasg", "hash2", "hasi", "i", "é", "\ud800", "z"])


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.dictionaries(_keys | st.text(max_size=8), _values, max_size=8))
def test_sealed_line_is_the_hash_and_the_canonical_line(body: dict[str, object]) -> None:
    """The writer's one-pass seal equals the reference: record_hash, then canonical with it."""
    body.pop("hash", None)
    digest, line = sealed_line(body)
    assert digest == record_hash(body)
    assert line == canonical({**body, "hash": digest})
