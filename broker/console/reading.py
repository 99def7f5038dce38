"""How the console reads records: a window of this replica's log, paged by leaf index, through
the query code of ``broker audit query`` (each line parsed into its envelope, split into rows,
selected by ``Filters``), bounded, in a thread.

A page reads the records ``[first, end)`` of a ``Window``: by default the newest
``DEFAULT_RECORDS``; ``?end=`` (a leaf index) and ``?records=`` (at most ``MAX_RECORDS``) page
back through the whole log. The records are read ``PAGE`` lines per file read and kept by no
one: the callers fold what they need into counts as they pass. A page that wants a few record
types only names them, and lines without the type's name are skipped before they are parsed.
(The policy history reads no window: ``history.py`` keeps the places of its records.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlencode

from aiohttp import web

from broker.audit.envelope import ATTESTING, Envelope, RecordError, parse_record
from broker.audit.log import DecisionLog
from broker.audit.query import Filters
from broker.core.errors import InputError
from broker.core.records import DECISION_TYPES, RecordType

DEFAULT_RECORDS = 20_000  # a page's window when ``records`` is not given
MAX_RECORDS = 100_000  # the most records one page reads (bench/console_bench.py measures it)
PAGE = 2_000
MAX_FILTER_CHARS = 256
MAX_INDEX_DIGITS = 12
FILTERS = ("key", "image", "replica")
# what the timeline counts and the deny page lists: every decision (a KBS handshake's too)
DECIDING = DECISION_TYPES | {RecordType.KBS_AUTH}
ATTESTATIONS = frozenset(ATTESTING)  # a result issued: a runner's or a KBS guest's


@dataclass(frozen=True)
class Window:
    """The records ``[first, end)`` a page reads, of a log of ``size`` committed records."""

    first: int
    end: int
    size: int

    @property
    def count(self) -> int:
        return self.end - self.first

    @property
    def newest(self) -> bool:
        return self.end == self.size

    def older(self) -> int | None:
        """``end`` of the window before this one (None: this one starts the log)."""
        return self.first if self.first > 0 else None

    def newer(self) -> int | None:
        """``end`` of the window after this one (None: this one is the newest)."""
        return None if self.newest else min(self.size, self.end + self.count)


def window(decisions: DecisionLog, *, end: int | None, records: int) -> Window:
    """The ``records`` records before ``end`` (default: the newest) of the committed log."""
    size = decisions.committed_size
    last = size if end is None else min(end, size)
    return Window(max(0, last - records), last, size)


def window_of(
    query: Mapping[str, str],
    decisions: DecisionLog,
    *,
    default: int = DEFAULT_RECORDS,
    maximum: int = MAX_RECORDS,
) -> Window:
    """The window ``?end=&records=`` asks for (absent: the newest ``default`` records).

    Raises:
        InputError: ``end`` or ``records`` not a number, or ``records`` over ``maximum``.
    """
    end = number(query, "end")
    records = number(query, "records")
    if records is not None and not 0 < records <= maximum:
        raise InputError(f"records must be between 1 and {maximum}")
    return window(decisions, end=end, records=default if records is None else records)


def number(query: Mapping[str, str], name: str) -> int | None:
    text = query.get(name, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= MAX_INDEX_DIGITS):
        raise InputError(f"{name} must be a record count or index (digits)")
    return int(text)


def read(
    decisions: DecisionLog, span: Window, kinds: frozenset[RecordType] | None = None
) -> Iterator[Envelope]:
    """The window's records, oldest first, as envelopes (of ``kinds`` only, when given; lines
    that are not records are skipped: ``broker audit verify`` is the place that reports them).
    Blocking: iterate in a thread."""
    marks = None if kinds is None else tuple(f'"{kind.value}"'.encode() for kind in kinds)
    for start in range(span.first, span.end, PAGE):
        for line in decisions.read_lines(start, min(start + PAGE, span.end)):
            if marks is not None and not any(mark in line for mark in marks):
                continue  # cannot be one of ``kinds``: not parsed
            try:
                record = parse_record(line)
            except RecordError:
                continue
            if kinds is None or record.kind in kinds:
                yield record


def paging(request: web.Request, span: Window) -> dict[str, str | None]:
    """The links to the older, newer and newest windows, the page's other parameters kept."""
    kept = {k: v for k, v in request.query.items() if k != "end"}

    def link(end: int | None) -> str:
        query = urlencode({**kept, **({} if end is None else {"end": end})})
        return request.path + ("?" + query if query else "")

    older, newer = span.older(), span.newer()
    return {
        "older": None if older is None else link(older),
        "newer": None if newer is None else link(None if newer == span.size else newer),
        "newest": None if span.newest else link(None),
    }


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
