"""``POST /v1/attest`` against a live broker (issue 19): evidence verified once, an EAR bound to
both runner keys, signed by the key ``/.well-known/jwks.json`` publishes, verified here with
PyJWT (not the code that signs it); every outcome leaves one ``attestation`` record."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest

from broker.attestation.ear import CLAIM, EAR_PROFILE, MEDIA_TYPE
from broker.client.unwrap import new_ephemeral_key
from broker.core.binding import attestation_thumbprint
from broker.crypto.jwk import public_jwk, thumbprint
from tests.integration.conftest import RunningBroker, write_statement_key
from tests.support.constants import ALLOWED

ATTEST_TOML = '[attest]\nenabled = true\nsigning_key = "ear-signing.pem"\nttl_seconds = 120\n'


def with_result_key(workdir: Path) -> None:
    write_statement_key(workdir / "ear-signing.pem")  # an EC P-256 PEM


async def attest_broker(start_broker: Callable[..., Any]) -> RunningBroker:
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML, workdir_setup=with_result_key
    )
    return broker


async def attest_body(
    session: aiohttp.ClientSession,
    broker: RunningBroker,
    *,
    digest: str = ALLOWED,
    bind: Callable[[str, str], str] = attestation_thumbprint,
) -> dict[str, Any]:
    async with session.post(broker.url + "/v1/challenge", json={}, ssl=broker.client_tls) as r:
        challenge = await r.json()
    pop = public_jwk(new_ephemeral_key("EC-P256").public_key())
    encryption = public_jwk(new_ephemeral_key("X25519").public_key())
    binding = bind(thumbprint(encryption), thumbprint(pop))
    token = await broker.token_source(digest).token(
        challenge["audience"], [challenge["nonce"], binding]
    )
    return {
        "nonce": challenge["nonce"],
        "evidence": {"gca": token},
        "runner_key": encryption,
        "pop_key": pop,
    }


async def post(
    session: aiohttp.ClientSession, broker: RunningBroker, body: dict[str, Any]
) -> tuple[int, str, dict[str, str]]:
    async with session.post(
        broker.url + "/v1/attest", json=body, ssl=broker.client_tls
    ) as response:
        return response.status, await response.text(), dict(response.headers)


async def test_an_attestation_result_verifies_with_the_published_key(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        body = await attest_body(session, broker)
        status, text, headers = await post(session, broker, body)
        assert status == 201, text
        assert headers["Content-Type"] == MEDIA_TYPE
        async with session.get(
            broker.url + "/.well-known/jwks.json", ssl=broker.client_tls
        ) as response:
            jwks = await response.json()
    header = jwt.get_unverified_header(text)
    (key,) = [k for k in jwks["keys"] if k["kid"] == header["kid"]]
    claims = jwt.decode(
        text,
        jwt.PyJWK(key).key,
        algorithms=["ES256"],
        audience=broker.settings.server.audience,
        issuer=broker.settings.server.audience,
    )
    assert claims["eat_profile"] == EAR_PROFILE
    assert claims["cnf"]["jwk"] == body["pop_key"]
    assert claims[CLAIM]["encryption_key"] == body["runner_key"]
    assert claims["submods"]["cpu0"]["ear_status"] == "affirming"
    assert claims["ear_status"] == "affirming"
    assert claims["eat_nonce"] == body["nonce"]
    assert 0 < claims["exp"] - claims["iat"] <= 120
    assert headers["Location"] == f"/v1/attestations/{claims['jti']}"
    assert body["evidence"]["gca"] not in json.dumps(claims)  # digests only, never evidence
    assert claims[CLAIM]["evidence_digests"]["gca"].startswith("sha256:")
    (record,) = [r for r in broker.records() if r.get("type") == "attestation"]
    assert record["result"] == "allow"
    assert record["jti"] == claims["jti"]
    assert record["pop_key_thumbprint"] == thumbprint(body["pop_key"])
    assert record["submods"] == {"cpu0": "affirming"}


async def test_evidence_bound_to_one_key_gets_no_result(start_broker: Callable[..., Any]) -> None:
    """A token bound as for a release (the encryption key's thumbprint alone) does not bind the
    proof-of-possession key: refused, so a result always names keys the TEE chose together."""
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        body = await attest_body(session, broker, bind=lambda encryption, pop: encryption)
        status, text, _ = await post(session, broker, body)
    assert status == 401, text
    assert json.loads(text)["error"]["code"] == "key_binding_mismatch"
    (record,) = [r for r in broker.records() if r.get("type") == "attestation"]
    assert record["result"] == "deny"
    assert record["code"] == "key_binding_mismatch"


async def test_forged_attestation_evidence_spends_no_nonce(
    start_broker: Callable[..., Any],
) -> None:
    """Issue 27: junk carrying someone's fresh challenge spends nothing; the genuine request with
    that challenge then gets its result, once."""
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        body = await attest_body(session, broker)
        token = body["evidence"]["gca"]
        forged = {
            **body,
            "evidence": {"gca": token[:-4] + ("AAAA" if token[-4:] != "AAAA" else "BBBB")},
        }
        forged_status, forged_text, _ = await post(session, broker, forged)
        status, text, _ = await post(session, broker, body)
        replay_status, replay, _ = await post(session, broker, body)
    assert forged_status == 401, forged_text
    assert json.loads(forged_text)["error"]["code"] == "token_signature_invalid"
    assert status == 201, text
    assert (replay_status, json.loads(replay)["error"]["code"]) == (401, "nonce_reused")


async def test_the_attestation_policy_decides_and_says_why(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        body = await attest_body(session, broker, digest="sha256:" + "9" * 64)
        status, text, _ = await post(session, broker, body)
        replay_status, replay, _ = await post(session, broker, body)  # the nonce is spent
    assert status == 403, text
    error = json.loads(text)["error"]
    assert error["code"] == "policy_denied"
    assert any("is not allowed for any key" in r for r in error["reasons"])
    assert replay_status == 401
    assert json.loads(replay)["error"]["code"] == "nonce_reused"
    records = [r for r in broker.records() if r.get("type") == "attestation"]
    assert [r["result"] for r in records] == ["deny", "deny"]
    assert records[0]["reasons"] == error["reasons"]


async def test_a_pop_key_must_be_p256(start_broker: Callable[..., Any]) -> None:
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        body = await attest_body(session, broker)
        body["pop_key"] = public_jwk(new_ephemeral_key("X25519").public_key())
        status, text, _ = await post(session, broker, body)
    assert status == 400, text
    assert json.loads(text)["error"]["code"] == "runner_key_invalid"


async def test_attestation_results_are_off_by_default(broker: RunningBroker) -> None:
    async with aiohttp.ClientSession() as session:
        status, text, _ = await post(session, broker, {"nonce": "n"})
        async with session.get(
            broker.url + "/.well-known/jwks.json", ssl=broker.client_tls
        ) as response:
            jwks = await response.json()
    assert status == 404, text
    assert json.loads(text)["error"]["code"] == "not_found"
    assert jwks == {"keys": []}


ADMIN_TOKEN = "attest-admin-token-0123456789"


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_a_revocation_is_seen_by_every_worker_and_logged(
    start_broker: Callable[..., Any],
) -> None:
    """Revoked through one worker (key-admin), seen through any: the status lives in the shared
    store ([nonces] store: SQLite for --workers 2), and the revocation is a log record."""
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML,
        workdir_setup=with_result_key,
        environ={"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()},
    )
    tls = broker.client_tls
    async with aiohttp.ClientSession() as session:
        status, token, _ = await post(session, broker, await attest_body(session, broker))
        assert status == 201, token
        jti = jwt.decode(token, options={"verify_signature": False})["jti"]
        states = []
        for _ in range(6):  # several connections: with two workers, both answer
            async with (
                aiohttp.ClientSession() as other,
                other.get(f"{broker.url}/v1/attestations/{jti}", ssl=tls) as response,
            ):
                states.append((response.status, (await response.json())["status"]))
        assert set(states) == {(200, "active")}
        revoke_url = f"{broker.url}/v1/admin/attestations/{jti}/revoke"
        async with session.post(revoke_url, json={"reason": "x"}, ssl=tls) as response:
            assert response.status == 401  # no credential, no revocation
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with session.post(
            revoke_url, json={"reason": "image withdrawn"}, headers=headers, ssl=tls
        ) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["status"] == "revoked"
        for _ in range(6):  # the public sees the status; the reason needs a credential
            async with (
                aiohttp.ClientSession() as other,
                other.get(f"{broker.url}/v1/attestations/{jti}", ssl=tls) as response,
            ):
                seen = await response.json()
            assert seen["status"] == "revoked"
            assert "reason" not in seen, seen
            async with (
                aiohttp.ClientSession() as other,
                other.get(
                    f"{broker.url}/v1/attestations/{jti}", headers=headers, ssl=tls
                ) as response,
            ):
                seen = await response.json()
            assert (seen["status"], seen["reason"]) == ("revoked", "image withdrawn")
        async with session.get(
            f"{broker.url}/v1/attestations/00000000-0000-0000-0000-000000000000", ssl=tls
        ) as response:
            assert response.status == 404
    (revocation,) = [r for r in broker.records() if r.get("type") == "attestation_revoked"]
    assert (revocation["jti"], revocation["reason"]) == (jti, "image withdrawn")
    assert revocation["who"]


RESULT_VERSION = (
    "projects/broker-test/locations/global/keyRings/broker/cryptoKeys/results/cryptoKeyVersions/1"
)


async def test_results_signed_by_a_cloud_kms_key(
    start_broker: Callable[..., Any], fake_kms: Any
) -> None:
    """The result key in Cloud KMS (the real google-cloud-kms client over gRPC to a loopback
    KMS): the EAR verifies with the version's public key, as the JWKS publishes it."""
    fake_kms.create_ec_signing_key(RESULT_VERSION)
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML.replace('"ear-signing.pem"', f'"cloudkms:{RESULT_VERSION}"'),
        environ={
            "BROKER_KEYS_KMS_ENDPOINT": fake_kms.endpoint,
            "BROKER_KEYS_UPSTREAM_TIMEOUT_SECONDS": "2",
        },
    )
    async with aiohttp.ClientSession() as session:
        status, token, _ = await post(session, broker, await attest_body(session, broker))
        assert status == 201, token
        async with session.get(
            broker.url + "/.well-known/jwks.json", ssl=broker.client_tls
        ) as response:
            (published,) = (await response.json())["keys"]
        fake_kms.unavailable = True  # the KMS is down: no result, an error record, 503
        down, text, _ = await post(session, broker, await attest_body(session, broker))
    kms_public = fake_kms.signing_keys[RESULT_VERSION].public_key()
    claims = jwt.decode(
        token, kms_public, algorithms=["ES256"], audience=broker.settings.server.audience
    )
    assert jwt.get_unverified_header(token)["kid"] == published["kid"]
    assert jwt.PyJWK(published).key.public_numbers() == kms_public.public_numbers()
    assert "AsymmetricSign" in fake_kms.calls
    assert down == 503, text
    results = [r["result"] for r in broker.records() if r.get("type") == "attestation"]
    assert results == ["allow", "error"]
    assert claims["jti"]
