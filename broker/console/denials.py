"""Deny reasons, and one record.

``GET /console/denials`` counts the codes and reasons of the refused rows among the records
read (``reading.py``), filtered as the timeline is, and lists the newest of them; each links
to ``GET /console/record/{index}``: the record as written (its policy input masked as the log
holds it), its reasons, policy digest, evidence digests and identity, the commands that
reproduce it (``broker audit prove``, ``broker policy replay``), and its inclusion proof,
verified in the page (``static/record.js``) from ``GET /console/api/record/{index}`` (the
record's exact bytes) and the public proof and checkpoint routes.
"""

from __future__ import annotations

import base64
import json
import shlex
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from broker.api.services import DECISIONS, SETTINGS
from broker.audit.envelope import RecordError, parse_record
from broker.audit.log import DecisionLog
from broker.audit.outcomes import DENY
from broker.audit.query import Filters, Row, rows
from broker.console.reading import (
    DECIDING,
    Window,
    filters_of,
    paging,
    read,
    read_record,
    window_of,
)
from broker.console.templates import render
from broker.console.work import console_read
from broker.core.errors import InputError, NotFound

TOP = 20
NEWEST = 50


@dataclass
class Denials:
    span: Window
    codes: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    newest: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=NEWEST))

    def add(self, row: Row) -> None:
        record, key = row.record, row.key
        code = (record.code if key is None else key.code) or "-"
        reasons = record.reasons if key is None else key.reasons
        self.codes[code] += 1
        self.reasons.update(reasons)
        self.newest.append(
            {
                "index": record.index,
                "time": record.time,
                "type": record.type,
                "key": record.key if key is None else key.key,
                "code": code,
                "reasons": reasons,
                "image": record.identity.get("image_digest"),
            }
        )


def _read(decisions: DecisionLog, span: Window, filters: Filters) -> Denials:
    denials = Denials(span)
    for record in read(decisions, span, DECIDING):
        for row in rows(record):
            if filters.matches(row):
                denials.add(row)
    return denials


async def denials_page(request: web.Request) -> web.Response:
    """``GET /console/denials?key=&image=&replica=``."""
    problem, denials = None, None
    try:
        filters = filters_of(request, result=DENY)
        decisions = request.app[DECISIONS]
        await decisions.refresh()
        span = window_of(request.query, decisions)
    except InputError as exc:
        problem = exc.message
    else:
        denials = await console_read(request, _read, decisions, span, filters)
    return render(
        request,
        "denials.html",
        status=200 if problem is None else 400,
        title="Deny reasons",
        problem=problem,
        query=request.query,
        codes=[] if denials is None else denials.codes.most_common(TOP),
        reasons=[] if denials is None else denials.reasons.most_common(TOP),
        rows=[] if denials is None else list(reversed(denials.newest)),
        span=None if denials is None else denials.span,
        links=None if denials is None else paging(request, denials.span),
        intervals=None,
    )


def _index(request: web.Request) -> int:
    text = request.match_info["index"]  # the route allows digits only
    if len(text) > 12:
        raise NotFound("no such record")
    return int(text)


async def _line(request: web.Request) -> tuple[int, bytes]:
    index = _index(request)
    decisions = request.app[DECISIONS]
    await decisions.refresh()
    line = await console_read(request, read_record, decisions, index)
    if line is None:
        raise NotFound(f"no record {index} in this replica's log ({decisions.committed_size})")
    return index, line


async def record_data(request: web.Request) -> web.Response:
    """``GET /console/api/record/{index}``: the record's bytes as stored (base64), which the
    page hashes into the leaf it proves."""
    index, line = await _line(request)
    return web.json_response({"index": index, "line": base64.b64encode(line).decode()})


async def record_page(request: web.Request) -> web.Response:
    """``GET /console/record/{index}``."""
    index, line = await _line(request)
    try:
        record = parse_record(line)
    except RecordError:
        record = None
    log = str(request.app[SETTINGS].audit.log)
    body = {} if record is None else dict(record.body)
    replay = ["broker", "policy", "replay", "--log", log, "--policy", "policies"]
    if record is not None and record.key is not None:
        replay += ["--key", record.key]
    if record is not None and record.time is not None:
        replay += ["--since", record.time]
    decided = () if record is None or record.kind not in DECIDING else record.decisions
    return render(
        request,
        "record.html",
        title=f"Record {index}",
        index=index,
        record=record,
        decided=decided,
        identity=None if record is None else dict(record.identity),  # tojson: a plain dict
        evidence=body.get("evidence_digests"),
        text=json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False),
        prove=shlex.join(["broker", "audit", "prove", str(index), "--log", log]),
        replay=shlex.join(replay),
        origin=request.app[SETTINGS].audit.origin,
    )
