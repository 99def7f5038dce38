"""How the console reads records: the newest ones of this replica's log, through the query
code of ``broker audit query`` (each line parsed into its envelope, split into rows, selected
by ``Filters``), bounded, in a thread.

A page reads at most ``MAX_SCAN`` records, the newest, in pages of ``PAGE`` lines, and keeps
none of them: the callers fold what they need into counts as the records pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web

from broker.audit.envelope import Envelope, RecordError, parse_record
from broker.audit.log import DecisionLog
from broker.audit.query import Filters
from broker.core.errors import InputError

MAX_SCAN = 20_000
PAGE = 2_000
MAX_FILTER_CHARS = 256
FILTERS = ("key", "image", "replica")


@dataclass(frozen=True)
class Scan:
    """What a page read: records ``[first, end)`` of the log (``end``: its committed size)."""

    first: int
    end: int


def newest(decisions: DecisionLog, limit: int = MAX_SCAN) -> tuple[Scan, Iterator[Envelope]]:
    """The newest ``limit`` records, oldest first, as envelopes (lines that are not records are
    skipped: ``broker audit verify`` is the place that reports them). Blocking: iterate in a
    thread."""
    end = decisions.committed_size
    scan = Scan(max(0, end - limit), end)

    def envelopes() -> Iterator[Envelope]:
        for start in range(scan.first, end, PAGE):
            for line in decisions.read_lines(start, min(start + PAGE, end)):
                try:
                    yield parse_record(line)
                except RecordError:
                    continue

    return scan, envelopes()


def filters_of(request: web.Request, *, result: str | None = None) -> Filters:
    """The console's filters (key, image, replica) from the query string.

    Raises:
        InputError: a value that is too long or not printable.
    """
    chosen: dict[str, str] = {}
    for name in FILTERS:
        value = request.query.get(name, "").strip()
        if len(value) > MAX_FILTER_CHARS or not value.isprintable():
            raise InputError(f"{name} must be printable and at most {MAX_FILTER_CHARS} characters")
        if value:
            chosen[name] = value
    return Filters(
        key=chosen.get("key"),
        image=chosen.get("image"),
        replica=chosen.get("replica"),
        result=result,
    )


def read_record(decisions: DecisionLog, index: int) -> bytes | None:
    """Record ``index`` exactly as stored, or ``None`` past the committed log. Blocking."""
    if not 0 <= index < decisions.committed_size:
        return None
    return decisions.read_lines(index, index + 1)[0]
