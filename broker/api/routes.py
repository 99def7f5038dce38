"""The one route table. Each route declares who may call it.

* ``PUBLIC``: health, readiness, metrics, the OpenAPI description, query keys' public halves,
  and the log's verifier key, checkpoints and proofs (no secrets in them: hashes only).
* ``RUNNER``: the runner API; no credential, because the request itself carries attestation
  evidence that is verified before anything is released.
* ``KEY_ADMIN``, ``POLICY_ADMIN`` (and ``AUDITOR``): admin roles; ``register`` wraps every such
  handler in the bearer-token check for that role, so an admin route cannot be reached without
  credentials that hold it. A route without a declared permission cannot be registered.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from aiohttp import web

from broker.api import admin, health, identity, log, query, runner, self_attestation
from broker.api.limits import rate_limited
from broker.config import ServerSettings

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Permission(StrEnum):
    PUBLIC = "public"
    RUNNER = "runner"
    KEY_ADMIN = "key-admin"
    POLICY_ADMIN = "policy-admin"
    AUDITOR = "auditor"


ADMIN_PERMISSIONS = frozenset({Permission.KEY_ADMIN, Permission.POLICY_ADMIN, Permission.AUDITOR})


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    permission: Permission
    rate_limited: bool = False  # per client address ([server] rate_limit_per_ip)
    probe_limited: bool = False  # per client address ([server] readyz_rate_per_ip)


ROUTES: tuple[Route, ...] = (
    Route("GET", "/healthz", health.healthz, Permission.PUBLIC),
    Route("GET", "/readyz", health.readyz, Permission.PUBLIC, probe_limited=True),
    Route("GET", "/metrics", health.metrics, Permission.PUBLIC),
    Route("GET", "/openapi.json", health.openapi, Permission.PUBLIC),
    Route("POST", "/v1/challenge", runner.challenge, Permission.RUNNER, rate_limited=True),
    Route("POST", "/v1/release", runner.release, Permission.RUNNER, rate_limited=True),
    Route("POST", "/v1/attest", runner.attest, Permission.RUNNER, rate_limited=True),
    Route("GET", "/.well-known/jwks.json", runner.result_keys, Permission.PUBLIC),
    Route("POST", "/v1/identity", identity.issue, Permission.RUNNER, rate_limited=True),
    Route("GET", "/v1/identity/bundle", identity.bundle, Permission.PUBLIC),
    Route(  # the broker's own attestation (docs/api.md): cached, per address like /readyz
        "GET",
        "/.well-known/broker-attestation",
        self_attestation.broker_attestation,
        Permission.PUBLIC,
        probe_limited=True,
    ),
    Route(
        "GET",
        "/v1/attestations/{jti:[0-9a-f-]+}",
        runner.attestation_status,
        Permission.PUBLIC,
        rate_limited=True,
    ),
    Route(
        "GET", "/v1/keys/{name:[a-z0-9][a-z0-9._/-]*}/public", query.public_key, Permission.PUBLIC
    ),
    Route("GET", "/v1/statement-keys", query.statement_keys, Permission.PUBLIC),
    Route("GET", "/v1/admin/keys", admin.list_keys, Permission.KEY_ADMIN),
    Route("POST", "/v1/admin/keys", admin.create_key, Permission.KEY_ADMIN),
    Route("POST", "/v1/admin/keys/rotate", admin.rotate_key, Permission.KEY_ADMIN),
    Route("POST", "/v1/admin/keys/import", admin.import_key, Permission.KEY_ADMIN),
    Route("POST", "/v1/admin/keys/disable", admin.disable_version, Permission.KEY_ADMIN),
    Route("POST", "/v1/admin/keys/enable", admin.enable_version, Permission.KEY_ADMIN),
    Route("POST", "/v1/admin/keys/destroy", admin.destroy_version, Permission.KEY_ADMIN),
    Route("POST", "/v1/admin/policy/reload", admin.reload_policy, Permission.POLICY_ADMIN),
    Route(
        "POST",
        "/v1/admin/attestations/{jti:[0-9a-f-]+}/revoke",
        admin.revoke_attestation,
        Permission.KEY_ADMIN,
    ),
    # Hashes only: public (a runner proves its own decision, monitors need no credential).
    Route("GET", "/v1/log/key", log.key, Permission.PUBLIC, rate_limited=True),
    Route("GET", "/v1/log/checkpoint", log.checkpoint, Permission.PUBLIC, rate_limited=True),
    Route("GET", "/v1/log/proof/inclusion", log.inclusion, Permission.PUBLIC, rate_limited=True),
    Route(
        "GET", "/v1/log/proof/consistency", log.consistency, Permission.PUBLIC, rate_limited=True
    ),
    Route("GET", "/v1/log/entries", log.entries, Permission.AUDITOR),  # the records themselves
)


def register(app: web.Application, settings: ServerSettings) -> None:
    for route in ROUTES:
        if not isinstance(route.permission, Permission):
            raise TypeError(f"route {route.path} declares no permission")
        handler = route.handler
        if route.permission in ADMIN_PERMISSIONS:
            handler = admin.require_role(handler, route.permission.value)
        if route.rate_limited:
            handler = rate_limited(handler, settings.rate_limit_per_ip, settings.rate_limit_burst)
        if route.probe_limited:
            handler = rate_limited(handler, settings.readyz_rate_per_ip, settings.readyz_burst)
        app.router.add_route(route.method, route.path, handler)
