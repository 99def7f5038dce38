"""The timeline: decisions per interval by result, and the policy's changes on the same axis.

``GET /console/timeline`` renders the filter form, the totals and the policy markers;
``GET /console/api/timeline`` answers the same selection as JSON for the chart
(``static/timeline.js``, uPlot). Rows are what ``broker audit query`` lists (a release on a
result: one row per key) with its filters; markers are the ``policy_change`` and
``policy_reload_failed`` records of the same records read (filtered by replica only: a policy
is not a key's or an image's).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from broker.api.services import DECISIONS
from broker.audit.envelope import Envelope
from broker.audit.log import DecisionLog
from broker.audit.outcomes import RESULTS
from broker.audit.query import Filters, rows
from broker.console.reading import DECIDING, Window, filters_of, paging, read, window_of
from broker.console.templates import render
from broker.console.work import console_read
from broker.core.errors import InputError
from broker.core.records import RecordType

INTERVALS = (60, 300, 900, 3600, 6 * 3600, 86400)  # seconds
MAX_BUCKETS = 200
MARKERS = frozenset({RecordType.POLICY_CHANGE, RecordType.POLICY_RELOAD_FAILED})


@dataclass
class Timeline:
    """Decisions per interval and the policy markers of the records read."""

    span: Window
    interval: int | None  # None: chosen from the span
    points: list[tuple[int, str]] = field(default_factory=list)  # (epoch second, result)
    markers: list[dict[str, Any]] = field(default_factory=list)
    totals: Counter[str] = field(default_factory=Counter)

    def add(self, record: Envelope, filters: Filters) -> None:
        if record.at is None:
            return
        when = int(record.at.timestamp())
        if record.kind in MARKERS and filters.replica in (None, record.replica):
            self.markers.append(_marker(record, when))
        if record.kind not in DECIDING:
            return
        for row in rows(record):
            if filters.matches(row) and row.result in RESULTS:
                self.points.append((when, row.result))
                self.totals[row.result] += 1

    def chosen_interval(self) -> int:
        if self.interval is not None:
            return self.interval
        times = [t for t, _ in self.points] + [m["t"] for m in self.markers]
        span = max(times) - min(times) if times else 0
        return next((i for i in INTERVALS if span / i <= MAX_BUCKETS), INTERVALS[-1])

    def as_json(self) -> dict[str, Any]:
        """The chart's data: bucket starts (epoch seconds), a count per result per bucket."""
        interval = self.chosen_interval()
        buckets: dict[int, Counter[str]] = {}
        for when, result in self.points:
            buckets.setdefault(when - when % interval, Counter())[result] += 1
        marked = {m["t"] - m["t"] % interval for m in self.markers}  # on the axis too
        starts = _starts(sorted(set(buckets) | marked), interval)
        return {
            "interval": interval,
            "x": starts,
            "series": {r: [buckets.get(s, Counter())[r] for s in starts] for r in RESULTS},
            "markers": self.markers,
            "scanned": {"first": self.span.first, "end": self.span.end, "size": self.span.size},
            "totals": {r: self.totals[r] for r in RESULTS},
        }


def _starts(filled: list[int], interval: int) -> list[int]:
    """Every bucket from the first to the last filled one (empty ones count 0), bounded, and an
    empty one each side (one bucket alone would give the chart a zero-width axis)."""
    if not filled:
        return []
    count = min((filled[-1] - filled[0]) // interval + 3, MAX_BUCKETS * 4)
    last = filled[-1] + interval
    return [last - (count - 1 - i) * interval for i in range(count)]


def _marker(record: Envelope, when: int) -> dict[str, Any]:
    body = record.body
    digest = body.get("new_digest") if record.kind is RecordType.POLICY_CHANGE else None
    return {
        "t": when,
        "time": record.time,
        "type": record.type,
        "index": record.index,
        "who": record.who,
        "digest": digest if isinstance(digest, str) else None,
        "revision": _text(body.get("revision")),
        "problem": _text(body.get("problem")),
    }


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def interval_of(request: web.Request) -> int | None:
    """``interval`` (seconds, one of ``INTERVALS``; absent or ``auto``: from the span).

    Raises:
        InputError: another value.
    """
    text = request.query.get("interval", "auto")
    if text == "auto":
        return None
    if not (text.isascii() and text.isdigit() and int(text) in INTERVALS):
        raise InputError(f"interval must be auto or one of {', '.join(map(str, INTERVALS))}")
    return int(text)


async def _timeline(request: web.Request) -> Timeline:
    filters, interval = filters_of(request), interval_of(request)
    decisions = request.app[DECISIONS]
    await decisions.refresh()
    span = window_of(request.query, decisions)
    return await console_read(request, _read, decisions, span, filters, interval)


def _read(decisions: DecisionLog, span: Window, filters: Filters, interval: int | None) -> Timeline:
    timeline = Timeline(span, interval)
    for record in read(decisions, span):
        timeline.add(record, filters)
    return timeline


async def timeline_data(request: web.Request) -> web.Response:
    """``GET /console/api/timeline?key=&image=&replica=&interval=``."""
    return web.json_response((await _timeline(request)).as_json())


async def timeline_page(request: web.Request) -> web.Response:
    """``GET /console/timeline``: the form, the chart's frame, totals and markers."""
    problem, data, span, links = None, None, None, None
    try:
        timeline = await _timeline(request)
    except InputError as exc:
        problem = exc.message
    else:
        data, span, links = timeline.as_json(), timeline.span, paging(request, timeline.span)
    return render(
        request,
        "timeline.html",
        status=200 if problem is None else 400,
        title="Timeline",
        problem=problem,
        query=request.query,
        data=data,
        interval_text=None if data is None else _duration(data["interval"]),
        intervals=INTERVALS,
        span=span,
        links=links,
    )


def _duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{math.floor(seconds)} s"
