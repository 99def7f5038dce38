"""Protocol v1 end to end against a real broker on loopback, through broker.client."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from broker.client import BrokerClientError
from broker.client.unwrap import new_ephemeral_key
from broker.crypto.jwk import public_jwk, thumbprint
from tests.integration.conftest import RunningBroker
from tests.support.constants import DENIED, KEY


@pytest.fixture(params=["process", "workers"])
def deployment(request: pytest.FixtureRequest) -> str:
    """As deployed: a broker in this process per test, and one ``broker serve --workers 2``
    that serves every test of this module (each test sees its own records)."""
    return str(request.param)


@pytest.fixture
async def broker(
    deployment: str, start_broker: Any, module_workers_broker: RunningBroker
) -> RunningBroker:
    if deployment == "workers":
        return await asyncio.to_thread(module_workers_broker.from_now_on)
    return await start_broker()  # type: ignore[no-any-return]


@pytest.mark.parametrize("key_type", ["EC-P256", "EC-P384", "X25519", "RSA-3072"])
async def test_attested_runner_gets_the_key(broker: RunningBroker, key_type: str) -> None:
    async with broker.client() as client:
        first = await client.release(KEY, broker.token_source(), key_type=key_type)
        again = await client.release(KEY, broker.token_source(), key_type=key_type)
    assert len(first.dek) == 32
    assert first.dek == again.dek
    assert (first.key, first.version) == (KEY, 1)
    records = [r for r in broker.records() if r["type"] == "release"]
    assert [r["result"] for r in records] == ["allow", "allow"]
    assert records[0]["decision_id"] == first.decision_id
    assert records[0]["identity"]["image_digest"].startswith("sha256:a1a1")


async def test_denied_runner_gets_reasons_and_no_key(broker: RunningBroker) -> None:
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source(DENIED))
    error = caught.value
    assert (error.status, error.code) == (403, "policy_denied")
    assert error.details["reasons"] == [f"image {DENIED} is not allowed for key {KEY}"]
    assert "wrapped_key" not in error.details
    record = broker.records()[-1]
    assert record["result"] == "deny"
    assert record["decision_id"] == error.details["decision_id"]
    assert record["reasons"] == error.details["reasons"]


async def test_debug_image_denied(broker: RunningBroker) -> None:
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source(debug=True))
    assert caught.value.code == "policy_denied"
    assert any("debug" in r for r in caught.value.details["reasons"])


async def test_unknown_key_is_404_after_attestation(broker: RunningBroker) -> None:
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release("models/missing", broker.token_source())
    assert (caught.value.status, caught.value.code) == (404, "key_unknown")


async def test_secrets_never_reach_the_decision_log(broker: RunningBroker) -> None:
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
    text = broker.settings.audit.log.read_text()
    assert released.dek.hex() not in text
    # no raw JWT (nor the wrapped JWE): a compact JOSE object is a JSON header in base64url, then a
    # dot ("eyJ" alone also turns up by chance in a thumbprint or a nonce: 1 in 262,144 a place)
    assert not re.search(r"eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*\.", text)
    record = broker.records()[-1]
    assert record["evidence_digests"]["gca"].startswith("sha256:")
    assert record["policy_digest"].startswith("sha256:")


async def test_runner_key_thumbprint_recorded(broker: RunningBroker) -> None:
    private = new_ephemeral_key()
    jwk = public_jwk(private.public_key())
    async with broker.client() as client:
        challenge = await client.challenge()
        token = await broker.token_source().token(
            challenge.audience, [challenge.nonce, thumbprint(jwk)]
        )
        body = await client._post(
            "/v1/release",
            {"key": KEY, "nonce": challenge.nonce, "evidence": {"gca": token}, "runner_key": jwk},
        )
    assert body["key"] == KEY
    assert broker.records()[-1]["runner_key_thumbprint"] == thumbprint(jwk)
