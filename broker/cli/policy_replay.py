"""``broker policy replay``: logged decisions re-decided with a candidate policy.

The comparison is ``decisions/replay.py``'s (the console's policy page runs the same): each
decision a record holds is decided again, on the masked input stored with it, by the
candidate's compiled policy, and compared with what the record says was decided. One JSON line
per changed decision, then a summary; the exit code is 0 even when decisions change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from broker.audit.envelope import Envelope, RecordError, instant, parse_record
from broker.cli.audit_query import with_segments
from broker.core.errors import ConfigError
from broker.decisions.replay import Replay
from broker.policy.wasm import CompiledPolicy


def replay(
    logs: list[Path], compiled: CompiledPolicy, *, since: datetime | None, key: str | None
) -> int:
    """Print each decision of ``logs`` that ``compiled`` decides otherwise, then the summary.

    Raises:
        ConfigError: a log does not read, or holds a line that is not a record.
    """
    replaying = Replay(compiled)
    for record in _records(logs):
        for changed in replaying.changes(record, since=since, key=key):
            print(json.dumps(changed.as_json()))
    print(json.dumps({"summary": replaying.summary, "policy_digest": compiled.digest}))
    return 0


def _records(logs: list[Path]) -> Iterator[Envelope]:
    """The records of the logs (each with its closed segments, as ``audit query`` reads them),
    as envelopes; unlike ``audit query`` any JSON-lines file of records is read (a hand-made
    log of decisions to try a policy on)."""
    for log in logs:
        for path in with_segments([log]) or [log]:
            for number, line in enumerate(_read(path).splitlines(), start=1):
                try:
                    yield parse_record(line)
                except RecordError as exc:
                    raise ConfigError("--log", f"{path}:{number}: {exc}") from exc


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError("--log", f"cannot read {path}") from exc


def since_time(text: str) -> datetime:
    """``--since``: an RFC 3339 time with a zone, read as records' times are (an instant).

    Raises:
        ConfigError: not such a time.
    """
    parsed = instant(text)
    if parsed is None:
        raise ConfigError("--since", f"not an RFC 3339 time with a zone (Z or +HH:MM): {text!r}")
    return parsed
