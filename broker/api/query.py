"""Public query-key endpoints: signed public halves of query keys, and the statement key."""

from __future__ import annotations

from aiohttp import web

from broker.api.state import STATE
from broker.core.errors import ErrorCode, NotFound, UpstreamError
from broker.core.fields import version_query
from broker.crypto.query import sign_statement, statement_jwks
from broker.keys.service import validate_key_name
from broker.keys.store.base import Purpose


async def public_key(request: web.Request) -> web.Response:
    """``GET /v1/keys/{name}/public[?version=N]``: a query key's public half, signed."""
    state = request.app[STATE]
    if state.release is None:
        raise UpstreamError("the broker is not ready", code=ErrorCode.NOT_READY)
    if state.statement_signer is None:
        raise _query_keys_off()
    name = validate_key_name(request.match_info["name"])
    version = version_query(request.query.get("version"))
    record = await state.release.keys.resolve(name, version)
    if record.purpose is not Purpose.QUERY:
        raise NotFound(f"{name!r} is not a query key", code=ErrorCode.KEY_UNKNOWN)
    statement = sign_statement(
        state.statement_signer,
        key=record.name,
        version=record.version,
        algorithm=record.algorithm,
        public_raw=record.public_key,
        policy_digest=state.release.policy.digest,
        now=state.clock(),
    )
    return web.json_response(
        {
            "key": record.name,
            "version": record.version,
            "algorithm": record.algorithm.value,
            "statement": statement,
        }
    )


async def statement_keys(request: web.Request) -> web.Response:
    """``GET /v1/statement-keys``: the JWKS of the statement key (pin it out of band)."""
    signer = request.app[STATE].statement_signer
    if signer is None:
        raise _query_keys_off()
    return web.json_response(statement_jwks(signer))


def _query_keys_off() -> NotFound:
    """Without ``[keys] signing_key`` this broker publishes no query keys: the resource does
    not exist here (404), it is not a failing dependency (a 5xx would page someone)."""
    return NotFound(
        "this broker publishes no query keys ([keys] signing_key is not set)",
        code=ErrorCode.NOT_FOUND,
    )
