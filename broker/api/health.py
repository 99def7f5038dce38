"""Health, readiness and metrics handlers."""

from __future__ import annotations

import json
import os
import time

from aiohttp import web

from broker.api.admin import check_admin
from broker.api.middleware import METRICS, REQUEST_ID
from broker.api.openapi import openapi_document
from broker.api.services import READINESS
from broker.config import ADMIN_ROLES
from broker.core.errors import ErrorCode, Unauthorized

# ``broker serve --workers N`` numbers its workers (supervisor.py); a single process is worker 0.
WORKER_INDEX = int(os.environ.get("BROKER_WORKER_INDEX", "0") or 0)


async def healthz(request: web.Request) -> web.Response:
    """The process is up and serving HTTP; ``worker`` says which worker answered."""
    return web.json_response({"status": "ok", "worker": WORKER_INDEX})


async def readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: the state the background checks left (``api/readiness.py``), so a hit
    costs no call to any store. Anyone gets ``{"status": "ready"|"degraded"|"not_ready"}``;
    a bearer token holding any admin role also gets each check, problem and warning. A
    not-ready broker answers 503 with the ``not_ready`` error (its problems to admins only).

    Raises:
        Unauthorized: an ``Authorization`` header that holds no admin role (401).
    """
    report = request.app[READINESS].report(time.monotonic())
    body: dict[str, object] = {"status": report.status}
    admin = _admin(request)
    if admin:
        body |= {
            "checks": report.checks,
            "problems": list(report.problems),
            "warnings": list(report.warnings),
            "checked_at": report.checked_at,
            "age_seconds": report.age_seconds,
        }
    if report.status != "not_ready":
        return web.json_response(body)
    message = "not ready: " + "; ".join(report.problems) if admin else "not ready"
    error: dict[str, object] = {
        "code": ErrorCode.NOT_READY.value,
        "message": message,
        "request_id": request[REQUEST_ID],
    }
    if admin:
        error["checks"] = report.checks
    return web.json_response({**body, "error": error}, status=503)


def _admin(request: web.Request) -> bool:
    """Whether the request holds an admin token (any role); without an ``Authorization``
    header it is an anonymous probe.

    Raises:
        Unauthorized: a header that holds no admin role (the admin API's one answer).
    """
    if "Authorization" not in request.headers:
        return False
    for role in sorted(ADMIN_ROLES):
        try:
            check_admin(request, role)
        except Unauthorized:
            continue
        return True
    raise Unauthorized("admin credentials are missing or wrong")


_OPENAPI = json.dumps(openapi_document(), sort_keys=True).encode()


async def openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the OpenAPI 3.1 description of every route."""
    return web.Response(body=_OPENAPI, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
