"""Public query-key endpoints: signed public halves of query keys, and the statement key."""

from __future__ import annotations

from aiohttp import web

from broker.api.services import CLOCK, KEYS, POLICY, STATEMENTS
from broker.core.errors import ErrorCode, NotFound
from broker.core.fields import version_query
from broker.crypto.query import sign_statement, statement_jwks
from broker.keys.service import validate_key_name
from broker.keys.store.base import Purpose


async def public_key(request: web.Request) -> web.Response:
    """``GET /v1/keys/{name}/public[?version=N]``: a query key's public half, signed."""
    signer = request.app[STATEMENTS].require()
    name = validate_key_name(request.match_info["name"])
    version = version_query(request.query.get("version"))
    record = await request.app[KEYS].resolve(name, version)
    if record.purpose is not Purpose.QUERY:
        raise NotFound(f"{name!r} is not a query key", code=ErrorCode.KEY_UNKNOWN)
    public = await request.app[KEYS].query_public(record)  # the stored half only checked
    statement = sign_statement(
        signer,
        key=record.name,
        version=record.version,
        algorithm=record.algorithm,
        public_raw=public,
        policy_digest=request.app[POLICY].digest,
        now=request.app[CLOCK](),
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
    return web.json_response(statement_jwks(request.app[STATEMENTS].require()))
