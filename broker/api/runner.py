"""Runner API: thin handlers (parse -> service -> render)."""

from __future__ import annotations

from aiohttp import web

from broker.api.body import optional_version, read_json_object, string_field
from broker.api.middleware import REQUEST_ID
from broker.api.state import STATE
from broker.crypto.jwk import parse_runner_key
from broker.errors import ErrorCode, InputError, UpstreamError
from broker.keys.service import MAX_KEY_NAME, validate_key_name
from broker.keys.wrap import WRAP_MODES, check_wrap_mode
from broker.nonces import MAX_NONCE_CHARS
from broker.release import ReleaseRequest, ReleaseService

RELEASE_FIELDS = ("key", "nonce", "evidence", "runner_key")


async def challenge(request: web.Request) -> web.Response:
    """Issue a single-use nonce. The body may be empty or ``{}``."""
    state = request.app[STATE]
    if request.can_read_body:
        await read_json_object(request, max_bytes=state.settings.server.max_body_bytes, required=())
    issued = await state.nonces.issue(state.clock())
    return web.json_response(
        {
            "nonce": issued.nonce,
            "expires_at": issued.expires_at.isoformat().replace("+00:00", "Z"),
            "audience": state.settings.server.audience,
        }
    )


async def release(request: web.Request) -> web.Response:
    """Verify evidence, decide, log, and return the DEK wrapped to the runner key."""
    state = request.app[STATE]
    body = await read_json_object(
        request,
        max_bytes=state.settings.server.max_body_bytes,
        required=RELEASE_FIELDS,
        optional=("version", "wrap"),
    )
    wrap = body.get("wrap", "jwe")
    if wrap not in WRAP_MODES:
        raise InputError(f"wrap must be one of {', '.join(WRAP_MODES)}")
    parsed = ReleaseRequest(
        key=validate_key_name(string_field(body, "key", max_chars=MAX_KEY_NAME)),
        version=optional_version(body),
        nonce=string_field(body, "nonce", max_chars=MAX_NONCE_CHARS),
        unverified_evidence=body["evidence"],
        runner_key=parse_runner_key(body["runner_key"]),
        wrap=wrap,
    )
    check_wrap_mode(wrap, parsed.runner_key)
    released = await _service(state.release).release(
        parsed, now=state.clock(), request_id=request[REQUEST_ID]
    )
    return web.json_response(
        {
            "key": released.key,
            "version": released.version,
            "decision_id": released.decision_id,
            "wrapped_key": released.wrapped_key,
            "wrap": released.wrap,
            "algorithm": released.algorithm,
        }
    )


def _service(service: ReleaseService | None) -> ReleaseService:
    if service is None:
        raise UpstreamError("the broker is not ready", code=ErrorCode.NOT_READY)
    return service
