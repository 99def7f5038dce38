"""Runner API: thin handlers (parse -> service -> render)."""

from __future__ import annotations

from aiohttp import web

from broker.api.body import read_json_object
from broker.api.middleware import REQUEST_ID
from broker.api.state import STATE
from broker.core.errors import ErrorCode, UpstreamError
from broker.release import RELEASE_FIELDS, RELEASE_OPTIONAL, ReleaseService


async def challenge(request: web.Request) -> web.Response:
    """Issue a single-use nonce. The body may be empty or ``{}``."""
    state = request.app[STATE]
    if request.can_read_body:
        await read_json_object(request, required=())
    issued = await state.nonces.issue(state.clock())
    return web.json_response(
        {
            "nonce": issued.nonce,
            "expires_at": issued.expires_at.isoformat().replace("+00:00", "Z"),
            "audience": state.settings.server.audience,
        }
    )


async def release(request: web.Request) -> web.Response:
    """Verify evidence, decide, log, and return the DEK wrapped to the runner key.

    Only the body's syntax is checked here; its fields are checked by the release service,
    inside the logged path, so that every parsed release request leaves a decision record.
    """
    state = request.app[STATE]
    body = await read_json_object(request, required=RELEASE_FIELDS, optional=RELEASE_OPTIONAL)
    released = await _service(state.release).release(
        body, now=state.clock(), request_id=request[REQUEST_ID]
    )
    return web.json_response(
        {
            "key": released.key,
            "version": released.version,
            "decision_id": released.decision_id,
            "wrapped_key": released.wrapped_key,
            "wrap": released.wrap,
            "algorithm": released.algorithm,
            "log_index": released.log_index,
        }
    )


def _service(service: ReleaseService | None) -> ReleaseService:
    if service is None:
        raise UpstreamError("the broker is not ready", code=ErrorCode.NOT_READY)
    return service
