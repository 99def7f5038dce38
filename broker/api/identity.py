"""Workload identity API (issue 32): ``POST /v1/identity`` (an X.509-SVID on an attestation
result) and ``GET /v1/identity/bundle`` (the trust domain's SPIFFE bundle). Thin handlers: the
decision is the identity plan's (``decisions/identity.py``), run by the kernel."""

from __future__ import annotations

from aiohttp import web

from broker.api.body import read_json_object
from broker.api.middleware import REQUEST_ID
from broker.api.runner import CHALLENGES, naming_the_log
from broker.api.services import ATTESTATIONS, CLOCK, KERNEL, SETTINGS
from broker.core.errors import BrokerError, InputError
from broker.decisions.attested_request import Presented
from broker.decisions.identity import IDENTITY_FIELDS, describe

PEM_MEDIA_TYPE = "application/x-pem-file"


async def issue(request: web.Request) -> web.Response:
    """``Authorization: DPoP <EAR>`` + ``DPoP`` proof + ``{"csr": …}`` → the SVID chain. Every
    answer, refusals included, carries a fresh ``DPoP-Nonce`` for the next proof."""
    plan = request.app[ATTESTATIONS].require_identity()
    clock = request.app[CLOCK]
    try:
        body = await read_json_object(request, required=IDENTITY_FIELDS)
        hosts = request.headers.getall("Host", [])
        presented = Presented(  # htu is compared with [server] public_urls, never with Host
            authorization=request.headers.get("Authorization"),
            proof=request.headers.get("DPoP"),
            host=",".join(hosts) if hosts else None,
        )
        with naming_the_log(request):
            issued = await request.app[KERNEL].run(
                plan, (body, presented), now=clock(), request_id=request[REQUEST_ID]
            )
    except BrokerError as exc:
        exc.headers["DPoP-Nonce"] = plan.server_nonce(clock())
        challenge = CHALLENGES.get(exc.code)
        if challenge is not None:
            exc.headers["WWW-Authenticate"] = f'DPoP algs="ES256", error="{challenge}"'
        raise
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
