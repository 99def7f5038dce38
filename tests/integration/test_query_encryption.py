"""Encrypted queries and answers end to end: a client fetches and verifies a query key through
``QueryClient``, an attested runner is released the private half and answers; RFC 9458-style
response keys (broker.client.query). Both suites: the hybrid (default) and X25519."""

from __future__ import annotations

import os

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from jwt import PyJWK

from broker.client.query import (
    QueryClient,
    QueryError,
    QueryPrivateKey,
    open_query,
    seal_query,
)
from broker.crypto.query import StatementError
from tests.integration.conftest import RunningBroker
from tests.integration.test_admin_and_query_keys import admin_broker, call  # noqa: F401
from tests.support.constants import QUERY_KEY

SUITES = ["HPKE-MLKEM768-X25519", "HPKE-X25519"]


async def pinned_statement_key(broker: RunningBroker) -> ec.EllipticCurvePublicKey:
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + "/v1/statement-keys", ssl=broker.client_tls) as response,
    ):
        jwks = await response.json()
    key = PyJWK(jwks["keys"][0]).key
    assert isinstance(key, ec.EllipticCurvePublicKey)
    return key


async def runner_key(broker: RunningBroker, algorithm: str) -> QueryPrivateKey:
    key_type = "MLKEM768-X25519" if "MLKEM" in algorithm else "X25519"
    async with broker.client() as client:
        released = await client.release(
            QUERY_KEY, broker.token_source(), wrap="hpke", key_type=key_type
        )
    return QueryPrivateKey.from_release(released)


@pytest.mark.parametrize("algorithm", SUITES)
async def test_query_and_answer_round_trip_and_every_tampering_fails(
    admin_broker: RunningBroker,  # noqa: F811
    algorithm: str,
) -> None:
    status, _ = await call(
        admin_broker,
        "POST",
        "/v1/admin/keys",
        {"name": QUERY_KEY, "purpose": "query", "algorithm": algorithm},
    )
    assert status == 201
    client = QueryClient(
        admin_broker.url,
        statement_key=await pinned_statement_key(admin_broker),
        ssl_context=admin_broker.client_tls,
    )
    public = await client.public_key(QUERY_KEY)
    query, aad = b"summarise this confidential contract", b"session-42"
    message, response_context = seal_query(public, query, aad=aad)
    private = await runner_key(admin_broker, algorithm)

    opened, reply = open_query(private, message, aad=aad)
    assert opened == query
    answer = reply.seal_response(b"it says: pay on time")
    assert response_context.open_response(answer) == b"it says: pay on time"

    # Tampered query, other AAD, another key: the runner cannot open it.
    changed = bytearray(message)
    changed[-1] ^= 1
    for bad_message, bad_aad, key in (
        (bytes(changed), aad, private),
        (message, b"session-43", private),
        (
            message,
            aad,
            QueryPrivateKey(private.key, private.version + 1, private.kem, private.secret),
        ),
        (message[:10], aad, private),
    ):
        with pytest.raises(QueryError):
            open_query(key, bad_message, aad=bad_aad)
    stranger = QueryPrivateKey(
        private.key, private.version, private.kem, os.urandom(len(private.secret))
    )
    with pytest.raises(QueryError):
        open_query(stranger, message, aad=aad)

    # Tampered answer; an answer to another query; an answer replayed onto another query.
    broken = bytearray(answer)
    broken[40] ^= 1
    with pytest.raises(QueryError):
        response_context.open_response(bytes(broken))
    second_message, second_context = seal_query(public, b"another question", aad=aad)
    _, second_reply = open_query(private, second_message, aad=aad)
    second_answer = second_reply.seal_response(b"another answer")
    with pytest.raises(QueryError):
        response_context.open_response(second_answer)  # meant for the second query
    with pytest.raises(QueryError):
        second_context.open_response(answer)  # the first answer replayed onto the second
    assert second_context.open_response(second_answer) == b"another answer"


async def test_statement_with_a_bad_signature_or_for_another_key_is_refused(
    admin_broker: RunningBroker,  # noqa: F811
) -> None:
    status, _ = await call(
        admin_broker, "POST", "/v1/admin/keys", {"name": QUERY_KEY, "purpose": "query"}
    )
    assert status == 201
    stranger = ec.generate_private_key(ec.SECP256R1()).public_key()
    wrong_pin = QueryClient(
        admin_broker.url, statement_key=stranger, ssl_context=admin_broker.client_tls
    )
    with pytest.raises(StatementError):
        await wrong_pin.public_key(QUERY_KEY)
    client = QueryClient(
        admin_broker.url,
        statement_key=await pinned_statement_key(admin_broker),
        ssl_context=admin_broker.client_tls,
    )
    with pytest.raises(QueryError):
        await client.public_key("models/no-such-key")
    default = await client.public_key(QUERY_KEY)
    assert default.kem == "MLKEM768-X25519"  # the hybrid is the default suite
    assert default.public_raw
