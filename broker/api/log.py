"""Read-only audit API: the log's verifier key, the latest signed checkpoint, and proofs are
public (they carry only hashes; a runner proves its own decision, a monitor follows the log
without credentials); the records themselves need the ``auditor`` role.

Proofs are over the tree as committed (every record durably written); hashes are standard
base64, as in checkpoints. A page of entries is at most ``MAX_PAGE`` records. With
``--workers N`` every answer first catches up with the records of every worker of this replica
(``DecisionLog.refresh``) and serves the replica's newest checkpoint: whichever worker answers,
the view is the same and never goes back.
"""

from __future__ import annotations

import asyncio
import base64

from aiohttp import web

from broker.api.services import CHECKPOINTS, DECISIONS
from broker.audit.log import DecisionLog
from broker.core.errors import InputError, NotFound

MAX_PAGE = 1000


async def _log(request: web.Request) -> DecisionLog:
    """This replica's log, caught up with every worker's records."""
    decisions = request.app[DECISIONS]
    await decisions.refresh()
    return decisions


def _int(request: web.Request, name: str, *, default: int | None = None) -> int:
    text = request.query.get(name)
    if text is None:
        if default is None:
            raise InputError(f"{name} is required")
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 12):
        raise InputError(f"{name} must be a non-negative integer")
    return int(text)


def _b64(hashes: list[bytes]) -> list[str]:
    return [base64.b64encode(h).decode() for h in hashes]


async def key(request: web.Request) -> web.Response:
    """``GET /v1/log/key``: the note verifier key of this log's checkpoints, and its name."""
    verifier = request.app[CHECKPOINTS].verifier_key()
    if verifier is None:
        raise NotFound("this broker signs no checkpoints ([audit] signing_key is not set)")
    return web.json_response({"name": verifier.split("+", 1)[0], "verifier_key": verifier})


async def checkpoint(request: web.Request) -> web.Response:
    """``GET /v1/log/checkpoint``: the latest signed checkpoint (a C2SP signed note)."""
    note = await request.app[CHECKPOINTS].current()
    if note is None:
        raise NotFound("this broker signs no checkpoints ([audit] signing_key is not set)")
    return web.Response(text=note, content_type="text/plain")


async def entries(request: web.Request) -> web.Response:
    """``GET /v1/log/entries?start=&end=``: records ``[start, end)`` as JSON lines."""
    decisions = await _log(request)
    size = decisions.committed_size
    start = _int(request, "start", default=0)
    end = min(_int(request, "end", default=start + MAX_PAGE), start + MAX_PAGE, size)
    if start > size:
        raise InputError(f"start is beyond the log's {size} records")
    lines = await asyncio.to_thread(decisions.read_lines, start, max(start, end))
    body = b"".join(line + b"\n" for line in lines)
    return web.Response(body=body, content_type="application/x-ndjson")


async def inclusion(request: web.Request) -> web.Response:
    """``GET /v1/log/proof/inclusion?index=I&tree_size=N``."""
    decisions = await _log(request)
    index, size = _int(request, "index"), _int(request, "tree_size")
    if not 0 <= index < size <= decisions.committed_size:
        raise InputError(
            f"need index < tree_size <= {decisions.committed_size} (the committed tree)"
        )
    proof = decisions.tree.inclusion_proof(index, size)
    return web.json_response({"index": index, "tree_size": size, "hashes": _b64(proof)})


async def consistency(request: web.Request) -> web.Response:
    """``GET /v1/log/proof/consistency?first=M&second=N``."""
    decisions = await _log(request)
    first, second = _int(request, "first"), _int(request, "second")
    if not 0 < first <= second <= decisions.committed_size:
        raise InputError(f"need 0 < first <= second <= {decisions.committed_size}")
    proof = decisions.tree.consistency_proof(first, second)
    return web.json_response({"first": first, "second": second, "hashes": _b64(proof)})
