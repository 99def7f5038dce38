"""Admin API (authentication, lifecycle over HTTP) and query keys (HPKE) end to end."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from jwt import PyJWK

from broker.client import BrokerClientError
from broker.crypto.hpke import HpkeError
from broker.crypto.query import StatementError, open_query, seal_query, verify_statement
from broker.keys.factory import open_store
from tests.integration.conftest import RunningBroker, write_statement_key
from tests.support.constants import KEY, QUERY_KEY
from tests.support.key_changes import outcomes

TOKEN = "admin-test-token-5f2c"
ADMIN_ROUTES = [
    ("GET", "/v1/admin/keys", None),
    ("POST", "/v1/admin/keys", {"name": "models/x", "purpose": "generic"}),
    ("POST", "/v1/admin/keys/rotate", {"name": KEY}),
    ("POST", "/v1/admin/keys/import", {"name": KEY, "purpose": "model-weights", "dek": "A" * 43}),
    ("POST", "/v1/admin/keys/disable", {"name": KEY, "version": 1}),
    ("POST", "/v1/admin/keys/enable", {"name": KEY, "version": 1}),
    ("POST", "/v1/admin/keys/destroy", {"name": KEY, "version": 1}),
]


def write_signing_key(workdir: Path) -> None:
    write_statement_key(workdir / "statement.key")


@pytest.fixture
async def admin_broker(start_broker: Any, tmp_path: Path) -> RunningBroker:
    return await start_broker(  # type: ignore[no-any-return]
        environ={
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
            "BROKER_KEYS_SIGNING_KEY": str(tmp_path / "broker0" / "statement.key"),
        },
        workdir_setup=write_signing_key,
    )


async def call(
    broker: RunningBroker, method: str, path: str, body: Any = None, token: str | None = TOKEN
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, broker.url + path, json=body, headers=headers, ssl=broker.client_tls
        ) as response,
    ):
        return response.status, await response.json()


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES)
@pytest.mark.parametrize("token", [None, "wrong-token", ""])
async def test_admin_routes_refuse_missing_or_wrong_credentials(
    admin_broker: RunningBroker, method: str, path: str, body: Any, token: str | None
) -> None:
    status, answer = await call(admin_broker, method, path, body, token=token)
    assert (status, answer["error"]["code"]) == (401, "unauthorized")
    versions = (await call(admin_broker, "GET", "/v1/admin/keys"))[1]["keys"]
    assert [(v["name"], v["version"], v["state"]) for v in versions if v["name"] == KEY] == [
        (KEY, 1, "enabled")
    ]


async def test_admin_api_is_closed_without_configured_credentials(broker: RunningBroker) -> None:
    status, answer = await call(broker, "GET", "/v1/admin/keys", token="anything")
    assert (status, answer["error"]["code"]) == (401, "unauthorized")


async def test_lifecycle_over_the_admin_api(admin_broker: RunningBroker) -> None:
    status, created = await call(
        admin_broker, "POST", "/v1/admin/keys", {"name": "models/new", "purpose": "model-weights"}
    )
    assert (status, created["version"]) == (201, 1)
    status, _ = await call(
        admin_broker, "POST", "/v1/admin/keys", {"name": "models/new", "purpose": "model-weights"}
    )
    assert status == 409
    status, rotated = await call(admin_broker, "POST", "/v1/admin/keys/rotate", {"name": KEY})
    assert (status, rotated["version"]) == (201, 2)
    async with admin_broker.client() as client:
        assert (await client.release(KEY, admin_broker.token_source())).version == 2
        await call(admin_broker, "POST", "/v1/admin/keys/disable", {"name": KEY, "version": 2})
        assert (await client.release(KEY, admin_broker.token_source())).version == 1
        with pytest.raises(BrokerClientError) as disabled:
            await client.release(KEY, admin_broker.token_source(), version=2)
        assert (disabled.value.status, disabled.value.code) == (409, "key_version_unavailable")
        await call(admin_broker, "POST", "/v1/admin/keys/enable", {"name": KEY, "version": 2})
        await call(admin_broker, "POST", "/v1/admin/keys/destroy", {"name": KEY, "version": 1})
        with pytest.raises(BrokerClientError) as destroyed:
            await client.release(KEY, admin_broker.token_source(), version=1)
        assert destroyed.value.code == "key_version_unavailable"
    _, listing = await call(admin_broker, "GET", f"/v1/admin/keys?name={KEY}")
    assert [(v["version"], v["state"]) for v in listing["keys"]] == [
        (1, "destroyed"),
        (2, "enabled"),
    ]
    changes = [r for r in admin_broker.records() if r.get("type") == "key_admin"]
    assert outcomes(changes) == [  # each change: its intent, then its outcome naming it
        ("create", 1, "ok", None),
        ("rotate", 2, "ok", None),
        ("disable", 2, "ok", None),
        ("enable", 2, "ok", None),
        ("destroy", 1, "ok", None),
    ]
    assert len(changes) == 10
    assert "wrapped" not in json.dumps(listing)


async def test_admin_bad_input_is_400(admin_broker: RunningBroker) -> None:
    status, answer = await call(
        admin_broker, "POST", "/v1/admin/keys", {"name": "Bad Name", "purpose": "generic"}
    )
    assert (status, answer["error"]["code"]) == (400, "bad_request")
    status, answer = await call(
        admin_broker, "POST", "/v1/admin/keys", {"name": "models/y", "purpose": "nope"}
    )
    assert status == 400
    status, _ = await call(
        admin_broker, "POST", "/v1/admin/keys/disable", {"name": "models/none", "version": 1}
    )
    assert status == 404


@pytest.mark.parametrize("key_type", ["X25519", "MLKEM768-X25519"])
async def test_hpke_wrapped_release(admin_broker: RunningBroker, key_type: str) -> None:
    async with admin_broker.client() as client:
        jwe = await client.release(KEY, admin_broker.token_source())
        hpke = await client.release(
            KEY, admin_broker.token_source(), wrap="hpke", key_type=key_type
        )
    assert hpke.dek == jwe.dek


async def test_hybrid_runner_key_needs_hpke_wrap(admin_broker: RunningBroker) -> None:
    async with admin_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, admin_broker.token_source(), key_type="MLKEM768-X25519")
    assert (caught.value.status, caught.value.code) == (400, "runner_key_invalid")


@pytest.mark.parametrize("algorithm", ["HPKE-MLKEM768-X25519", "HPKE-X25519"])
async def test_query_key_end_to_end(admin_broker: RunningBroker, algorithm: str) -> None:
    # The security team creates a query key; its public half is published, signed.
    status, _ = await call(
        admin_broker,
        "POST",
        "/v1/admin/keys",
        {"name": QUERY_KEY, "purpose": "query", "algorithm": algorithm},
    )
    assert status == 201
    async with aiohttp.ClientSession() as session:
        async with session.get(
            admin_broker.url + "/v1/statement-keys", ssl=admin_broker.client_tls
        ) as response:
            jwks = await response.json()
        async with session.get(
            admin_broker.url + f"/v1/keys/{QUERY_KEY}/public", ssl=admin_broker.client_tls
        ) as response:
            published = await response.json()
        async with session.get(
            admin_broker.url + f"/v1/keys/{KEY}/public", ssl=admin_broker.client_tls
        ) as response:
            assert response.status == 404  # a weights key has no public half
    # A client pins the statement key, verifies the statement, seals a query.
    pinned = PyJWK(jwks["keys"][0]).key
    now = datetime.now(UTC)
    target = verify_statement(published["statement"], pinned, now=now)
    assert (target.key, target.version) == (QUERY_KEY, 1)
    assert target.policy_digest.startswith("sha256:")
    query = b"what is the capital of France?"
    sealed = seal_query(target, query)
    with pytest.raises(StatementError):
        verify_statement(
            published["statement"], ec.generate_private_key(ec.SECP256R1()).public_key(), now=now
        )
    with pytest.raises(StatementError):  # signed "now": not yet valid an hour earlier
        verify_statement(published["statement"], pinned, now=now - timedelta(hours=1))
    # An attested runner is released the private half and opens the query.
    async with admin_broker.client() as client:
        released = await client.release(
            QUERY_KEY, admin_broker.token_source(), wrap="hpke", key_type="MLKEM768-X25519"
        )
    assert released.algorithm == algorithm
    opened = open_query(
        sealed,
        secret=released.dek,
        algorithm=released.algorithm,
        key=QUERY_KEY,
        version=released.version,
    )
    assert opened == query
    with pytest.raises(HpkeError):
        open_query(sealed, secret=released.dek, algorithm=released.algorithm, key=KEY, version=1)


async def test_query_key_creation_refused_without_a_statement_key(start_broker: Any) -> None:
    broker = await start_broker(
        environ={"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest()}
    )
    status, body = await call(
        broker, "POST", "/v1/admin/keys", {"name": "models/q", "purpose": "query"}
    )
    assert (status, body["error"]["code"]) == (400, "bad_request")
    assert "signing_key" in body["error"]["message"]


async def test_query_endpoints_are_404_not_5xx_when_query_keys_are_off(
    broker: RunningBroker,
) -> None:
    for path in ("/v1/statement-keys", f"/v1/keys/{KEY}/public"):
        status, body = await call(broker, "GET", path, token=None)
        assert (status, body["error"]["code"]) == (404, "not_found"), path
        assert "signing_key" in body["error"]["message"]


@pytest.mark.parametrize("algorithm", ["HPKE-X25519", "HPKE-MLKEM768-X25519"])
async def test_a_public_half_edited_in_the_store_is_never_signed(
    admin_broker: RunningBroker, algorithm: str
) -> None:
    """Whoever can write the key store (a sealed broker's operator) swaps a query key's stored
    public half for one of their own: the broker derives the half it signs from the wrapped
    private half, so it answers 503 ``key_record_invalid`` and signs nothing."""
    status, _ = await call(
        admin_broker, "POST", "/v1/admin/keys", {"name": QUERY_KEY, "purpose": "query",
                                                 "algorithm": algorithm},
    )  # fmt: skip
    assert status == 201
    store = await open_store(admin_broker.settings.keys)  # as the operator: no KEK needed
    try:
        record = await store.latest_version(QUERY_KEY, enabled_only=True)
        assert record is not None
        edited = x25519.X25519PrivateKey.generate().public_key().public_bytes_raw()
        public = record.public_key[: -len(edited)] + edited  # the classic half: the operator's
        assert await store.replace(record.evolve(public_key=public), expected=record)
    finally:
        await store.close()
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{admin_broker.url}/v1/keys/{QUERY_KEY}/public", ssl=admin_broker.client_tls
        ) as reply,
    ):
        body = await reply.json()
        assert reply.status == 503
    assert body["error"]["code"] == "key_record_invalid"
    assert "statement" not in body
