"""Health, readiness and metrics handlers."""

from __future__ import annotations

import json
import os

from aiohttp import web

from broker.api.middleware import METRICS
from broker.api.openapi import openapi_document
from broker.api.state import STATE
from broker.core.errors import ErrorCode, UpstreamError
from broker.keys.store.base import Purpose

# ``broker serve --workers N`` numbers its workers (supervisor.py); a single process is worker 0.
WORKER_INDEX = int(os.environ.get("BROKER_WORKER_INDEX", "0") or 0)


async def healthz(request: web.Request) -> web.Response:
    """The process is up and serving HTTP; ``worker`` says which worker answered."""
    return web.json_response({"status": "ok", "worker": WORKER_INDEX})


async def readyz(request: web.Request) -> web.Response:
    """Live readiness: policy digest, key store reachable, decision log size now, and every
    declared feature able to work (query keys need ``[keys] signing_key`` for their statements).

    Raises:
        UpstreamError: ``not_ready`` (503) while starting or stopping, or naming each problem.
    """
    state = request.app[STATE]
    release = state.release
    if release is None:
        raise UpstreamError("the broker is starting or stopping", code=ErrorCode.NOT_READY)
    checks = {
        **state.checks,
        "policy": release.policy.digest,
        "audit_log": f"{release.audit.head.size} records",
    }
    reload = state.policies.last_reload if state.policies is not None else None
    if reload is not None:
        checks["policy_last_reload"] = (
            f"{'ok' if reload.ok else 'failed'} at {reload.time} ({reload.trigger})"
            + ("" if reload.ok else "; the last good policy is serving")
        )
    problems = []
    try:
        versions = await release.keys.list_versions()
    except UpstreamError:
        problems.append("the key store does not answer")
        versions = []
    try:
        await state.nonces.check()
    except UpstreamError:
        problems.append("the nonce store does not answer")
    query_keys = sorted({v.name for v in versions if v.purpose is Purpose.QUERY})
    if query_keys and state.statement_signer is None:
        problems.append(
            f"{len(query_keys)} query key(s) but no [keys] signing_key: their public halves "
            "cannot be published with a signed statement"
        )
    if problems:
        raise UpstreamError(
            "not ready: " + "; ".join(problems), code=ErrorCode.NOT_READY, checks=checks
        )
    return web.json_response({"status": "ready", "checks": checks})


_OPENAPI = json.dumps(openapi_document(), sort_keys=True).encode()


async def openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``: the OpenAPI 3.1 description of every route."""
    return web.Response(body=_OPENAPI, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")
