"""Attacks and bad input over real HTTP: each gets a stable code, never a 500 or key material."""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest

from broker.audit.segments import verify_file
from broker.client.unwrap import new_ephemeral_key
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from tests.integration.conftest import RunningBroker
from tests.support.constants import KEY


async def post(
    broker: RunningBroker, path: str, body: Any, **kwargs: Any
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = kwargs.pop("headers", {"Content-Type": "application/json"})
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            broker.url + path, data=data, headers=headers, ssl=broker.client_tls, **kwargs
        ) as response,
    ):
        text = await response.text()
        assert "Traceback" not in text
        return response.status, json.loads(text) if text else {}


async def fresh_request(broker: RunningBroker, **token_overrides: Any) -> dict[str, Any]:
    """A well-formed release request whose token binds this request's nonce and key."""
    status, challenge = await post(broker, "/v1/challenge", {})
    assert status == 200
    jwk = public_jwk(new_ephemeral_key().public_key())
    nonces = token_overrides.pop("nonces", [challenge["nonce"], thumbprint(jwk)])
    audience = token_overrides.pop("audience", challenge["audience"])
    token = await broker.token_source(**token_overrides).token(audience, nonces)
    return {"key": KEY, "nonce": challenge["nonce"], "evidence": {"gca": token}, "runner_key": jwk}


def assert_error(status: int, body: dict[str, Any], expected_status: int, code: str) -> None:
    assert status == expected_status, body
    assert body["error"]["code"] == code
    assert body["error"]["request_id"]
    assert "wrapped_key" not in json.dumps(body)


async def test_release_succeeds_as_control(broker: RunningBroker) -> None:
    status, body = await post(broker, "/v1/release", await fresh_request(broker))
    assert status == 200
    assert body["wrapped_key"].count(".") == 4


async def test_nonce_replay_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    assert (await post(broker, "/v1/release", request))[0] == 200
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "nonce_reused")


async def test_forged_evidence_spends_no_nonce_so_junk_locks_nobody_out(
    broker: RunningBroker,
) -> None:
    """Issue 27: a challenge is spent only by evidence that verified. A forged token carrying
    someone's fresh challenge spends nothing; the genuine request then succeeds, once."""
    request = await fresh_request(broker)
    broken = dict(request, evidence={"gca": request["evidence"]["gca"][:-4] + "AAAA"})
    assert (await post(broker, "/v1/release", broken))[0] == 401
    assert (await post(broker, "/v1/release", request))[0] == 200
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "nonce_reused")


async def test_unknown_nonce_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    status, body = await post(broker, "/v1/release", dict(request, nonce="A" * 43))
    assert_error(status, body, 401, "nonce_unknown")


async def test_token_without_the_broker_nonce_rejected(broker: RunningBroker) -> None:
    jwk_request = await fresh_request(broker)
    tp = thumbprint(jwk_request["runner_key"])
    request = await fresh_request(broker, nonces=["some-other-nonce-value", tp])
    request["runner_key"] = jwk_request["runner_key"]
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "nonce_mismatch")


async def test_missing_nonce_in_token_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker, nonces=[])
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "nonce_missing")


async def test_thumbprint_mismatch_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    # A thief swaps in their own key: the token still binds the runner's thumbprint.
    request["runner_key"] = public_jwk(new_ephemeral_key().public_key())
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "key_binding_mismatch")


async def test_wrong_audience_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker, audience="https://sts.googleapis.com")
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "audience_mismatch")


async def test_token_from_unconfigured_issuer_rejected(broker: RunningBroker) -> None:
    rogue = DevIssuer(dev_mode=True, issuer="https://rogue.invalid")
    request = await fresh_request(broker)
    token = await DevTokenSource(
        rogue, Workload(image_digest="sha256:" + "a1" * 32), lambda: datetime.now(UTC)
    ).token("https://broker.it.invalid", [request["nonce"], thumbprint(request["runner_key"])])
    status, body = await post(broker, "/v1/release", dict(request, evidence={"gca": token}))
    assert_error(status, body, 401, "issuer_unknown")


async def test_tampered_payload_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    header, payload, signature = request["evidence"]["gca"].split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    claims["dbgstat"] = "disabled-since-boot"
    claims["submods"]["container"]["image_digest"] = "sha256:" + "00" * 32
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    request["evidence"]["gca"] = f"{header}.{forged}.{signature}"
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "token_signature_invalid")


async def test_alg_none_rejected_over_http(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    _, payload, _ = request["evidence"]["gca"].split(".")
    none_header = "eyJhbGciOiJub25lIn0"  # {"alg":"none"}
    request["evidence"]["gca"] = f"{none_header}.{payload}."
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 401, "token_algorithm_forbidden")


async def test_oversized_body_rejected(broker: RunningBroker) -> None:
    big = {"key": KEY, "nonce": "n", "evidence": {"gca": "x" * 300_000}, "runner_key": {}}
    status, body = await post(broker, "/v1/release", big)
    assert_error(status, body, 413, "body_too_large")


async def test_malformed_json_rejected(broker: RunningBroker) -> None:
    status, body = await post(broker, "/v1/release", b'{"key": "models/llama", ')
    assert_error(status, body, 400, "malformed_json")


async def test_unknown_field_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    status, body = await post(broker, "/v1/release", dict(request, wrap_to="me"))
    assert_error(status, body, 400, "bad_request")
    assert "wrap_to" in body["error"]["message"]


@pytest.mark.parametrize("missing", ["key", "nonce", "evidence", "runner_key"])
async def test_missing_field_rejected(broker: RunningBroker, missing: str) -> None:
    request = await fresh_request(broker)
    del request[missing]
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 400, "bad_request")


async def test_wrong_content_type_rejected(broker: RunningBroker) -> None:
    status, body = await post(broker, "/v1/release", b"{}", headers={"Content-Type": "text/plain"})
    assert_error(status, body, 415, "unsupported_media_type")


async def test_unsupported_evidence_kind_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    status, body = await post(broker, "/v1/release", dict(request, evidence={"tpm": "x"}))
    assert_error(status, body, 400, "evidence_unsupported")


async def test_private_runner_key_rejected(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    request["runner_key"] = dict(request["runner_key"], d="AAAA")
    status, body = await post(broker, "/v1/release", request)
    assert_error(status, body, 400, "runner_key_invalid")


async def test_unknown_route_and_method(broker: RunningBroker) -> None:
    status, body = await post(broker, "/v1/nothing", {})
    assert_error(status, body, 404, "not_found")
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + "/v1/release", ssl=broker.client_tls) as response,
    ):
        assert response.status == 405
        assert (await response.json())["error"]["code"] == "method_not_allowed"


async def test_every_attempt_is_logged_and_the_chain_verifies(broker: RunningBroker) -> None:
    await post(broker, "/v1/release", await fresh_request(broker))
    await post(broker, "/v1/release", await fresh_request(broker, audience="https://other"))
    records = broker.records()
    assert [r["type"] for r in records] == ["policy_change", "release", "release"]
    assert [(r["result"], r["code"]) for r in records[1:]] == [
        ("allow", None),
        ("deny", "audience_mismatch"),
    ]
    report = await asyncio.to_thread(verify_file, broker.settings.audit.log)
    assert report.head.size == 3


async def test_concurrent_nonce_replay_releases_exactly_once(broker: RunningBroker) -> None:
    request = await fresh_request(broker)
    results = await asyncio.gather(*(post(broker, "/v1/release", request) for _ in range(150)))
    statuses = sorted(status for status, _ in results)
    assert statuses.count(200) == 1
    assert all(body["error"]["code"] == "nonce_reused" for status, body in results if status != 200)
    releases = [r for r in broker.records() if r.get("type") == "release"]
    assert len(releases) == 150
    assert [r["result"] for r in releases].count("allow") == 1
