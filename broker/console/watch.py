"""The Watch page: the watch rules ``broker audit monitor --rules`` runs, and its newest hits.

The page evaluates nothing itself: the monitor ran the rules (``audit/watch.py``) over records
it had checked against a signed checkpoint, and left its rules, its progress and its newest hits
in its state file; ``[audit] watch_state`` names that file on this host and the page shows it,
read through the monitor's own reader (``audit/watch_state.py``). What the page cannot say is
said: no state configured, the monitor not run yet, the file unreadable. A hit on this
replica's log links to the record's page (its inclusion proof verified there).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from broker.api.services import CLOCK, SETTINGS
from broker.audit.watch_state import MAX_STATE_BYTES, WatchView, watch_member, watch_view
from broker.console.templates import render
from broker.console.work import console_read


def _read(path: Path) -> tuple[WatchView | None, str | None]:
    """The state's watch rules, or why not (blocking)."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None, f"{path} does not exist yet: broker audit monitor --rules has not run"
    except OSError as exc:
        return None, f"{path} cannot be read: {exc.strerror}"
    if len(raw) > MAX_STATE_BYTES:
        return None, f"{path} is over {MAX_STATE_BYTES} bytes: not shown"
    member = watch_member(raw)
    if not member:
        return None, f"{path} holds no watch rules: run broker audit monitor with --rules"
    return watch_view(member), None


async def watch_page(request: web.Request) -> web.Response:
    """``GET /console/watch``: the rules, each log's progress, the newest hits."""
    settings = request.app[SETTINGS]
    path = settings.audit.watch_state
    view: WatchView | None
    problem: str | None
    if path is None:
        view, problem = None, "no [audit] watch_state in this broker's configuration"
    else:
        view, problem = await console_read(request, _read, path)
    now = request.app[CLOCK]()
    age = None
    if view is not None and view.checked_at is not None:
        age = max(0, int((now - view.checked_at).total_seconds()))
    return render(
        request,
        "watch.html",
        title="Watch rules",
        view=view,
        problem=problem,
        age_seconds=age,
        origin=settings.audit.origin,
    )
