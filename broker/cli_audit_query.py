"""``broker audit query`` and ``broker audit export``: reading a log's records (every segment)
and selecting them — per key for releases on attestation results, an attestation's whole story
with ``--attestation`` — as JSON lines, a table, or OCSF events for a SIEM. The readers are
shared with ``cli_audit.py`` (verify, prove)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from broker.audit.ocsf import ocsf_events
from broker.audit.outcomes import RESULTS
from broker.audit.records import LogCorrupt
from broker.audit.segments import log_files
from broker.core.errors import ConfigError, FileFormatError
from broker.core.jsonsafe import loads_bounded


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
    query.add_argument("--result", choices=RESULTS)
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
    """A line as the broker writes records: a JSON object with ``seq`` and ``hash``."""
    try:
        record = loads_bounded(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "seq" in record and "hash" in record


def record_lines(data: bytes) -> list[bytes]:
    if data and not data.endswith(b"\n"):
        raise LogCorrupt(data.count(b"\n") + 1, "truncated mid-record (no final newline)")
    return data.split(b"\n")[:-1] if data else []


def _records(paths: list[Path]) -> Iterator[dict[str, Any]]:
    """Every record of the logs (and their segments), in order.

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
                record = loads_bounded(line)
            except ValueError as exc:
                raise LogCorrupt(number, "not a JSON record", path=path) from exc
            if isinstance(record, dict):
                yield record


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
    return parsed


def _within(record: dict[str, Any], since: datetime | None, until: datetime | None) -> bool:
    if since is None and until is None:
        return True
    try:
        when = instant(str(record.get("time", "")))
    except argparse.ArgumentTypeError:
        return False  # a record without a readable time is in no interval
    return not ((since is not None and when < since) or (until is not None and when > until))


def _matches(record: dict[str, Any], args: argparse.Namespace) -> bool:
    identity = record.get("identity") or {}
    if args.result is not None and args.result not in (
        record.get("result"),
        record.get("release_result"),  # a key's row of a partial release: the request's
    ):
        return False
    checks = [
        (args.key, record.get("key")),
        (args.code, record.get("code")),
        (args.image, identity.get("image_digest")),
        (args.project, identity.get("project_id")),
        (args.decision, record.get("decision_id")),
        (args.replica, record.get("replica")),
        (args.who, record.get("who")),
    ]
    if any(wanted is not None and wanted != found for wanted, found in checks):
        return False
    return _within(record, args.since, args.until)


ATTESTATION_TYPES = ("attestation", "attested_release", "attestation_revoked")


def per_key(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A record as query rows: a release on an attestation result is one row per key asked
    (its version, result, code, reasons, policy digest), each naming the attestation; every
    other record is one row."""
    if record.get("type") != "attested_release":
        yield record
        return
    attestation = record.get("attestation") or {}
    common = {
        k: record.get(k) for k in ("type", "index", "seq", "time", "decision_id", "replica")
    } | {
        "attestation": attestation.get("jti"),
        "attestation_log_index": attestation.get("log_index"),
        "dpop_jti": record.get("dpop_jti"),
        "identity": record.get("identity"),
        "release_result": record.get("result"),  # the request's: partial when some keys were
    }
    keys = record.get("keys") or []
    if not keys:  # refused before any key was decided
        yield common | {k: record.get(k) for k in ("result", "code", "message")} | {"key": None}
    for key in keys:
        yield common | {
            k: key.get(k)
            for k in ("key", "version", "result", "code", "reasons", "policy_digest", "input")
        }


def _attestation_of(record: dict[str, Any]) -> Any:
    if record.get("type") == "attested_release":
        return (record.get("attestation") or {}).get("jti")
    return record.get("jti") if record.get("type") in ATTESTATION_TYPES else None


def _query(args: argparse.Namespace) -> int:
    # Releases (per key on attestation results too); with --who, the changes someone made (key
    # and policy records); with --attestation, that result's whole story.
    wanted: set[str] | None = {"release", "attested_release"} if args.who is None else None
    if args.attestation is not None:
        wanted = set(ATTESTATION_TYPES)
    rows = [
        row
        for r in _records(args.logs)
        if (wanted is None or r.get("type") in wanted)
        and (args.attestation is None or _attestation_of(r) == args.attestation)
        for row in per_key(r)
        if _matches(row, args)
    ]
    if args.table:
        print(f"{'index':>7}  {'time':32}  {'type':19}  {'result':6}  {'code':24}  key")
        for r in rows:
            print(
                f"{r.get('index', r.get('seq')):>7}  {r.get('time')!s:32}  "
                f"{r.get('type')!s:19}  {r.get('result') or '-'!s:6}  "
                f"{r.get('code') or '-'!s:24}  {r.get('key') or '-'}"
            )
    else:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "input"}))
    return 0


def _export(args: argparse.Namespace) -> int:
    for record in _records([args.log]):
        if not _within(record, args.since, args.until):
            continue
        if args.format == "ocsf":  # one event per key for a release on a result
            for event in ocsf_events(record):
                print(json.dumps(event))
        else:
            print(json.dumps(record))
    return 0
