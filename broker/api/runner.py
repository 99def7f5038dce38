"""Runner API: thin handlers (parse -> service -> render)."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, TypeVar

from aiohttp import web

from broker.api.admin import check_admin
from broker.api.body import read_json_object
from broker.api.middleware import REQUEST_ID, STARTED
from broker.api.services import ATTESTATIONS, CLOCK, KERNEL, NONCES, RELEASE, SETTINGS
from broker.attestation.ear import MEDIA_TYPE
from broker.attestation.stored import AttestationEntry
from broker.core.errors import BrokerError, ErrorCode, Unauthorized
from broker.decisions.attest import ATTEST_FIELDS
from broker.decisions.attested_release import TIMED_STAGES, AttestedRelease, ReleasedOnResult
from broker.decisions.attested_request import (
    ATTESTED_FIELDS,
    ATTESTED_OPTIONAL,
    Presented,
    Unverified,
)
from broker.decisions.kernel import Plan
from broker.decisions.release import RELEASE_FIELDS, RELEASE_OPTIONAL

Answer = TypeVar("Answer")


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

    Only the body's syntax is checked here; its fields are checked by the release plan, inside
    the logged path (the decision kernel), so that every parsed release request leaves a
    decision record.
    With ``Authorization: DPoP <EAR>`` the keys are released on an attestation result instead
    (``attested_release``); a request with any other ``Authorization`` is a full-evidence
    release as it always was.
    """
    scheme = request.headers.get("Authorization", "").partition(" ")[0]
    if scheme.lower() == "dpop":  # another scheme changes nothing: full evidence, as before
        return await _release_on_result(request)
    body = await read_json_object(request, required=RELEASE_FIELDS, optional=RELEASE_OPTIONAL)
    read = time.perf_counter()
    plan = request.app[RELEASE]
    with naming_the_log(request):
        released = await request.app[KERNEL].run(
            plan, body, now=request.app[CLOCK](), request_id=request[REQUEST_ID]
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
            "log_origin": request.app[SETTINGS].audit.origin,
        },
    )


@contextlib.contextmanager
def naming_the_log(request: web.Request) -> Iterator[None]:
    """A refusal that was logged names the log (origin) beside its index: each replica keeps
    its own log, and the index alone does not say which."""
    try:
        yield
    except BrokerError as exc:
        if "log_index" in exc.details:
            exc.details["log_origin"] = request.app[SETTINGS].audit.origin
        raise


async def _release_on_result(request: web.Request) -> web.Response:
    """``Authorization: DPoP <EAR>`` + ``DPoP`` proof + ``{"keys": […]}``. Every answer, refusals
    included, carries a fresh ``DPoP-Nonce`` for the next proof; a refused result or proof says
    so in ``WWW-Authenticate`` (RFC 9449 §7.1, RFC 6750 §3)."""
    plan = request.app[ATTESTATIONS].require_releases()
    clock = request.app[CLOCK]
    released = await on_result(
        request, plan, plan.server_nonce, required=ATTESTED_FIELDS, optional=ATTESTED_OPTIONAL
    )
    headers = {"DPoP-Nonce": plan.server_nonce(clock()), "Cache-Control": "no-store"}
    if released.stages:  # [server] server_timing: each stage's milliseconds, summed over keys
        headers["Server-Timing"] = server_timing(released.stages, TIMED_STAGES)
    return web.json_response(
        _describe_release(released) | {"log_origin": request.app[SETTINGS].audit.origin},
        headers=headers,
    )


async def on_result(
    request: web.Request,
    plan: Plan[Unverified, Any, Any, Answer],
    server_nonce: Callable[[datetime], str],
    *,
    required: Sequence[str],
    optional: Sequence[str] = (),
) -> Answer:
    """Run a plan that admits an attestation result under DPoP (a release on it, an identity):
    the body and what the headers present (``Host`` only for its syntax: a proof's ``htu`` is
    compared with ``[server] public_urls``) through the kernel; a refusal carries a fresh
    ``DPoP-Nonce`` and, for a proof problem, its ``WWW-Authenticate`` challenge."""
    clock = request.app[CLOCK]
    try:
        body = await read_json_object(request, required=required, optional=optional)
        hosts = request.headers.getall("Host", [])
        presented = Presented(
            authorization=request.headers.get("Authorization"),
            proof=request.headers.get("DPoP"),
            host=",".join(hosts) if hosts else None,  # two Host fields: refused (a comma)
        )
        with naming_the_log(request):
            return await request.app[KERNEL].run(
                plan, (body, presented), now=clock(), request_id=request[REQUEST_ID]
            )
    except BrokerError as exc:
        exc.headers["DPoP-Nonce"] = server_nonce(clock())
        challenge = CHALLENGES.get(exc.code)
        if challenge is not None:
            exc.headers["WWW-Authenticate"] = f'DPoP algs="ES256", error="{challenge}"'
        raise


def server_timing(stages: Iterable[tuple[str, float]], names: Sequence[str]) -> str:
    """W3C ``Server-Timing`` of ``names``, in this order: each the sum of its laps, in
    milliseconds (3 decimals); a stage with no lap is ``0.000``."""
    totals = dict.fromkeys(names, 0.0)
    for stage, seconds in stages:
        if stage in totals:
            totals[stage] += seconds
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in totals.items())


CHALLENGES = {
    ErrorCode.DPOP_PROOF_INVALID: "invalid_dpop_proof",
    ErrorCode.DPOP_PROOF_REUSED: "invalid_dpop_proof",
    ErrorCode.DPOP_NONCE_REQUIRED: "use_dpop_nonce",
    ErrorCode.DPOP_KEY_MISMATCH: "invalid_dpop_proof",
    ErrorCode.DPOP_HTU_MISMATCH: "invalid_dpop_proof",
    ErrorCode.DPOP_IAT_INVALID: "invalid_dpop_proof",
}


def _describe_release(released: AttestedRelease) -> dict[str, object]:
    """Each key in the order asked: its wrapped key, or its error (a partial answer is 200)."""
    keys: list[dict[str, object]] = []
    for key in released.keys:
        if isinstance(key, ReleasedOnResult):
            keys.append(
                {
                    "key": key.key,
                    "version": key.version,
                    "wrapped_key": key.wrapped_key,
                    "algorithm": key.algorithm,
                    "policy_digest": key.policy_digest,
                }
            )
        else:
            error = {"code": key.error.code.value, "message": key.error.message}
            keys.append(
                {"key": key.key, "version": key.version, "error": error | key.error.details}
            )
    return {
        "release_id": released.release_id,
        "attestation": released.attestation,
        "wrap": released.wrap,
        "keys": keys,
        "log_index": released.log_index,
        "leaf_hash": base64.b64encode(released.leaf_hash).decode(),
    }


async def attest(request: web.Request) -> web.Response:
    """Verify evidence once and answer an attestation result (EAR) bound to the runner's keys:
    ``201``, the signed EAR as ``application/eat+jwt``, ``Location`` naming it."""
    plan = request.app[ATTESTATIONS].require_attest()
    body = await read_json_object(request, required=ATTEST_FIELDS)
    with naming_the_log(request):
        attested = await request.app[KERNEL].run(
            plan, body, now=request.app[CLOCK](), request_id=request[REQUEST_ID]
        )
    return web.Response(
        status=201,
        body=attested.token.encode("ascii"),
        headers={
            "Content-Type": MEDIA_TYPE,
            "Location": f"/v1/attestations/{attested.jti}",
            # the attestation record's place: which replica's log (origin), which leaf
            "Broker-Log-Origin": request.app[SETTINGS].audit.origin,
            "Broker-Log-Index": str(attested.log_index),
            "Cache-Control": "no-store",
            # the first release's proof needs no round trip to learn one
            "DPoP-Nonce": request.app[NONCES].server_nonce(request.app[CLOCK]()),
        },
    )


async def result_keys(request: web.Request) -> web.Response:
    """``/.well-known/jwks.json``: the keys that verify this broker's attestation results
    (none while ``[attest]`` is off)."""
    published = request.app[ATTESTATIONS].result_keys
    return web.json_response(published.jwks if published is not None else {"keys": []})


REASON_ROLES = ("auditor", "key-admin")  # who may read why a result was revoked


async def attestation_status(request: web.Request) -> web.Response:
    """``GET /v1/attestations/{jti}``: whether a result may still be used (``active``) or was
    revoked; 404 once it expired. Public: the jti is unguessable, and a peer holding a
    runner's certificate must be able to ask. ``identities``: the workload certificates issued
    on it (serial, SPIFFE ID, SHA-256 of the leaf, expiry; newest last), so that a peer can
    tell a certificate this broker issued from one the CA key signed elsewhere; no secret (a
    peer sees all of it in the certificate). The reason (which can name a policy's reasons, an
    image, a revoked GPU) only with an auditor's or key admin's bearer token; a token that
    holds neither role is 401, as on the admin routes."""
    service = request.app[ATTESTATIONS].require()
    with_reason = _reason_allowed(request)
    entry = await service.status(request.match_info["jti"], request.app[CLOCK]())
    return web.json_response(_describe(entry, with_reason=with_reason))


def _reason_allowed(request: web.Request) -> bool:
    """Raises: Unauthorized when an ``Authorization`` header is sent but holds no such role."""
    if "Authorization" not in request.headers:
        return False
    for role in REASON_ROLES[:-1]:
        try:
            check_admin(request, role)
        except Unauthorized:
            continue
        return True
    check_admin(request, REASON_ROLES[-1])
    return True


def _describe(entry: AttestationEntry, *, with_reason: bool = True) -> dict[str, object]:
    described: dict[str, object] = {
        "jti": entry.jti,
        "status": entry.status,
        "expires_at": entry.expires_at.isoformat().replace("+00:00", "Z"),
        "identities": [issued.described() for issued in entry.identities],
    }
    if with_reason:
        described["reason"] = entry.reason
    return described
