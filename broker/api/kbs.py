"""The KBS protocol facade's HTTP side (docs/kbs.md): ``POST /kbs/v0/auth``, ``POST
/kbs/v0/attest``, ``GET /kbs/v0/resource/<repository>/<type>/<tag>`` for Confidential Containers
guests, registered only when ``[kbs] enabled``.

Thin handlers: what arrived (the body's bytes, or why they could not be read; the session
cookie; ``Authorization``; the path) goes whole into the decision kernel, so that every request
that reached a handler, malformed JSON included, leaves one record. The wire is Trustee's, not
this broker's API (no OpenAPI, no ``{"error": …}``): every non-200 answer is kbs-types'
``ErrorInformation`` with the status the guest acts on (``kbs_status``): 401 makes it run the
handshake again, 404 is "not found", anything else is fatal to it. A policy deny is ``[kbs]
deny_status`` (403 by default, docs/decisions.md). Its type is the Trustee error a guest's
tooling knows (``error_name``); the broker's stable code is in ``Broker-Error-Code``, and
``X-Request-Id`` and, once logged, ``Broker-Log-Origin`` and ``Broker-Log-Index`` say where
the record is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from broker.api.body import read_body
from broker.api.limits import rate_limited
from broker.api.middleware import REQUEST_ID, REQUEST_ID_HEADER
from broker.api.routes import Permission, Route
from broker.api.services import CLOCK, KERNEL, SETTINGS
from broker.config import Settings
from broker.core.errors import (
    BrokerError,
    ErrorCode,
    NotFound,
    PolicyDenied,
    UnsupportedMediaType,
)
from broker.decisions.kbs_attest import KbsAttestPlan
from broker.decisions.kbs_auth import KbsAuthPlan
from broker.decisions.kbs_request import KbsArrival
from broker.decisions.kbs_resource import KbsResourcePlan
from broker.decisions.kbs_session import COOKIE_NAME
from broker.decisions.kernel import Plan
from broker.kbs.wire import KBS_PREFIX, error_body

Answer = TypeVar("Answer")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PREFIX = KBS_PREFIX
ERROR_CODE_HEADER = "Broker-Error-Code"  # the refusal's stable code (docs/api.md)
# a refusal at /resource that means "there is no such resource here" (the guest stops asking)
NOT_FOUND = frozenset(
    {ErrorCode.KBS_RESOURCE_NOT_FOUND, ErrorCode.KEY_UNKNOWN, ErrorCode.KEY_VERSION_UNAVAILABLE}
)


@dataclass(frozen=True)
class KbsFacade:
    """The three plans and how their answers are shaped."""

    auth: KbsAuthPlan
    attest: KbsAttestPlan
    resource: KbsResourcePlan
    deny_status: int  # [kbs] deny_status
    secure_cookie: bool  # served over TLS: the cookie is Secure

    @property
    def development_note(self) -> str:
        """What /readyz says of it beside "on": whether unsigned sample evidence is accepted."""
        sample = "sample" in self.auth.verifiers
        return " (sample evidence accepted: DEVELOPMENT ONLY)" if sample else ""


KBS: web.AppKey[KbsFacade] = web.AppKey("kbs", KbsFacade)


def kbs_status(error: BrokerError, *, resource: bool, deny_status: int) -> int:
    """The status the guest acts on: a policy deny ``deny_status``; an upstream failure, a bug
    or a rate limit as they are (fatal to the guest); not found 404 (at ``/resource`` a missing
    or disabled key version too); any other refusal 401 (as Trustee answers it: the guest runs
    the handshake again)."""
    if isinstance(error, PolicyDenied):
        return deny_status
    if error.status >= 500 or error.status == 429:
        return error.status
    if error.status == 404 or (resource and error.code in NOT_FOUND):
        return 404
    return 401


# Trustee's names (kbs/src/error.rs variants) for what went wrong at /resource; at /auth and
# /attest every refusal is its AttestationError, as Trustee names them
NO_TOKEN = frozenset(
    {
        ErrorCode.KBS_TOKEN_MISSING,
        ErrorCode.KBS_SESSION_INVALID,
        ErrorCode.KBS_SESSION_EXPIRED,
        ErrorCode.KBS_SESSION_NOT_ATTESTED,
    }
)
SEALING = frozenset(
    {
        ErrorCode.TEE_PUBKEY_INVALID,
        ErrorCode.TEE_PUBKEY_UNSUPPORTED,
        ErrorCode.KBS_HEADER_MEMBER_INVALID,
    }
)


def error_name(error: BrokerError, *, resource: bool, status: int) -> str:
    """The ``ErrorInformation`` type's last part: the Trustee error a guest's tooling knows for
    this refusal (the broker's own stable code is in ``Broker-Error-Code``)."""
    if not resource:
        return "AttestationError"
    names = (
        (isinstance(error, PolicyDenied), "PolicyDeny"),
        (status == 404, "InvalidRequestPath"),
        (error.code in NO_TOKEN, "TokenNotFound"),
        (error.code in SEALING, "JweError"),
        (error.status == 401, "TokenVerifierError"),  # the token, or its attestation, refused
    )
    return next((name for matched, name in names if matched), "PluginInternalError")


async def auth(request: web.Request) -> web.StreamResponse:
    facade = request.app[KBS]
    shake = await _run(request, facade.auth, await _arrival(request, body=True))
    response = web.json_response(shake.challenge, headers=_logged(request, shake.log_index))
    _set_cookie(response, facade, shake.cookie, shake.max_age)
    return response


async def attest(request: web.Request) -> web.StreamResponse:
    facade = request.app[KBS]
    arrival = await _arrival(request, body=True)
    attested = await _run(request, facade.attest, arrival)
    return web.json_response(
        {"token": attested.token}, headers=_logged(request, attested.log_index)
    )


async def resource(request: web.Request) -> web.StreamResponse:
    facade = request.app[KBS]
    released = await _run(request, facade.resource, await _arrival(request, body=False))
    return web.json_response(released.jwe, headers=_logged(request, released.log_index))


async def not_found(request: web.Request) -> web.StreamResponse:
    """Any other path or method under ``/kbs/v0`` (nothing to decide: no record)."""
    raise NotFound(f"no KBS endpoint {request.method} {request.path[:80]} here")


async def _arrival(request: web.Request, *, body: bool) -> KbsArrival:
    """What arrived, unread parts as the reason they could not be read (the plan refuses them,
    on the record)."""
    headers = KbsArrival(
        cookie=request.cookies.get(COOKIE_NAME),
        authorization=request.headers.get("Authorization"),
        path=request.match_info.get("path"),
        query=request.query_string,
    )
    if not body:
        return headers
    if request.content_type != "application/json":
        refused = UnsupportedMediaType("Content-Type must be application/json")
        return dataclasses.replace(headers, unreadable=refused)
    server = request.app[SETTINGS].server
    try:
        raw = await read_body(
            request, max_bytes=server.max_body_bytes, timeout_seconds=server.body_timeout_seconds
        )
    except BrokerError as exc:
        return dataclasses.replace(headers, unreadable=exc)
    return dataclasses.replace(headers, body=raw)


async def _run(
    request: web.Request, plan: Plan[KbsArrival, Any, Any, Answer], arrival: KbsArrival
) -> Answer:
    return await request.app[KERNEL].run(
        plan, arrival, now=request.app[CLOCK](), request_id=request[REQUEST_ID]
    )


def _logged(request: web.Request, index: int) -> dict[str, str]:
    return {
        "Broker-Log-Origin": request.app[SETTINGS].audit.origin,
        "Broker-Log-Index": str(index),
        "Cache-Control": "no-store",
    }


def _set_cookie(response: web.Response, facade: KbsFacade, cookie: str, max_age: int) -> None:
    response.set_cookie(
        COOKIE_NAME,
        cookie,
        max_age=max_age,
        # no Path (as Trustee): the guest's cookie store then scopes it to the directory of the
        # /auth URL it called, which behind a proxy's path prefix is not /kbs/v0 (an empty value
        # is left out of the header)
        path="",
        httponly=True,
        secure=facade.secure_cookie,
        samesite="Strict",
    )


def kbs_shaped(handler: Handler, *, resource: bool) -> Handler:
    """``handler``'s refusals, and aiohttp's (a rate limit), as ``ErrorInformation``."""

    @functools.wraps(handler)
    async def shaped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except BrokerError as exc:
            return _refusal(request, exc, resource=resource)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = ErrorCode.RATE_LIMITED if exc.status == 429 else ErrorCode.BAD_REQUEST
            error = BrokerError(exc.reason, code=code)
            error.status = exc.status
            rendered = _refusal(request, error, resource=resource)
            if "Retry-After" in exc.headers:
                rendered.headers["Retry-After"] = exc.headers["Retry-After"]
            return rendered

    return shaped


def _refusal(request: web.Request, error: BrokerError, *, resource: bool) -> web.Response:
    facade = request.app.get(KBS)
    deny_status = facade.deny_status if facade is not None else 403
    detail = error.message
    reasons = error.details.get("reasons")
    if isinstance(error, PolicyDenied) and reasons:
        detail = f"{detail}: {'; '.join(str(r) for r in reasons)}"
    status = kbs_status(error, resource=resource, deny_status=deny_status)
    response = web.Response(
        status=status,
        body=error_body(error_name(error, resource=resource, status=status), detail),
        content_type="application/json",
    )
    response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]
    response.headers[ERROR_CODE_HEADER] = error.code.value
    if "log_index" in error.details:
        response.headers.update(_logged(request, int(error.details["log_index"])))
    response.headers.update(error.headers)
    return response


KBS_ROUTES: tuple[Route, ...] = (
    Route("POST", f"{PREFIX}/auth", auth, Permission.RUNNER, rate_limited=True),
    Route("POST", f"{PREFIX}/attest", attest, Permission.RUNNER, rate_limited=True),
    Route("GET", PREFIX + "/resource/{path:.*}", resource, Permission.RUNNER, rate_limited=True),
    Route("*", PREFIX + "/{tail:.*}", not_found, Permission.PUBLIC, rate_limited=True),
)


def register_kbs(app: web.Application, settings: Settings) -> None:
    """The facade's routes (``KBS_ROUTES``), when ``[kbs] enabled``: rate-limited per address as
    the runner routes are, ``/auth`` also by ``[kbs] auth_rate_per_ip`` (each handshake is a
    record: docs/kbs.md, "Records"), every refusal (the rate limits' too) as
    ``ErrorInformation``. Any
    other path or method under ``/kbs/v0`` is a 404 of that shape. The guest's credentials are
    its evidence, session and token, checked in the plans: no route needs an admin role."""
    if not settings.kbs.enabled:
        return
    server, kbs = settings.server, settings.kbs
    for route in KBS_ROUTES:
        if route.permission not in (Permission.RUNNER, Permission.PUBLIC):
            raise TypeError(f"route {route.path}: the KBS facade has no admin routes")
        handler = route.handler
        if route.handler is auth:  # unauthenticated, and every handshake is a record
            handler = rate_limited(handler, kbs.auth_rate_per_ip, kbs.auth_rate_burst)
        if route.rate_limited:
            handler = rate_limited(handler, server.rate_limit_per_ip, server.rate_limit_burst)
        # an unknown path is named as a path Trustee cannot serve (InvalidRequestPath, 404)
        shaped = kbs_shaped(handler, resource=route.handler in (resource, not_found))
        app.router.add_route(route.method, route.path, shaped)
