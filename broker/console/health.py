"""The log health page: this replica's newest signed checkpoint, the writer's state, the sink.

The server shows what it serves (size, root, age, the signature lines' names) and says nothing
is verified: ``static/health.js`` fetches the checkpoint of each log from the public API
(``/v1/log/checkpoint?origin=``: this replica's and those of the other replicas whose keys the
auditor pinned in this browser), checks its signature with the pinned key and its consistency
with the last checkpoint this browser saw, and says verified or FAILED in the page.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from broker.api.middleware import METRICS
from broker.api.services import CHECKPOINTS, CLOCK, DECISIONS, SETTINGS
from broker.audit.publisher import checkpoint_paths
from broker.console.templates import render
from broker.crypto.checkpoint import SIGNATURE_PREFIX, NoteError, parse_checkpoint

SINK_DROPPED = "broker_audit_sink_dropped_total"
SINK_SENT = "broker_audit_sink_sent_total"


@dataclass(frozen=True)
class ServedCheckpoint:
    """The newest checkpoint as this replica serves it (not verified here: the page does)."""

    size: int
    root: str  # base64, as in the note
    age_seconds: int | None  # since the file was written; None if unknown
    signers: tuple[str, ...]  # the names on its signature lines: the log's, then witnesses'


def served(note: str, age_seconds: int | None) -> ServedCheckpoint | None:
    """The checkpoint's size, root and signature names; ``None`` for a note that does not
    parse (the page then shows what the browser finds)."""
    split = note.rfind("\n\n")
    try:
        checkpoint = parse_checkpoint(note[: split + 1]) if split > 0 else None
    except NoteError:
        checkpoint = None
    if checkpoint is None:
        return None
    signers = tuple(
        line[len(SIGNATURE_PREFIX) :].partition(" ")[0]
        for line in note[split + 2 :].splitlines()
        if line.startswith(SIGNATURE_PREFIX)
    )
    root = base64.b64encode(checkpoint.root).decode()
    return ServedCheckpoint(checkpoint.size, root, age_seconds, signers)


def _modified(path: Path) -> float | None:
    with contextlib.suppress(OSError):
        return path.stat().st_mtime
    return None


async def health_page(request: web.Request) -> web.Response:
    """``GET /console/``: log health."""
    app = request.app
    settings, decisions = app[SETTINGS], app[DECISIONS]
    checkpoints = app[CHECKPOINTS]
    note = await checkpoints.current()
    checkpoint = None
    if note is not None:
        modified = await asyncio.to_thread(_modified, checkpoint_paths(decisions.path)[0])
        now = app[CLOCK]().timestamp()
        age = None if modified is None else max(0, int(now - modified))
        checkpoint = served(note, age)
    metrics = app[METRICS]
    sent, dropped = await asyncio.gather(
        asyncio.to_thread(metrics.value, SINK_SENT), asyncio.to_thread(metrics.value, SINK_DROPPED)
    )
    await decisions.refresh()
    return render(
        request,
        "health.html",
        title="Log health",
        origin=settings.audit.origin,
        replica=settings.server.replica_id,
        verifier_key=checkpoints.verifier_key(),
        checkpoint=checkpoint,
        committed=decisions.committed_size,
        refusing=decisions.refusing,
        sink=None if settings.audit.sink is None else settings.audit.sink.split(":", 1)[0],
        sink_sent=int(sent),
        sink_dropped=int(dropped),
        witnesses=len(settings.audit.witnesses),
    )
