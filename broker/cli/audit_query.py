"""``broker audit query`` and ``broker audit export``: reading a log's records (every segment)
and selecting them — per key for releases on attestation results, an attestation's whole story
with ``--attestation`` — as JSON lines, a table, or OCSF events for a SIEM. Every record is read
through its envelope (``audit/envelope.py``), filtered on its typed members. The file readers are
shared with ``cli/audit.py`` (verify, prove) and ``broker policy replay``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from broker.audit.envelope import (
    ATTESTATION_TYPES,
    RELEASING,
    Envelope,
    RecordError,
    parse_record,
)
from broker.audit.envelope import instant as record_instant
from broker.audit.ocsf import ocsf_events
from broker.audit.outcomes import RESULTS
from broker.audit.query import Filters, rows, within
from broker.audit.records import LogCorrupt
from broker.audit.segments import log_files
from broker.core.errors import ConfigError, FileFormatError
from broker.core.records import ChangeResult, RecordType

# results only a key change's outcome has (``error`` is a release's too)
CHANGE_ONLY = (ChangeResult.OK.value, ChangeResult.UNKNOWN.value)


def add_parsers(audit: Any) -> None:
    query = audit.add_parser("query", help="the common questions, as JSON lines or a table")
    query.add_argument("logs", type=Path, nargs="+", metavar="LOG")
    for name in ("key", "image", "project", "code", "replica"):
        query.add_argument(f"--{name}")
    query.add_argument("--decision", help="a decision id")
    query.add_argument(
        "--attestation",
        metavar="JTI",
        help="an attestation result: its record, every key released on it, its revocation",
    )
    query.add_argument(
        "--who", help="who made a change (key and policy records): token:…, user@host, broker"
    )
    query.add_argument(
        "--result",
        choices=(*RESULTS, *CHANGE_ONLY),
        help="a release's result; ok or unknown: a key change's outcome (error: with --who too)",
    )
    query.add_argument("--since", type=instant, help="RFC 3339 with a zone: at or after")
    query.add_argument("--until", type=instant, help="RFC 3339 with a zone: at or before")
    query.add_argument("--table", action="store_true")
    query.set_defaults(run=_query)
    export = audit.add_parser("export", help="records for a SIEM: OCSF events or JSON lines")
    export.add_argument("log", type=Path)
    export.add_argument("--format", choices=["ocsf", "jsonl"], default="ocsf")
    export.add_argument("--since", type=instant, help="RFC 3339 with a zone: at or after")
    export.add_argument("--until", type=instant, help="RFC 3339 with a zone: at or before")
    export.set_defaults(run=_export)


def with_segments(paths: list[Path]) -> list[Path]:
    """Each active log path preceded by its closed segments (``<log>.000001``, …), so that the
    commands read the whole tree whichever file an auditor names."""
    expanded: list[Path] = []
    for path in paths:
        for file in log_files(path):
            if file.exists() and file not in expanded:
                expanded.append(file)
    return expanded


NOT_A_LOG = "name a decision log the broker wrote ([audit] log) or one of its segments"


def read_file(path: Path, what: str) -> bytes:
    """The file's bytes; a log (``LOG``, ``--log``) only if it starts like a decision log, a
    checkpoint (``checkpoint``, ``--checkpoint``) only if it is text.

    Raises:
        ConfigError: the file cannot be read, or is not what ``what`` names.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(what, f"cannot read {path}") from exc
    if what in ("LOG", "--log") and data and not _is_record(data.split(b"\n", 1)[0]):
        raise FileFormatError(
            path, "not a decision log (its first line is not a record)", NOT_A_LOG
        )
    if what in ("checkpoint", "--checkpoint"):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileFormatError(
                path, "not a checkpoint (not text)", "name the <log>.checkpoint the broker wrote"
            ) from exc
    return data


def _is_record(line: bytes) -> bool:
    """A line as the broker writes records: a JSON object with a leaf index and a hash."""
    try:
        record = parse_record(line)
    except RecordError:
        return False
    return record.index is not None and record.hash is not None


def record_lines(data: bytes) -> list[bytes]:
    if data and not data.endswith(b"\n"):
        raise LogCorrupt(data.count(b"\n") + 1, "truncated mid-record (no final newline)")
    return data.split(b"\n")[:-1] if data else []


def records(paths: list[Path]) -> Iterator[Envelope]:
    """Every record of the logs (and their segments), in order, as envelopes.

    Raises:
        ConfigError: a file that is not a log; LogCorrupt (with its path): a damaged line.
    """
    for path in with_segments(paths) or paths:
        try:
            lines = record_lines(read_file(path, "LOG"))
        except LogCorrupt as exc:
            fix = f"after a crash, `broker audit repair {path}` cuts a torn last record"
            raise LogCorrupt(exc.line, f"{exc.problem}; {fix}", path=path) from exc
        for number, line in enumerate(lines, start=1):
            try:
                yield parse_record(line)
            except RecordError as exc:
                raise LogCorrupt(number, str(exc), path=path) from exc


def instant(text: str) -> datetime:
    """An RFC 3339 time with a zone (``2026-11-23T00:00:00Z``, ``…+01:00``), compared as an
    instant: the same moment in two zones selects the same records. Anything else is refused
    (argparse exits 2 naming it): an unparsable ``--since`` used to select nothing, which read
    like "no records".
    """
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an RFC 3339 time: {text!r}") from exc
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no zone (add Z or +HH:MM)")
    utc = record_instant(text)  # as records' times are read: in UTC
    if utc is None:  # 0001-01-01T00:00:00+01:00: before year 1 in UTC
        raise argparse.ArgumentTypeError(f"not an RFC 3339 time: {text!r}")
    return utc


def _attestation_of(record: Envelope) -> str | None:
    """The attestation result whose story the record is part of (ATTESTATION_TYPES)."""
    return None if record.attestation is None else record.attestation.jti


def _query(args: argparse.Namespace) -> int:
    # Releases (per key on attestation results too); with --who, the changes someone made (key
    # and policy records); with --attestation, that result's whole story.
    wanted: frozenset[RecordType] | None = RELEASING if args.who is None else None
    if args.who is None and args.result in CHANGE_ONLY:  # what only a key change's outcome says
        wanted = frozenset({RecordType.KEY_ADMIN})
    if args.attestation is not None:
        wanted = ATTESTATION_TYPES
    filters = Filters.from_args(args)
    selected = [
        row
        for record in records(args.logs)
        if (wanted is None or record.kind in wanted)
        and (args.attestation is None or _attestation_of(record) == args.attestation)
        for row in rows(record)
        if filters.matches(row)
    ]
    if args.table:
        print(f"{'index':>7}  {'time':32}  {'type':19}  {'result':6}  {'code':24}  key")
        for row in selected:
            record, key = row.record, row.key
            code = record.code if key is None else key.code
            name = record.key if key is None else key.key
            print(
                f"{record.index!s:>7}  {record.time!s:32}  {record.type or '-':19}  "
                f"{row.result or '-':6}  {code or '-':24}  {name or '-'}"
            )
    else:
        for row in selected:
            print(json.dumps(row.as_json()))
    return 0


def _export(args: argparse.Namespace) -> int:
    for record in records([args.log]):
        if not within(record, args.since, args.until):
            continue
        if args.format == "ocsf":  # one event per key for a release on a result
            for event in ocsf_events(record):
                print(json.dumps(event))
        else:
            print(json.dumps(dict(record.body)))
    return 0
