"""Health, readiness and metrics handlers."""

from __future__ import annotations

import json
import os

from aiohttp import web

from broker.api.middleware import METRICS
from broker.api.openapi import openapi_document
from broker.api.services import READINESS

# ``broker serve --workers N`` numbers its workers (supervisor.py); a single process is worker 0.
WORKER_INDEX = int(os.environ.get("BROKER_WORKER_INDEX", "0") or 0)


async def healthz(request: web.Request) -> web.Response:
    """The process is up and serving HTTP; ``worker`` says which worker answered."""
    return web.json_response({"status": "ok", "worker": WORKER_INDEX})


async def readyz(request: web.Request) -> web.Response:
    """Live readiness: policy digest, key store reachable, decision log size now, and every
    declared feature able to work (query keys need ``[keys] signing_key`` for their statements).

    Raises:
        UpstreamError: ``not_ready`` (503) naming each service that does not answer.
    """
    return web.json_response({"status": "ready", "checks": await request.app[READINESS].report()})


_OPENAPI = json.dumps(openapi_document(), sort_keys=True).encode()


async def openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the OpenAPI 3.1 description of every route."""
    return web.Response(body=_OPENAPI, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
