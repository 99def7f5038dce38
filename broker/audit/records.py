"""Decision records and their hash chain, pure: sealing a record, verifying a run of lines.

Each line is one record: canonical JSON (sorted keys, no spaces, UTF-8) with ``index`` and
``seq`` (both 0, 1, …: ``index`` is the record's leaf index in the Merkle tree), ``prev`` (the
previous record's ``hash``; 64 zeros for the first) and ``hash`` = SHA-256 over the canonical
JSON of the record without ``hash``. The writer is ``log.py``; files and segments are
``segments.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from broker.core.encoding import canonical, canonical_members

GENESIS = "0" * 64


class LogCorrupt(Exception):
    """The log on disk does not verify; names the first bad record (1-based line)."""

    def __init__(self, line: int, problem: str, *, path: object = None) -> None:
        where = "" if path is None else f"{path}: "
        super().__init__(f"{where}record {line}: {problem}")
        self.line = line
        self.problem = problem
        self.path = path  # the file, when known (the CLI prints "PATH: record N: …")


def record_hash(record: Mapping[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical(body)).hexdigest()


def sealed_line(body: Mapping[str, Any]) -> tuple[str, bytes]:
    """``record_hash`` of ``body`` and ``canonical`` of ``body`` with that ``hash`` member, in one
    canonical pass: the members sorting before ``"hash"`` and those after it are dumped apart,
    so the hashed text and the line are the two halves joined without and with the hash member
    (what ``json.dumps(sort_keys=True)`` writes, member for member). Byte-identical to the two
    calls (a property test compares them); the log writer thread saves two of three dumps. A
    member holding an ``Encoded`` value (a record part encoded once, issue 31) is spliced, not
    encoded again (``canonical_members``)."""
    before = canonical_members({k: v for k, v in body.items() if k < "hash"})
    after = canonical_members({k: v for k, v in body.items() if k > "hash"})
    digest = hashlib.sha256(b"{" + b",".join(m for m in (before, after) if m) + b"}").hexdigest()
    member = b'"hash":"' + digest.encode("ascii") + b'"'
    return digest, b"{" + b",".join(m for m in (before, member, after) if m) + b"}"


@dataclass(frozen=True)
class ChainHead:
    size: int  # number of records
    hash: str  # hash of the last record (GENESIS when empty)


@dataclass(frozen=True)
class VerifyReport:
    head: ChainHead


def iter_records(data: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record) for each complete line.

    Raises:
        LogCorrupt: for a line that is not a JSON object or a final line without newline.
    """
    if not data:
        return
    lines = data.split(b"\n")
    if lines[-1] != b"":
        raise LogCorrupt(len(lines), "truncated mid-record (no final newline)")
    for number, line in enumerate(lines[:-1], start=1):
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise LogCorrupt(number, "not valid JSON") from exc
        if not isinstance(record, dict):
            raise LogCorrupt(number, "not a JSON object")
        yield number, record


def check_link(number: int, record: Mapping[str, Any], previous: ChainHead) -> ChainHead:
    """Check one record against the chain so far and return the new head.

    Raises:
        LogCorrupt: naming what does not match.
    """
    if record.get("seq") != previous.size:
        raise LogCorrupt(number, f"seq {record.get('seq')!r}, expected {previous.size}")
    if record.get("prev") != previous.hash:
        raise LogCorrupt(number, "prev does not match the previous record (removed or reordered)")
    if record.get("hash") != record_hash(record):
        raise LogCorrupt(number, "hash does not match the content (record changed)")
    return ChainHead(size=previous.size + 1, hash=str(record["hash"]))


def verify_bytes(data: bytes, *, expected_head: str | None = None) -> VerifyReport:
    """Verify a whole log.

    Args:
        data: the log file's bytes.
        expected_head: a record hash known from earlier; the log must contain it.

    Raises:
        LogCorrupt: for the first bad record, or when ``expected_head`` is absent.
    """
    head = ChainHead(size=0, hash=GENESIS)
    seen_expected = expected_head is None
    for number, record in iter_records(data):
        head = check_link(number, record, head)
        seen_expected = seen_expected or head.hash == expected_head
    if not seen_expected:
        raise LogCorrupt(head.size + 1, "the expected head record is missing (log truncated)")
    return VerifyReport(head=head)
