"""Read-only audit API: the log's verifier key, the latest signed checkpoint, and proofs are
public (they carry only hashes; a runner proves its own decision, a monitor follows the log
without credentials); the records themselves need the ``auditor`` role.

Proofs are over the tree as committed (every record durably written); hashes are standard
base64, as in checkpoints. A page of entries is at most ``MAX_PAGE`` records. With
``--workers N`` every answer first catches up with the records of every worker of this replica
(``DecisionLog.refresh``) and serves the replica's newest checkpoint: whichever worker answers,
the view is the same and never goes back.

Each replica keeps its own log (its own origin). The public requests may name the log they are
for (``?origin=``): another replica's is forwarded to it (``log_peers.py``), so through a load
balancer every replica's log is reachable by its origin; without ``origin`` the answering
replica's own log is served.
"""

from __future__ import annotations

import asyncio
import base64

from aiohttp import web

from broker.api.log_peers import LogPeers
from broker.api.services import CHECKPOINTS, DECISIONS
from broker.audit.identity import read_handovers
from broker.audit.log import DecisionLog
from broker.core.errors import InputError, NotFound

LOG_PEERS: web.AppKey[LogPeers] = web.AppKey("log_peers", LogPeers)

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


async def _elsewhere(request: web.Request) -> web.Response | None:
    """The answer of the replica whose log the request names (``?origin=``), or ``None``
    when it names this replica's log (or none)."""
    peers = request.app[LOG_PEERS]
    replica = peers.named(request)
    return None if replica is None else await peers.forward(request, replica)


async def key(request: web.Request) -> web.Response:
    """``GET /v1/log/key[?origin=]``: the note verifier key of the log's checkpoints, its name
    (the origin), and the hand-overs that led to it from earlier keys (oldest first)."""
    if (forwarded := await _elsewhere(request)) is not None:
        return forwarded
    verifier = request.app[CHECKPOINTS].verifier_key()
    if verifier is None:
        raise NotFound("this broker signs no checkpoints ([audit] signing_key is not set)")
    handovers = await asyncio.to_thread(read_handovers, request.app[DECISIONS].path)
    return web.json_response(
        {"name": verifier.split("+", 1)[0], "verifier_key": verifier, "handovers": handovers}
    )


async def checkpoint(request: web.Request) -> web.Response:
    """``GET /v1/log/checkpoint[?origin=]``: the latest signed checkpoint (a C2SP signed note)."""
    if (forwarded := await _elsewhere(request)) is not None:
        return forwarded
    note = await request.app[CHECKPOINTS].current()
    if note is None:
        raise NotFound("this broker signs no checkpoints ([audit] signing_key is not set)")
    return web.Response(text=note, content_type="text/plain")


async def entries(request: web.Request) -> web.Response:
    """``GET /v1/log/entries?start=&end=``: records ``[start, end)`` as JSON lines (this
    replica's log only: records are read from the replica that holds them)."""
    if request.app[LOG_PEERS].named(request) is not None:
        raise NotFound("records are served by the replica whose log they are in")
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
    """``GET /v1/log/proof/inclusion?index=I&tree_size=N[&origin=]``."""
    if (forwarded := await _elsewhere(request)) is not None:
        return forwarded
    decisions = await _log(request)
    index, size = _int(request, "index"), _int(request, "tree_size")
    if not 0 <= index < size <= decisions.committed_size:
        raise InputError(
            f"need index < tree_size <= {decisions.committed_size} (the committed tree)"
        )
    proof = decisions.tree.inclusion_proof(index, size)
    return web.json_response({"index": index, "tree_size": size, "hashes": _b64(proof)})


async def consistency(request: web.Request) -> web.Response:
    """``GET /v1/log/proof/consistency?first=M&second=N[&origin=]``."""
    if (forwarded := await _elsewhere(request)) is not None:
        return forwarded
    decisions = await _log(request)
    first, second = _int(request, "first"), _int(request, "second")
    if not 0 < first <= second <= decisions.committed_size:
        raise InputError(f"need 0 < first <= second <= {decisions.committed_size}")
    proof = decisions.tree.consistency_proof(first, second)
    return web.json_response({"first": first, "second": second, "hashes": _b64(proof)})
