"""Hash-chained, durable decision log (JSON lines), the leaves of a Merkle tree: the writer.

Records and their chain are ``records.py``; the files and segments ``segments.py``. Line *i*,
exactly as stored without its newline, is leaf *i* of an RFC 6962 tree (``crypto/merkle.py``) whose
signed checkpoints (``crypto/checkpoint.py``) commit to the whole log: truncation, rewrites with a
recomputed chain and reordering are detected against any checkpoint an auditor holds. The chain
stays as a cheap local check that names the first changed record without a checkpoint.

Appends are group-committed: the appends of one event-loop turn are handed to one writer
thread together, which takes every hand-over queued while its previous write was in flight
and gives them one ``write`` + ``fsync``; the appenders' futures are resolved on their event
loop in one callback (no executor, no task per batch: a single release pays one hand-over each
way, measured in bench/release_bench.py). ``append`` returns only
after the record is on disk; if writing fails, the log refuses every later append until a
restart (the file's state is then unknown), and the caller must not release anything. A record
that cannot be encoded (a bug of its writer) fails its own append only (``RecordNotEncodable``):
nothing of it is written, and the log goes on.

Several processes may append to one log (broker workers, ``broker keys …`` commands): each batch
is sealed and written under an exclusive ``flock`` after re-reading the chain head from the file,
so the chain stays linear whoever writes.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import json
import logging
import os
import queue
import stat
import threading
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.audit.records import GENESIS, ChainHead, LogCorrupt, sealed_line
from broker.audit.segments import SEGMENT_SUFFIX, log_files, read_head_all, segment_paths
from broker.core.errors import BrokerError, ErrorCode, InternalFailure, UpstreamError
from broker.core.records import RecordType
from broker.crypto.merkle import MerkleTree, leaf_hash

log = logging.getLogger(__name__)

# A queued append: the entry, whether it is conditional (written only if the log's newest
# record of its type names another value, ``CONDITIONAL``), and the event loop and future that
# wait for it.
_Queued = tuple[dict[str, Any], bool, asyncio.AbstractEventLoop, "asyncio.Future[Appended | None]"]
WRITER_IDLE_SECONDS = 5.0

# Record types appended only when they change something: type -> (the field compared with the
# log's newest record of that type, the field that names the newest one's value in the new
# record). N workers or replicas sharing a log that load one policy or one identity CA write
# one record.
CONDITIONAL: dict[str, tuple[str, str]] = {
    RecordType.POLICY_CHANGE: ("new_digest", "old_digest"),
    RecordType.IDENTITY_CA: ("ca_digest", "old_ca_digest"),
}
_MARKS = {kind: f'"type":"{kind}"'.encode() for kind in CONDITIONAL}


@dataclass(frozen=True)
class Appended:
    index: int  # the record's leaf index in the Merkle tree
    hash: str  # the record's chain hash
    leaf_hash: bytes = b""  # RFC 6962 leaf hash of the record's line (inclusion proofs)


class DecisionLog:
    """Append-only, group-committed, fsync'd decision log, with its Merkle tree in memory."""

    def __init__(self, path: Path, *, segment_bytes: int = 0, replica: str | None = None) -> None:
        self._path = path
        self._replica = replica  # written into every record ("replica") when set
        self._segment_bytes = segment_bytes  # rotate the active file past this size; 0: never
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._head = ChainHead(size=0, hash=GENESIS)
        self._known_head: ChainHead | None = None  # the head our last batch wrote (fast path)
        # per CONDITIONAL type: the value the log's newest record of it names, and that record
        # as last read from the files
        self._last_value: dict[str, str] = {}
        self._last_record: dict[str, dict[str, Any]] = {}
        # Appends waiting for the writer thread; None tells it to finish (close). The thread
        # starts with the first append and ends when idle or closed (``_write_batches``).
        self._queue: queue.SimpleQueue[list[_Queued] | None] = queue.SimpleQueue()
        # Appends of the current event-loop turn, handed to the writer together at its end
        # (one queue put and one thread wake-up for all of them: group commit starts here).
        self._gathering: dict[asyncio.AbstractEventLoop, list[_Queued]] = {}
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()  # guards _thread, _closing and the queue's end
        self._closing = False
        self._broken = False
        self.tree = MerkleTree()
        self._consumed: dict[int, int] = {}  # file inode -> bytes already hashed into the tree
        self._paths: dict[int, Path] = {}  # file inode -> its current path (rotation renames)
        self._committed = 0  # tree size readers may use (every level of it is complete)
        self._locations = Locations()  # each record's (file inode, byte offset)
        self._listeners: list[Callable[[list[bytes]], None]] = []
        # The tree, the index and the consumed offsets change in worker threads (a batch
        # write, a refresh): one at a time. (flock does not exclude threads sharing a file.)
        self._mutex = threading.Lock()

    def add_listener(self, listener: Callable[[list[bytes]], None]) -> None:
        """Called on the event loop with the lines of every durable batch (never blocking)."""
        self._listeners.append(listener)

    @property
    def head(self) -> ChainHead:
        return self._head

    @property
    def path(self) -> Path:
        return self._path

    @property
    def last_policy_change(self) -> dict[str, Any] | None:
        """The log's last ``policy_change`` record as read from the files (at start-up, and at
        each catch-up with other writers; not updated by this process's own appends): the
        policy manager's version floor is at least its ``version``."""
        return self._last_record.get(RecordType.POLICY_CHANGE)

    @property
    def refusing(self) -> bool:
        """Whether a write failed and this process refuses every append until restarted."""
        return self._broken

    @property
    def committed_size(self) -> int:
        """Records durably written and hashed into the tree (proofs use at most this)."""
        return self._committed

    def _catch_up(self) -> None:
        """Hash into the tree every complete line written since, in every file of the log (by
        us or by other writers; a rotation renames the active file into a segment)."""
        fresh: list[bytes] = []
        for path in log_files(self._path):
            try:
                status = path.stat()
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(status.st_mode):
                continue  # e.g. /dev/full in the write-failure test: nothing to read
            inode = status.st_ino
            self._paths[inode] = path
            start = self._consumed.get(inode, 0)
            with path.open("rb") as handle:
                handle.seek(start)
                data = handle.read()
            end = data.rfind(b"\n") + 1
            offset = start
            for line in data[:end].split(b"\n")[:-1]:
                self._locations.append(inode, offset)
                fresh.append(line)
                offset += len(line) + 1
            self._consumed[inode] = start + end
        self._note_conditional(fresh)
        if fresh:
            self._known_head = None  # another writer moved the head: read it before writing
        if self.tree.size == 0 and fresh:
            self.tree = MerkleTree.from_lines(fresh)  # start-up: the whole log, in bulk
        else:
            for line in fresh:
                self.tree.append(line)
        self._committed = self.tree.size

    def _note_conditional(self, fresh: list[bytes]) -> None:
        """The newest record of each ``CONDITIONAL`` type among ``fresh`` lines, by anyone."""
        pending = dict(_MARKS)
        for line in reversed(fresh):
            for kind, mark in list(pending.items()):
                if mark not in line:
                    continue
                record = _conditional_record(line, kind)
                if record is not None:
                    self._last_value[kind] = record[CONDITIONAL[kind][0]]
                    self._last_record[kind] = record
                    del pending[kind]
            if not pending:
                return

    def _initial_catch_up(self) -> None:
        """The start-up load: millions of fresh objects without cycles, so the collector is
        paused (it would otherwise more than double the time)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._catch_up()
        finally:
            if collecting:
                gc.enable()

    def read_lines(self, start: int, end: int) -> list[bytes]:
        """Records ``[start, end)`` exactly as stored (without newlines). Blocking: a thread."""
        if not 0 <= start <= end <= self._committed:
            raise ValueError(f"entries {start}..{end} are not in 0..{self._committed}")
        lines: list[bytes] = []
        index = start
        while index < end:  # one read per file the range touches
            inode, first = self._locations.inodes[index], self._locations.offsets[index]
            stop = index
            while stop < end and self._locations.inodes[stop] == inode:
                stop += 1
            last = (
                self._locations.offsets[stop]
                if stop < len(self._locations.inodes) and self._locations.inodes[stop] == inode
                else self._consumed[inode]
            )
            with self._paths[inode].open("rb") as handle:
                handle.seek(first)
                lines.extend(handle.read(last - first).split(b"\n")[:-1][: stop - index])
            index = stop
        return lines

    async def refresh(self) -> None:
        """Catch up with records other processes of this replica appended (``--workers N``
        share one log): after this, the tree, proofs and entries cover every record durably
        written by any of them. Under a shared lock: no writer is mid-batch."""
        await asyncio.to_thread(self._refresh)

    def _refresh(self) -> None:
        with self._mutex:
            if self._lock_fd is None:
                return
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
            try:
                self._catch_up()
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    async def open(self) -> None:
        """Recover the chain head and open the file for appending.

        Raises:
            LogCorrupt: when the log's last record is damaged (the broker refuses to start).
        """
        self._head = await asyncio.to_thread(read_head_all, self._path)
        await asyncio.to_thread(self._initial_catch_up)
        if self.tree.size != self._head.size:
            raise LogCorrupt(self.tree.size + 1, "the tree and the chain disagree on the size")
        self._fd = await asyncio.to_thread(self._open_fd)
        self._lock_fd = await asyncio.to_thread(self._open_lock)

    def _open_lock(self) -> int:
        """``<log>.lock``: what writers lock (rotation replaces the active file under it). A log
        that is not a regular file (a device) locks its own descriptor instead."""
        if self._path.exists() and not self._path.is_file():
            assert self._fd is not None  # noqa: S101 - opened first
            return os.dup(self._fd)
        lock = self._path.with_name(self._path.name + ".lock")
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)

    def _open_fd(self) -> int:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        directory = os.open(self._path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the file's directory entry is durable too
        finally:
            os.close(directory)
        return fd

    async def close(self) -> None:
        """Write every append already queued, then close the files."""
        self._hand_over(asyncio.get_running_loop())  # this turn's appends go before the end
        with self._thread_lock:
            self._closing = True
            writer = self._thread
            if writer is not None:
                self._queue.put(None)
        if writer is not None:
            await asyncio.to_thread(writer.join)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def append(self, entry: Mapping[str, Any]) -> str:
        """Append a record durably and return its hash (``append_entry`` for its index too).

        Raises:
            UpstreamError: ``audit_log_unavailable`` when the record could not be made durable.
        """
        return (await self.append_entry(entry)).hash

    async def append_entry(self, entry: Mapping[str, Any]) -> Appended:
        """Append a record durably; its leaf index and hash.

        Raises:
            UpstreamError: ``audit_log_unavailable`` when the record could not be made durable.
            RecordNotEncodable: the record cannot be written as canonical JSON (``NaN``, a key
                not a str, an object JSON has no form for): this append alone fails.
        """
        appended = await self._enqueue(entry, conditional=False)
        assert appended is not None  # noqa: S101 - only conditional entries are skipped
        return appended

    async def append_policy_change(self, entry: Mapping[str, Any]) -> Appended | None:
        """Append a ``policy_change`` record unless the newest one in the log, written by any
        process or replica sharing it, already names ``entry["new_digest"]``; ``old_digest`` is
        that newest one's. Decided under the log's lock: N workers loading one policy write one
        record. ``None`` when nothing needed writing.

        Raises:
            UpstreamError: ``audit_log_unavailable`` when the record could not be made durable.
        """
        return await self.append_if_changed({**entry, "type": RecordType.POLICY_CHANGE})

    async def append_if_changed(self, entry: Mapping[str, Any]) -> Appended | None:
        """Append a record of a ``CONDITIONAL`` type unless the newest one of that type in the
        log (by any process sharing it) names the same value; the new record names that
        newest one's value too (e.g. ``old_digest``). ``None`` when nothing needed writing.

        Raises:
            UpstreamError: ``audit_log_unavailable`` when the record could not be made durable.
        """
        if entry.get("type") not in CONDITIONAL:
            raise ValueError(f"{entry.get('type')!r} records are not conditional")
        return await self._enqueue(entry, conditional=True)

    async def _enqueue(self, entry: Mapping[str, Any], *, conditional: bool) -> Appended | None:
        if self._broken or self._fd is None:
            raise _unavailable()
        if self._closing:
            raise _unavailable()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Appended | None] = loop.create_future()
        gathering = self._gathering.get(loop)
        if gathering is None:
            self._gathering[loop] = gathering = []
            loop.call_soon(self._hand_over, loop)
        gathering.append((dict(entry), conditional, loop, future))
        return await asyncio.shield(future)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """At the end of the loop turn: give this turn's appends to the writer thread."""
        gathered = self._gathering.pop(loop, None)
        if not gathered:
            return
        with self._thread_lock:
            self._queue.put(gathered)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._write_batches,
                    name=f"decision-log-writer {self._path}",
                    daemon=True,
                )
                self._thread.start()

    def _write_batches(self) -> None:
        """The writer thread: take what is queued (every loop turn's appends that arrived while
        the previous write was in flight are one batch), seal, write and fsync it, then resolve
        its futures on their event loops, one callback per loop. Idle for
        ``WRITER_IDLE_SECONDS``, it ends (the next append starts another), so a log nobody
        closes leaves no thread."""
        while True:
            try:
                first = self._queue.get(timeout=WRITER_IDLE_SECONDS)
            except queue.Empty:
                with self._thread_lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if first is None:  # close(): everything queued before it is written
                return
            batch = list(first)
            closing = False
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                batch.extend(more)
            self._write_batch(batch)
            if closing:
                return

    def _write_batch(self, batch: list[_Queued]) -> None:
        results: list[Appended | BrokerError | None] | None = None
        failure: BaseException | None = None
        lines: list[bytes] = []
        if self._broken:
            failure = _unavailable()
        else:
            try:
                self._head, results, lines = self._seal_and_write(
                    [(entry, conditional) for entry, conditional, _, _ in batch]
                )
            except (OSError, LogCorrupt) as exc:
                log.critical("decision log write failed; refusing all releases: %s", exc)
                self._broken = True
                failure = _unavailable()
            except Exception:  # a bug (a record that cannot be encoded fails alone, above): the
                # writer thread must not die with appenders waiting; the file's state is
                # unknown, so the log stops as on a write failure (fail closed until a restart)
                log.critical("decision log writer failed; refusing all releases", exc_info=True)
                self._broken = True
                failure = _unavailable()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for position, (_, _, loop, future) in enumerate(batch):
            outcome = failure if results is None else results[position]
            by_loop.setdefault(loop, []).append((future, outcome))
        for loop, outcomes in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._resolve, outcomes, lines)
            except RuntimeError:  # that loop is closed: nobody awaits these any more
                log.warning(
                    "decision log: %d appends finished after their loop closed", len(outcomes)
                )

    def _resolve(self, outcomes: list[tuple[asyncio.Future[Any], Any]], lines: list[bytes]) -> None:
        """On the event loop: hand the durable lines to the listeners, then wake the appenders
        (a listener sees a record no later than its appender returns)."""
        if lines:
            for listener in self._listeners:
                listener(lines)
        for future, outcome in outcomes:
            if future.done():
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def _seal_and_write(
        self, entries: list[tuple[dict[str, Any], bool]]
    ) -> tuple[ChainHead, list[Appended | BrokerError | None], list[bytes]]:
        """Under an exclusive lock: catch up with other writers, chain the batch to the head,
        write, fsync, and hash the new lines into the tree. A conditional record naming the
        value the log's newest one of its type names is skipped (``None``); a record that
        cannot be encoded is not written (``RecordNotEncodable``, for its appender alone).
        Returns the new head, each entry's place, and the lines written (exactly the durable
        bytes)."""
        with self._mutex:
            return self._seal_and_write_locked(entries)

    def _seal_and_write_locked(
        self, entries: list[tuple[dict[str, Any], bool]]
    ) -> tuple[ChainHead, list[Appended | BrokerError | None], list[bytes]]:
        if self._fd is None or self._lock_fd is None:
            raise OSError("decision log is closed")
        # The lock is a file of its own: rotation replaces the active file under it.
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            self._follow_rotation()
            head = self._known_head if self._in_step() else None
            self._known_head = None  # until this batch is durably written
            if head is None:  # another writer appended (or first batch): read what it wrote
                self._catch_up()
                head = read_head_all(self._path)
            self._rotate_if_full()
            if self.tree.size != head.size:
                raise LogCorrupt(head.size, "the tree and the chain disagree on the size")
            lines: list[bytes] = []
            leaves: list[bytes] = []
            appended: list[Appended | BrokerError | None] = []
            last = dict(self._last_value)
            for entry, conditional in entries:
                kind = str(entry.get("type"))
                chained: dict[str, Any] = {}
                if conditional:
                    field, previous_field = CONDITIONAL[kind]
                    if entry.get(field) == last.get(kind):
                        appended.append(None)
                        continue
                    chained = {previous_field: last.get(kind)}
                record = {
                    **entry,
                    **chained,
                    "index": head.size,
                    "seq": head.size,
                    "prev": head.hash,
                }
                if self._replica is not None:
                    record["replica"] = self._replica
                try:
                    record["hash"], line = sealed_line(record)
                except Exception:  # a record JSON cannot hold (a bug of its writer): its own
                    # append fails, the rest of the batch and the log go on (nothing written)
                    log.exception("decision log: a %s record cannot be encoded", entry.get("type"))
                    appended.append(RecordNotEncodable())
                    continue
                if kind in CONDITIONAL and isinstance(entry.get(CONDITIONAL[kind][0]), str):
                    last[kind] = entry[CONDITIONAL[kind][0]]
                lines.append(line)
                leaves.append(leaf_hash(line))
                appended.append(
                    Appended(index=head.size, hash=record["hash"], leaf_hash=leaves[-1])
                )
                head = ChainHead(size=head.size + 1, hash=record["hash"])
            self._write_lines(lines, leaves)
            self._known_head = head
            self._last_value = last
            return head, appended, lines
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _write_lines(self, lines: list[bytes], leaves: list[bytes]) -> None:
        """Under the lock: write the sealed lines, fsync, and hash them into the tree."""
        assert self._fd is not None  # noqa: S101 - checked by the caller
        view = memoryview(b"".join(line + b"\n" for line in lines))
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        inode = os.fstat(self._fd).st_ino
        self._paths[inode] = self._path
        offset = self._consumed.get(inode, 0)
        for line, leaf in zip(lines, leaves, strict=True):
            self._locations.append(inode, offset)
            self.tree.append_leaf_hash(leaf)
            offset += len(line) + 1
        self._consumed[inode] = offset
        self._committed = self.tree.size

    def _in_step(self) -> bool:
        """Whether the active file ends exactly where our last write ended: then no other writer
        appended since, and the head we wrote is still the head (no read, no directory scan)."""
        assert self._fd is not None  # noqa: S101 - checked by the caller
        status = os.fstat(self._fd)
        return (
            self._known_head is not None
            and stat.S_ISREG(status.st_mode)
            and self._consumed.get(status.st_ino) == status.st_size
        )

    def _follow_rotation(self) -> None:
        """If another writer rotated the active file, write to the new one."""
        assert self._fd is not None  # noqa: S101 - checked by the caller
        try:
            status = self._path.stat()
        except FileNotFoundError:
            status = None
        if status is not None and not stat.S_ISREG(status.st_mode):
            return  # a device is never rotated
        current = -1 if status is None else status.st_ino
        if current != os.fstat(self._fd).st_ino:
            os.close(self._fd)
            self._fd = self._open_fd()

    def _rotate_if_full(self) -> None:
        """Close the active file as the next segment once it holds ``segment_bytes``."""
        assert self._fd is not None  # noqa: S101 - checked by the caller
        if not self._segment_bytes or os.fstat(self._fd).st_size < self._segment_bytes:
            return
        segments = segment_paths(self._path)
        number = int(SEGMENT_SUFFIX.search(segments[-1].name).group(1)) + 1 if segments else 1  # type: ignore[union-attr]
        target = self._path.with_name(f"{self._path.name}.{number:06d}")
        os.rename(self._path, target)
        self._paths[os.fstat(self._fd).st_ino] = target
        os.close(self._fd)
        self._fd = self._open_fd()  # a new, empty active file; the directory entry is fsync'd


class Locations:
    """Where each record starts: (file inode, byte offset) in two int64 arrays, 16 bytes per
    record (a list of tuples took ~120): the index grows with the log for the broker's life."""

    __slots__ = ("inodes", "offsets")

    def __init__(self) -> None:
        self.inodes = array("q")
        self.offsets = array("q")

    def append(self, inode: int, offset: int) -> None:
        self.inodes.append(inode)
        self.offsets.append(offset)


def _conditional_record(line: bytes, kind: str) -> dict[str, Any] | None:
    """A stored line (canonical JSON) if it is a ``kind`` record naming a str value in its
    compared field, else ``None``."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("type") != kind:
        return None
    return record if isinstance(record.get(CONDITIONAL[kind][0]), str) else None


class RecordNotEncodable(InternalFailure):
    """A record canonical JSON cannot hold was appended (a bug of its writer; the decision
    kernel replaces such a record by its minimal one before it gets here): that append fails
    with ``internal_error``, nothing of it is written, and the log takes every other."""

    def __init__(self) -> None:
        super().__init__("the record could not be encoded; nothing of it was logged")


def _unavailable() -> UpstreamError:
    return UpstreamError(
        "the decision could not be logged durably; nothing was released",
        code=ErrorCode.AUDIT_LOG_UNAVAILABLE,
    )
