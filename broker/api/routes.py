"""The one route table. Each route declares who may call it.

* ``PUBLIC``: health, readiness and metrics (no secrets in them).
* ``RUNNER``: the runner API; no credential, because the request itself carries attestation
  evidence that is verified before anything is released.

Admin routes (issue: key custody) will declare an ``ADMIN`` role checked by one middleware;
a route without a declared permission cannot be registered.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from aiohttp import web

from broker.api import health, runner

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Permission(StrEnum):
    PUBLIC = "public"
    RUNNER = "runner"


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    permission: Permission


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", health.healthz, Permission.PUBLIC),
    Route("GET", "/readyz", health.readyz, Permission.PUBLIC),
    Route("GET", "/metrics", health.metrics, Permission.PUBLIC),
    Route("POST", "/v1/challenge", runner.challenge, Permission.RUNNER),
    Route("POST", "/v1/release", runner.release, Permission.RUNNER),
)


def register(app: web.Application) -> None:
    for route in ROUTES:
        if not isinstance(route.permission, Permission):
            raise TypeError(f"route {route.path} declares no permission")
        app.router.add_route(route.method, route.path, route.handler)
