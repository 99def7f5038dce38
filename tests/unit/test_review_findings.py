"""The smaller review findings of the hardening issue (item 18), one test each."""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import UTC, datetime
from pathlib import Path

import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from cryptography.hazmat.primitives.asymmetric import rsa

from broker.api.middleware import METRICS, REQUEST_ID, request_context
from broker.attestation import pipeline
from broker.attestation.issuers import IssuerSettings
from broker.attestation.pipeline import IssuerTrust, Trust
from broker.attestation.service import evidence_digests
from broker.config import KeySettings
from broker.core.errors import AttestationError, BrokerError, ConfigError, ErrorCode
from broker.core.metrics import Metrics
from broker.crypto import jose
from broker.crypto.jwks import MAX_X5C
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose


def test_bad_input_is_a_stable_error_code() -> None:
    assert ErrorCode("bad_input") is ErrorCode.BAD_INPUT
    assert ConfigError("x", "y").code is ErrorCode.BAD_INPUT


def test_config_error_is_not_renderable_to_clients() -> None:
    assert not issubclass(ConfigError, BrokerError)


async def test_config_error_at_request_time_renders_as_internal_error_without_text() -> None:
    async def handler(request: web.Request) -> web.Response:
        raise ConfigError("keys.kek", "secret path /etc/very-private/kek.key is unreadable")

    app = web.Application()
    app[METRICS] = Metrics()
    request = make_mocked_request("GET", "/x", app=app)
    response = await request_context(request, handler)
    assert isinstance(response, web.Response)
    body = json.loads(response.text or "")
    assert response.status == 500
    assert body["error"]["code"] == "internal_error"
    assert "very-private" not in (response.text or "")
    assert request[REQUEST_ID] == body["error"]["request_id"]


def test_evidence_digests_are_over_canonical_json() -> None:
    one = {"nvidia": {"arch": "HOPPER", "evidence_list": [{"b": 1, "a": "é"}]}}
    two = json.loads('{"nvidia" : {"evidence_list":[ {"a":"\\u00e9","b":1} ],"arch":"HOPPER"}}')
    assert evidence_digests(one) == evidence_digests(two)
    assert evidence_digests([1, 2]).keys() == {"evidence"}  # total: any JSON value
    assert evidence_digests({"gca": "\ud800"})  # a lone surrogate does not raise


def test_one_x5c_bound_for_every_verifier() -> None:
    from broker.attestation import gca  # noqa: PLC0415

    assert vars(gca)["MAX_X5C"] is MAX_X5C  # gca uses the key-set module's bound
    header = jose.UnverifiedHeader(
        alg="RS256", kid="k", fields={"x5c": [base64.b64encode(b"x").decode()] * (MAX_X5C + 1)}
    )
    with pytest.raises(BrokerError) as caught:
        gca.pki_signing_key(header, [], now=datetime.now(UTC))
    assert "x5c" in caught.value.message


def test_every_verifier_refuses_a_header_without_kid() -> None:
    """The shared header rule (``jose.parse_header_with_kid``) is what the Google, Intel and
    NVIDIA paths apply: a token that names no key is refused before any key is chosen."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    token = jwt.encode({"iss": "https://iss.test"}, key, algorithm="RS256", headers={})
    with pytest.raises(AttestationError, match="no kid"):
        jose.parse_header_with_kid(token, ("RS256",))
    settings = IssuerSettings(kind="gca", issuer="https://iss.test")
    trust = Trust(issuers={"https://iss.test": IssuerTrust(settings)}, audience="aud")
    with pytest.raises(AttestationError, match="no kid"):
        pipeline.requirements({"gca": token}, trust)
    assert jose.parse_header(token, ("RS256",)).kid is None  # the plain parser allows it


async def test_concurrent_rotation_is_a_conflict_not_key_exists(tmp_path: Path) -> None:
    settings = KeySettings(store=f"sqlite:///{tmp_path / 'keys.db'}", kek=f"local:{tmp_path / 'k'}")
    now = datetime.now(UTC)
    async with open_key_service(settings, create_missing_kek=True) as keys:
        await keys.create("models/r", Purpose.MODEL_WEIGHTS, now=now)
        results = await asyncio.gather(
            *(keys.rotate("models/r", now=now) for _ in range(4)), return_exceptions=True
        )
    codes = {r.code for r in results if isinstance(r, BrokerError)}
    assert codes == {ErrorCode.CONFLICT}  # the losers of the race, named as such
    assert any(not isinstance(r, BaseException) for r in results)
