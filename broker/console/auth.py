"""Log in, log out, and the session check of every console route but the login page.

* Log-in is a POST form (``token``), so the token never appears in a URL, a history or a
  server's access log; it must hold the ``auditor`` role and no other (``[admin]``): the console
  is read-only, and a token that can change keys or policy is not typed into a browser for it.
  A wrong token and one without the role get the same page (401); a token with more roles is
  told to use an auditor-only token (401).
* The session cookie (``session.py``) is ``HttpOnly``, ``SameSite=Strict``, and over TLS
  ``Secure`` with the ``__Host-`` prefix (``Path=/``, no ``Domain``: no other site or subdomain
  can set it); over the loopback development HTTP listener it is ``console-session`` on
  ``/console``.
* Every POST must come from a page of this broker: its ``Origin`` header is this broker's own
  (the request's scheme and host, or one of ``[server] public_urls``), and ``Sec-Fetch-Site``,
  when the browser sends it, is ``same-origin``. With ``SameSite=Strict`` this refuses
  cross-site request forgery twice; a POST without ``Origin`` is refused too.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from broker.api.services import CLOCK, SETTINGS
from broker.console.session import AUDITOR, SESSION, Session, SessionKeys, auditor_only
from broker.console.templates import render
from broker.core.errors import ErrorCode, Forbidden, InputError, NotFound, Unauthorized

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION_KEYS: web.AppKey[SessionKeys] = web.AppKey("console_session_keys", SessionKeys)
SECURE_COOKIE = "__Host-console-session"
PLAIN_COOKIE = "console-session"
MAX_TOKEN_CHARS = 512
LOGIN_PATH = "/console/login"


def console_enabled(request: web.Request) -> bool:
    """The console is served while some configured token holds the ``auditor`` role."""
    admin = request.app[SETTINGS].admin
    digests = (*admin.token_sha256, *(d for d, _ in admin.tokens))
    return any(AUDITOR in admin.roles_of(d) for d in digests)


def require_enabled(handler: Handler) -> Handler:
    """404 for every console route of a broker without an auditor token."""

    async def enabled(request: web.Request) -> web.StreamResponse:
        if not console_enabled(request):
            raise NotFound("no console here: no token holds the auditor role ([admin])")
        return await handler(request)

    return enabled


def require_session(handler: Handler, *, page: bool) -> Handler:
    """Run ``handler`` for a live auditor session only: a page without one goes to the log-in
    page (303), anything else is ``401 unauthorized``. A session past half its life is
    re-issued on the response."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        session = await current_session(request)
        if session is None:
            if page:
                return see_other(LOGIN_PATH)
            raise Unauthorized("no console session: log in at /console/login")
        request[SESSION] = session
        response = await handler(request)
        now = _now(request)
        if session.due_for_renewal(now):
            _set_cookie(request, response, request.app[SESSION_KEYS].renew(session, now))
        return response

    return guarded


async def current_session(request: web.Request) -> Session | None:
    cookie = request.cookies.get(_cookie_name(request))
    if not cookie:
        return None
    keys = request.app[SESSION_KEYS]
    session = keys.open(cookie, request.app[SETTINGS].admin, _now(request))
    if session is None or await asyncio.to_thread(keys.is_revoked, session):
        return None
    return session


def check_origin(request: web.Request) -> None:
    """Refuse a POST that a page of another origin made (CSRF).

    Raises:
        Forbidden: ``origin_refused``.
    """
    origin = request.headers.get("Origin")
    site = request.headers.get("Sec-Fetch-Site")
    own = {f"{request.scheme}://{request.host}"}
    for url in request.app[SETTINGS].server.public_base_urls:
        parts = urlsplit(url)
        own.add(f"{parts.scheme}://{parts.netloc}")
    if origin is None or origin not in own or (site is not None and site != "same-origin"):
        raise Forbidden(
            "a console form is accepted only from this broker's own pages",
            code=ErrorCode.ORIGIN_REFUSED,
        )


async def login(request: web.Request) -> web.StreamResponse:
    """``POST /console/login`` (form ``token``): a session for an auditor's token."""
    check_origin(request)
    if request.content_type != "application/x-www-form-urlencoded":
        raise InputError("log in with the form of /console/login")
    form = await request.post()
    token = form.get("token")
    usable = isinstance(token, str) and 0 < len(token) <= MAX_TOKEN_CHARS and token.isascii()
    digest = hashlib.sha256(token.strip().encode() if usable else b"").hexdigest()  # type: ignore[union-attr]
    roles = request.app[SETTINGS].admin.roles_of(digest) if usable else frozenset()
    if not auditor_only(roles):
        wider = AUDITOR in roles  # an admin token: said so, it is the holder's own
        log.info("console: a log-in with a token that is not an auditor-only one")
        return render(
            request,
            "login.html",
            status=401,
            title="Log in",
            problem=f"That token holds more than the auditor role ({', '.join(sorted(roles))}): "
            "use an auditor-only token (the console is read-only)."
            if wider
            else "That is not an auditor token.",
        )
    response = see_other("/console/")
    _set_cookie(request, response, request.app[SESSION_KEYS].issue(digest, _now(request)))
    log.info("console: token:%s logged in", digest[:12])
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    """``POST /console/logout``: the session is written off (every worker), the cookie
    cleared."""
    check_origin(request)
    session = request[SESSION]
    await asyncio.to_thread(request.app[SESSION_KEYS].revoke, session, _now(request))
    response = see_other(LOGIN_PATH)
    response.del_cookie(_cookie_name(request), path=_cookie_path(request))
    log.info("console: %s logged out", session.who)
    return response


def see_other(location: str) -> web.Response:
    """A 303 to a path of this console (never a URL from the request)."""
    return web.Response(status=303, headers={"Location": location})


def _now(request: web.Request) -> int:
    return int(request.app[CLOCK]().timestamp())


def _cookie_name(request: web.Request) -> str:
    return SECURE_COOKIE if request.secure else PLAIN_COOKIE


def _cookie_path(request: web.Request) -> str:
    return "/" if request.secure else "/console"


def _set_cookie(request: web.Request, response: web.StreamResponse, value: str) -> None:
    response.set_cookie(
        _cookie_name(request),
        value,
        max_age=max(0, int(value.split(".")[4]) - _now(request)),
        path=_cookie_path(request),
        secure=request.secure,
        httponly=True,
        samesite="Strict",
    )
