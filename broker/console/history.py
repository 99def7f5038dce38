"""The policy history: every ``policy_change`` and ``policy_reload_failed`` of this replica's
log, found once.

The log only grows, so the leaf indices of its policy records, once found, stay right: each
worker keeps them in memory (``HistoryIndex``: an integer per policy record, the newest
``MAX_INDEXED``), found by one pass over the log at the first visit (only lines naming the two
types are parsed) and extended by the records written since at each later one. A page then
reads just the records it lists: the newest ``SHOWN`` before ``?end=`` (a leaf index; default
the whole log), with older / newer links that page through the history itself.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from broker.audit.envelope import Envelope, RecordError, parse_record
from broker.audit.log import DecisionLog
from broker.console.reading import PAGE, number
from broker.console.work import CONSOLE_WORK
from broker.core.records import RecordType

KINDS = frozenset({RecordType.POLICY_CHANGE, RecordType.POLICY_RELOAD_FAILED})
MARKS = tuple(f'"{kind.value}"'.encode() for kind in KINDS)
MAX_INDEXED = 100_000  # policy records a worker keeps the place of (the newest)
SHOWN = 200  # policy records one page lists
PATH = "/console/policy"


@dataclass(frozen=True)
class History:
    """One page of the history: its records (newest first), where they stand, the links."""

    records: list[Envelope]
    first: int  # the position (1-based, oldest first) of the oldest record listed
    total: int  # policy records indexed
    size: int  # records of the log read
    dropped: bool  # older policy records than the indexed ones exist (no longer kept)
    links: dict[str, str | None]


class HistoryIndex:
    """The leaf indices of the log's policy records, in log order (thread-safe, blocking)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scanned = 0  # records looked at: [0, scanned)
        self._indices: list[int] = []
        self._dropped = False

    def update(self, decisions: DecisionLog) -> None:
        """Look at the records written since the last update. Blocking: a thread."""
        with self._lock:
            end = decisions.committed_size
            for start in range(self._scanned, end, PAGE):
                for offset, line in enumerate(decisions.read_lines(start, min(start + PAGE, end))):
                    if any(mark in line for mark in MARKS) and _is_policy(line):
                        self._indices.append(start + offset)
                self._scanned = min(start + PAGE, end)
                if len(self._indices) > MAX_INDEXED:
                    del self._indices[:-MAX_INDEXED]
                    self._dropped = True

    def page(self, decisions: DecisionLog, end: int | None) -> History:
        """The newest ``SHOWN`` policy records before leaf ``end`` (None: all). Blocking."""
        with self._lock:
            indices, size, dropped = list(self._indices), self._scanned, self._dropped
        stop = len(indices) if end is None else bisect_left(indices, end)
        start = max(0, stop - SHOWN)
        records = [parse_record(decisions.read_lines(i, i + 1)[0]) for i in indices[start:stop]]
        newer = min(len(indices), stop + SHOWN)
        links = {
            "older": _link(indices[start]) if start > 0 else None,
            "newer": (_link(indices[newer]) if newer < len(indices) else PATH)
            if stop < len(indices)
            else None,
            "newest": PATH if stop < len(indices) else None,
        }
        return History(records[::-1], start + 1, len(indices), size, dropped, links)


def _is_policy(line: bytes) -> bool:
    try:
        return parse_record(line).kind in KINDS
    except RecordError:
        return False  # not a record: ``broker audit verify`` says so


def _link(end: int) -> str:
    return f"{PATH}?end={end}"


HISTORY_INDEX: web.AppKey[HistoryIndex] = web.AppKey("console_history", HistoryIndex)


async def history(
    app: web.Application, decisions: DecisionLog, query: Mapping[str, str]
) -> History:
    """The page of the history ``?end=`` asks for, the index brought up to date first.

    Raises:
        InputError: ``end`` not an index.
    """
    end = number(query, "end")
    index = app[HISTORY_INDEX]
    await app[CONSOLE_WORK].run(index.update, decisions)
    return await app[CONSOLE_WORK].run(index.page, decisions, end)
