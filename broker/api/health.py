"""Health, readiness and metrics handlers."""

from __future__ import annotations

from aiohttp import web

from broker.api.middleware import METRICS
from broker.api.state import STATE
from broker.errors import ErrorCode, UpstreamError


async def healthz(request: web.Request) -> web.Response:
    """The process is up and serving HTTP."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready once the policy, key store, KEK and decision log are loaded.

    Raises:
        UpstreamError: ``not_ready`` (503) before that.
    """
    state = request.app[STATE]
    if not state.ready:
        raise UpstreamError("the broker is starting or stopping", code=ErrorCode.NOT_READY)
    return web.json_response({"status": "ready", "checks": state.checks})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
