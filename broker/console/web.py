"""The console's routes, each declaring who may call it, and the headers of every answer.

``install(app)`` (called by ``create_app``) registers the table below, the static files, the
security headers and the start-up that reads the templates and the session key. Every route
answers 404 on a broker where no token holds the ``auditor`` role. ``AUDITOR`` routes need a
console session (``auth.py``); ``PUBLIC`` ones are the log-in page and form (rate-limited per
address like the runner routes) and the static files (libraries and our scripts: no data).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from broker.api.limits import rate_limited
from broker.api.routes import Permission
from broker.api.services import SETTINGS
from broker.console import auth, denials, health, history, keys, policy, timeline, watch
from broker.console.session import SessionKeys
from broker.console.templates import ENVIRONMENT, load_templates, render
from broker.console.work import CONSOLE_WORK, ConsoleBusy, ConsoleWork

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PREFIX = "/console"
STATIC = Path(__file__).parent / "static"
# No inline script or style anywhere; data only from this origin; never framed.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # no-referrer would make a form's Origin "null"
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


@dataclass(frozen=True)
class ConsoleRoute:
    method: str
    path: str
    handler: Handler
    permission: Permission
    page: bool = True  # without a session: to the log-in page (else 401)
    rate_limited: bool = False


async def login_page(request: web.Request) -> web.StreamResponse:
    """``GET /console/login``: the form (a logged-in auditor goes to the console)."""
    if await auth.current_session(request) is not None:
        return auth.see_other(PREFIX + "/")
    return render(request, "login.html", title="Log in", problem=None)


async def to_console(_: web.Request) -> web.StreamResponse:
    return auth.see_other(PREFIX + "/")


ROUTES: tuple[ConsoleRoute, ...] = (
    ConsoleRoute("GET", PREFIX, to_console, Permission.PUBLIC),
    ConsoleRoute("GET", PREFIX + "/login", login_page, Permission.PUBLIC),
    ConsoleRoute("POST", PREFIX + "/login", auth.login, Permission.PUBLIC, rate_limited=True),
    ConsoleRoute("POST", PREFIX + "/logout", auth.logout, Permission.AUDITOR),
    ConsoleRoute("GET", PREFIX + "/", health.health_page, Permission.AUDITOR),
    ConsoleRoute("GET", PREFIX + "/timeline", timeline.timeline_page, Permission.AUDITOR),
    ConsoleRoute(
        "GET", PREFIX + "/api/timeline", timeline.timeline_data, Permission.AUDITOR, page=False
    ),
    ConsoleRoute("GET", PREFIX + "/denials", denials.denials_page, Permission.AUDITOR),
    ConsoleRoute("GET", PREFIX + "/record/{index:[0-9]+}", denials.record_page, Permission.AUDITOR),
    ConsoleRoute("GET", PREFIX + "/keys", keys.keys_page, Permission.AUDITOR),
    ConsoleRoute("GET", PREFIX + "/policy", policy.history_page, Permission.AUDITOR),
    ConsoleRoute("POST", PREFIX + "/policy/compare", policy.compare, Permission.AUDITOR),
    ConsoleRoute("GET", PREFIX + "/watch", watch.watch_page, Permission.AUDITOR),
    ConsoleRoute(
        "GET",
        PREFIX + "/api/record/{index:[0-9]+}",
        denials.record_data,
        Permission.AUDITOR,
        page=False,
    ),
)


def install(app: web.Application) -> None:
    """The console's routes, static files, headers and start-up, on the broker's app."""
    server = app[SETTINGS].server
    for route in ROUTES:
        if route.permission not in (Permission.PUBLIC, Permission.AUDITOR):
            raise TypeError(f"console route {route.path} declares no console permission")
        handler = route.handler
        if route.page:
            handler = _busy_page(handler)
        if route.permission is Permission.AUDITOR:
            handler = auth.require_session(handler, page=route.page)
        if route.rate_limited:
            handler = rate_limited(handler, server.rate_limit_per_ip, server.rate_limit_burst)
        app.router.add_route(route.method, route.path, auth.require_enabled(handler))
    app.router.add_get(PREFIX + "/static/{name:[A-Za-z0-9._-]+}", auth.require_enabled(static))
    app.on_response_prepare.append(_security_headers)
    app.cleanup_ctx.append(_start)


def _busy_page(handler: Handler) -> Handler:
    """A page whose reads found the console busy (``work.py``): the problem page, 503 (a data
    route's ``ConsoleBusy`` is the JSON error, as every error of the API)."""

    async def page(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ConsoleBusy as exc:
            response = render(
                request, "problem.html", status=503, title="Busy", problem=exc.message
            )
            response.headers.update(exc.headers)
            return response

    return page


async def static(request: web.Request) -> web.StreamResponse:
    """``GET /console/static/{name}``: a file of ``static/`` (no directories, no listing)."""
    path = STATIC / request.match_info["name"]
    if path.suffix not in CONTENT_TYPES or not await asyncio.to_thread(path.is_file):
        raise web.HTTPNotFound(reason="no such file")
    body = await asyncio.to_thread(path.read_bytes)
    response = web.Response(body=body, content_type=CONTENT_TYPES[path.suffix], charset="utf-8")
    response.headers["Cache-Control"] = "no-cache"
    return response


CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css"}


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer under ``/console`` (pages, data, errors, static files)."""
    if request.path != PREFIX and not request.path.startswith(PREFIX + "/"):
        return
    response.headers.update(HEADERS)
    if "Cache-Control" not in response.headers:
        response.headers["Cache-Control"] = "no-store"


async def _start(app: web.Application) -> AsyncIterator[None]:
    """The templates and the session key (files: in a thread), the comparison lock, the
    policy history's index, the console's threads (closed at the end)."""
    app[ENVIRONMENT] = await asyncio.to_thread(load_templates)
    app[auth.SESSION_KEYS] = await asyncio.to_thread(SessionKeys.beside, app[SETTINGS].audit.log)
    app[policy.COMPARING] = asyncio.Lock()  # one candidate compared at a time per worker
    app[history.HISTORY_INDEX] = history.HistoryIndex()  # found at the first visit
    app[CONSOLE_WORK] = ConsoleWork()
    yield
    app[CONSOLE_WORK].close()
