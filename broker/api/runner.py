"""Runner API: thin handlers (parse -> service -> render)."""

from __future__ import annotations

import base64
import time

from aiohttp import web

from broker.api.body import read_json_object
from broker.api.middleware import REQUEST_ID, STARTED
from broker.api.services import ATTESTATIONS, CLOCK, NONCES, RELEASE, SETTINGS
from broker.attest import ATTEST_FIELDS
from broker.attestation.ear import MEDIA_TYPE
from broker.attestation.stored import AttestationEntry
from broker.release import RELEASE_FIELDS, RELEASE_OPTIONAL


async def challenge(request: web.Request) -> web.Response:
    """Issue a single-use nonce. The body may be empty or ``{}``."""
    if request.can_read_body:
        await read_json_object(request, required=())
    issued = await request.app[NONCES].issue(request.app[CLOCK]())
    return web.json_response(
        {
            "nonce": issued.nonce,
            "expires_at": issued.expires_at.isoformat().replace("+00:00", "Z"),
            "audience": request.app[SETTINGS].server.audience,
        }
    )


async def release(request: web.Request) -> web.Response:
    """Verify evidence, decide, log, and return the DEK wrapped to the runner key.

    Only the body's syntax is checked here; its fields are checked by the release service,
    inside the logged path, so that every parsed release request leaves a decision record.
    """
    body = await read_json_object(request, required=RELEASE_FIELDS, optional=RELEASE_OPTIONAL)
    read = time.perf_counter()
    released = await request.app[RELEASE].release(
        body, now=request.app[CLOCK](), request_id=request[REQUEST_ID]
    )
    headers = {}
    if request.app[SETTINGS].server.server_timing:  # W3C Server-Timing, in milliseconds
        # body: reading and parsing it; the service's stages; total: arrival to this answer
        # (what is left of total is the glue between stages and the hand-overs)
        stages = (("body", read - request[STARTED]), *released.stages)
        stages += (("total", time.perf_counter() - request[STARTED]),)
        headers["Server-Timing"] = ", ".join(
            f"{stage};dur={seconds * 1000:.3f}" for stage, seconds in stages
        )
    return web.json_response(
        headers=headers,
        data={
            "key": released.key,
            "version": released.version,
            "decision_id": released.decision_id,
            "wrapped_key": released.wrapped_key,
            "wrap": released.wrap,
            "algorithm": released.algorithm,
            "log_index": released.log_index,
            "leaf_hash": base64.b64encode(released.leaf_hash).decode(),
        },
    )


async def attest(request: web.Request) -> web.Response:
    """Verify evidence once and answer an attestation result (EAR) bound to the runner's keys:
    ``201``, the signed EAR as ``application/eat+jwt``, ``Location`` naming it."""
    service = request.app[ATTESTATIONS].require()
    body = await read_json_object(request, required=ATTEST_FIELDS)
    attested = await service.attest(body, now=request.app[CLOCK](), request_id=request[REQUEST_ID])
    return web.Response(
        status=201,
        body=attested.token.encode("ascii"),
        headers={
            "Content-Type": MEDIA_TYPE,
            "Location": f"/v1/attestations/{attested.jti}",
            "Cache-Control": "no-store",
        },
    )


async def result_keys(request: web.Request) -> web.Response:
    """``/.well-known/jwks.json``: the keys that verify this broker's attestation results
    (none while ``[attest]`` is off)."""
    service = request.app[ATTESTATIONS].service
    return web.json_response(service.signer.jwks() if service is not None else {"keys": []})


async def attestation_status(request: web.Request) -> web.Response:
    """``GET /v1/attestations/{jti}``: whether a result may still be used (``active``) or was
    revoked, and why; 404 once it expired."""
    service = request.app[ATTESTATIONS].require()
    entry = await service.status(request.match_info["jti"], request.app[CLOCK]())
    return web.json_response(_describe(entry))


def _describe(entry: AttestationEntry) -> dict[str, object]:
    return {
        "jti": entry.jti,
        "status": entry.status,
        "reason": entry.reason,
        "expires_at": entry.expires_at.isoformat().replace("+00:00", "Z"),
    }
