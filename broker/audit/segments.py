"""The log's files: reading the chain head from a file's end, the closed segments
(``<log>.000001``…), verifying a file, and cutting a torn final line after a crash."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from broker.audit.records import (
    GENESIS,
    ChainHead,
    LogCorrupt,
    VerifyReport,
    record_hash,
    verify_bytes,
)
from broker.core.encoding import canonical
from broker.core.records import RecordType

TAIL_FIRST_READ_BYTES = 16 * 1024
TAIL_READ_BYTES = 4 * 1024 * 1024


def verify_file(path: Path, *, expected_head: str | None = None) -> VerifyReport:
    """``verify_bytes`` over a file."""
    return verify_bytes(path.read_bytes(), expected_head=expected_head)


def read_head(path: Path) -> ChainHead:
    """The chain head from the last record, reading only the end of the file.

    Raises:
        LogCorrupt: when the last record is truncated or does not verify on its own.
    """
    if not path.exists() or path.stat().st_size == 0:
        return ChainHead(size=0, hash=GENESIS)
    tail = _last_line_window(path)
    if not tail.endswith(b"\n"):
        raise LogCorrupt(
            _line_count(path) + 1,  # the torn line follows the last complete one
            f"the last record is truncated (a torn write); run `broker audit repair {path}`",
            path=path,
        )
    last_line = tail[:-1].rsplit(b"\n", 1)[-1]
    try:
        record = json.loads(last_line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _damaged_last(path, "is not JSON") from exc
    if not isinstance(record, dict) or record.get("hash") != record_hash(record):
        raise _damaged_last(path, "does not verify")
    return ChainHead(size=int(record["seq"]) + 1, hash=str(record["hash"]))


def _damaged_last(path: Path, problem: str) -> LogCorrupt:
    return LogCorrupt(
        _line_count(path),
        f"the last record {problem}; run `broker audit verify {path}` to find the first bad one",
        path=path,
    )


def _line_count(path: Path) -> int:
    """Complete lines in the file (read in chunks: only on the error path)."""
    count = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            count += chunk.count(b"\n")
    return count


SEGMENT_SUFFIX = re.compile(r"\.(\d{6})$")


def segment_paths(path: Path) -> list[Path]:
    """Closed segments of the log at ``path``, oldest first: ``<log>.000001``, ``<log>.000002``…"""
    found = []
    for candidate in path.parent.glob(path.name + ".*"):
        match = SEGMENT_SUFFIX.search(candidate.name)
        if match and candidate.name == f"{path.name}.{match.group(1)}":
            found.append((int(match.group(1)), candidate))
    return [candidate for _, candidate in sorted(found)]


def log_files(path: Path) -> list[Path]:
    """Every file of the log, in record order: the closed segments, then the active file."""
    return [*segment_paths(path), path]


def read_head_all(path: Path) -> ChainHead:
    """The chain head of a segmented log: the active file's, or the newest segment's."""
    head = read_head(path)
    if head.size:
        return head
    for segment in reversed(segment_paths(path)):
        head = read_head(segment)
        if head.size:
            return head
    return head


@dataclass(frozen=True)
class RepairReport:
    removed_bytes: int
    removed_sha256: str
    head: ChainHead


def repair_torn_tail(path: Path, *, now: str) -> RepairReport | None:
    """Cut a torn final line (a write interrupted by a crash) and record that it was cut.

    Everything before the torn line must verify; otherwise nothing is changed. The removed bytes
    are never a released decision (a record counts only once fsync'd whole, and keys leave only
    after that), but the cut is logged as a ``log_repair`` record with their SHA-256 and length,
    so an auditor sees it.

    Returns:
        ``None`` when the log was intact.

    Raises:
        LogCorrupt: when the damage is not only a torn final line.
    """
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        verify_bytes(data)
        return None
    cut = data.rfind(b"\n") + 1
    fragment = data[cut:]
    report = verify_bytes(data[:cut])
    record = {
        "type": RecordType.LOG_REPAIR,
        "time": now,
        "removed_bytes": len(fragment),
        "removed_sha256": hashlib.sha256(fragment).hexdigest(),
        "index": report.head.size,
        "seq": report.head.size,
        "prev": report.head.hash,
    }
    record["hash"] = record_hash(record)
    with path.open("r+b") as handle:
        handle.truncate(cut)
        handle.seek(cut)
        handle.write(canonical(record) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    return RepairReport(
        removed_bytes=len(fragment),
        removed_sha256=str(record["removed_sha256"]),
        head=ChainHead(size=report.head.size + 1, hash=str(record["hash"])),
    )


def _last_line_window(path: Path) -> bytes:
    """The end of the file, grown from 16 KiB until it holds the whole last line."""
    with path.open("rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        window = TAIL_FIRST_READ_BYTES
        while True:
            start = max(0, size - window)
            handle.seek(start)
            tail = handle.read()
            if start == 0 or b"\n" in tail[:-1] or window >= TAIL_READ_BYTES:
                return tail
            window *= 4
