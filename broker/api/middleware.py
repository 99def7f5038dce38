"""The two middlewares: request id, and the one error renderer.

Every error leaves as ``{"error": {"code", "message", "request_id", …}}`` with the status of
its class. Exception text of dependencies and tracebacks go to the server log only.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from broker.core.errors import BrokerError, ErrorCode
from broker.core.metrics import Metrics

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
STARTED: web.RequestKey[float] = web.RequestKey("started", float)  # perf_counter at arrival
METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)

HTTP_CODES: dict[int, ErrorCode] = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.BODY_TOO_LARGE,
    415: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    429: ErrorCode.RATE_LIMITED,
}


def error_response(
    status: int, code: ErrorCode, message: str, request_id: str, **details: Any
) -> web.Response:
    body = {"error": {"code": code.value, "message": message, "request_id": request_id, **details}}
    response = web.json_response(body, status=status)
    response.headers[REQUEST_ID_HEADER] = request_id
    return response


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give each request an id, time it, and render every error the one way."""
    request_id = uuid.uuid4().hex
    request[REQUEST_ID] = request_id
    request[STARTED] = started = time.perf_counter()
    route = (
        request.match_info.route.resource.canonical
        if request.match_info.route.resource
        else "unmatched"
    )
    response = await _render_errors(request, handler, request_id)
    metrics = request.app[METRICS]
    metrics.requests.labels(route, str(response.status)).inc()
    metrics.latency.labels(route).observe(time.perf_counter() - started)
    return response


async def _render_errors(
    request: web.Request, handler: Handler, request_id: str
) -> web.StreamResponse:
    try:
        response = await handler(request)
    except BrokerError as exc:
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        log.log(
            level,
            "request %s: %s %s (%s)",
            request_id,
            exc.code.value,
            exc.message,
            exc.__cause__ or "",
        )
        rendered = error_response(exc.status, exc.code, exc.message, request_id, **exc.details)
        rendered.headers.update(exc.headers)
        return rendered
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = HTTP_CODES.get(exc.status, ErrorCode.BAD_REQUEST)
        rendered = error_response(exc.status, code, exc.reason, request_id)
        if "Retry-After" in exc.headers:
            rendered.headers["Retry-After"] = exc.headers["Retry-After"]
        return rendered
    except Exception:
        log.exception("request %s: unhandled error", request_id)
        return error_response(500, ErrorCode.INTERNAL, "internal error", request_id)
    response.headers[REQUEST_ID_HEADER] = request_id
    return response
