"""Workload identity API (issue 32): ``POST /v1/identity`` (an X.509-SVID on an attestation
result) and ``GET /v1/identity/bundle`` (the trust domain's SPIFFE bundle). Thin handlers: the
decision is the identity plan's (``decisions/identity.py``), run by the kernel."""

from __future__ import annotations

from aiohttp import web

from broker.api.runner import on_result
from broker.api.services import ATTESTATIONS, CLOCK, SETTINGS
from broker.core.errors import InputError
from broker.decisions.identity import IDENTITY_FIELDS, describe

PEM_MEDIA_TYPE = "application/x-pem-file"


async def issue(request: web.Request) -> web.Response:
    """``Authorization: DPoP <EAR>`` + ``DPoP`` proof + ``{"csr": …}`` → the SVID chain. Every
    answer, refusals included, carries a fresh ``DPoP-Nonce`` for the next proof."""
    plan = request.app[ATTESTATIONS].require_identity()
    clock = request.app[CLOCK]
    issued = await on_result(request, plan, plan.server_nonce, required=IDENTITY_FIELDS)
    return web.json_response(
        describe(issued) | {"log_origin": request.app[SETTINGS].audit.origin},
        status=201,
        headers={"DPoP-Nonce": plan.server_nonce(clock()), "Cache-Control": "no-store"},
    )


async def bundle(request: web.Request) -> web.Response:
    """The SPIFFE bundle: JWKS (``x509-svid`` keys with ``x5c``), or ``?format=pem``."""
    plan = request.app[ATTESTATIONS].require_identity()
    now = request.app[CLOCK]()
    form = request.query.get("format", "jwks")
    headers = {"Cache-Control": "max-age=60"}
    if form == "pem":
        return web.Response(
            text=plan.ca.bundle_pem(now), content_type=PEM_MEDIA_TYPE, headers=headers
        )
    if form != "jwks":
        raise InputError("format must be jwks or pem")
    return web.json_response(plan.ca.bundle(now), headers=headers)
