"""The pure verifier of the broker's self-attestation (issue 29 item 4): one test per attack,
each showing the check that stops it (``BrokerNotAttested.check``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client.broker_identity import (
    BrokerIdentity,
    BrokerNotAttested,
    verify_broker_attestation,
    verify_token,
)
from broker.dev.issuer import DEV_ISSUER
from tests.support.broker_attestation import (
    AUDIENCE,
    IMAGE,
    OTHER_IMAGE,
    answer,
    key_hash,
    mint,
    pki_token,
    self_signed,
    spki,
)
from tests.support.issuers import dev_issuer

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
ISSUER = dev_issuer()
TLS_KEY = ec.generate_private_key(ec.SECP256R1())
CERT = self_signed(TLS_KEY, NOW)
KEYS = {"tls": spki(TLS_KEY), "statement": spki(ec.generate_private_key(ec.SECP256R1()))}
IDENTITY = BrokerIdentity(
    image_digests=frozenset({IMAGE}),
    jwks=json.dumps(ISSUER.jwks()),
    audience=AUDIENCE,
    issuer=DEV_ISSUER,
)
REAL = Path(__file__).parents[1] / "fixtures" / "real" / "gca"


def refused(
    body: bytes, check: str, *, cert: bytes = CERT, identity: BrokerIdentity = IDENTITY
) -> str:
    with pytest.raises(BrokerNotAttested) as caught:
        verify_broker_attestation(body, cert, identity, now=NOW)
    assert caught.value.check == check, caught.value
    return caught.value.reason


def good(**overrides: object) -> bytes:
    return answer(mint(ISSUER, KEYS, now=NOW, **overrides), KEYS)  # type: ignore[arg-type]


def test_the_expected_broker_image_is_verified_with_its_bound_keys() -> None:
    verified = verify_broker_attestation(good(), CERT, IDENTITY, now=NOW)
    assert verified.image_digest == IMAGE
    assert dict(verified.keys) == KEYS
    assert verified.expires == NOW + timedelta(hours=1)
    assert verified.as_json()["key_sha256"]["tls"] == key_hash(KEYS["tls"])


def test_broker_attested_as_another_image_refused() -> None:
    assert OTHER_IMAGE in refused(good(image=OTHER_IMAGE), "image")


def test_debug_broker_image_refused() -> None:
    refused(good(debug=True), "debug")


def test_expired_attestation_refused() -> None:
    body = answer(mint(ISSUER, KEYS, now=NOW - timedelta(hours=2)), KEYS)
    assert "token_expired" in refused(body, "times")


def test_token_signed_by_another_issuer_key_refused() -> None:
    body = answer(mint(dev_issuer(), KEYS, now=NOW), KEYS)  # its own kid: not in our JWKS
    refused(body, "signature")


def test_tampered_token_payload_refused() -> None:
    token = mint(ISSUER, KEYS, now=NOW)
    head, payload, sig = token.split(".")
    forged = f"{head}.{payload[:-2]}{'A' if payload[-2] != 'A' else 'B'}{payload[-1]}.{sig}"
    refused(answer(forged, KEYS), "signature")


def test_wrong_issuer_refused() -> None:
    identity = BrokerIdentity(
        image_digests=frozenset({IMAGE}), jwks=json.dumps(ISSUER.jwks()), audience=AUDIENCE
    )  # Google's issuer by default: a development token is not Google's
    refused(good(), "issuer", identity=identity)


def test_token_for_another_audience_refused() -> None:
    identity = BrokerIdentity(
        image_digests=frozenset({IMAGE}),
        jwks=json.dumps(ISSUER.jwks()),
        audience="https://another-broker.test",
        issuer=DEV_ISSUER,
    )
    refused(good(), "audience", identity=identity)


def test_token_not_from_confidential_space_software_refused() -> None:
    token = mint(ISSUER, KEYS, now=NOW)
    claims = jwt.decode(token, options={"verify_signature": False})
    claims["swname"] = "GCE"
    refused(answer(ISSUER.sign(claims), KEYS), "software")


def test_confidential_space_image_without_stable_support_refused() -> None:
    token = mint(ISSUER, KEYS, now=NOW)
    claims = jwt.decode(token, options={"verify_signature": False})
    claims["submods"]["confidential_space"]["support_attributes"] = ["LATEST", "USABLE"]
    assert "STABLE" in refused(answer(ISSUER.sign(claims), KEYS), "software")


def test_eat_nonce_missing_one_key_hash_refused() -> None:
    token = mint(ISSUER, KEYS, now=NOW, nonces=[key_hash(KEYS["tls"])])
    assert "statement" in refused(answer(token, KEYS), "nonce")


def test_key_swapped_after_attestation_refused() -> None:
    swapped = {**KEYS, "statement": spki(ec.generate_private_key(ec.SECP256R1()))}
    refused(answer(mint(ISSUER, KEYS, now=NOW), swapped), "nonce")


def test_relay_with_its_own_certificate_and_a_copy_of_the_attestation_refused() -> None:
    relay_cert = self_signed(ec.generate_private_key(ec.SECP256R1()), NOW)
    refused(good(), "tls", cert=relay_cert)


def test_unattested_broker_refused_with_its_reason() -> None:
    body = json.dumps({"attested": False, "reason": "not in a TEE"}).encode()
    assert "not in a TEE" in refused(body, "attested")


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"attested": true}', b'{"attested": true, "token": "x", "keys": {}}'],
)
def test_malformed_answers_refused(body: bytes) -> None:
    with pytest.raises(BrokerNotAttested) as caught:
        verify_broker_attestation(body, CERT, IDENTITY, now=NOW)
    assert caught.value.check in {"response", "keys"}


def test_answer_without_a_bound_tls_key_refused() -> None:
    keys = {"statement": KEYS["statement"]}
    refused(answer(mint(ISSUER, keys, now=NOW), keys), "keys")


def test_pki_form_token_chained_to_the_root_verifies() -> None:
    token, root_pem = pki_token(KEYS, now=NOW)
    identity = BrokerIdentity(
        image_digests=frozenset({IMAGE}), root_pem=root_pem, audience=AUDIENCE, issuer=DEV_ISSUER
    )
    verified = verify_broker_attestation(
        answer(token, KEYS, token_type="PKI"), CERT, identity, now=NOW
    )
    assert (verified.token_type, verified.image_digest) == ("PKI", IMAGE)


def test_pki_form_token_under_another_root_refused() -> None:
    token, _ = pki_token(KEYS, now=NOW)
    _, other_pem = pki_token(KEYS, now=NOW - timedelta(seconds=1))  # a second test PKI
    identity = BrokerIdentity(
        image_digests=frozenset({IMAGE}), root_pem=other_pem, audience=AUDIENCE, issuer=DEV_ISSUER
    )
    refused(answer(token, KEYS, token_type="PKI"), "signature", identity=identity)


def test_oidc_token_refused_when_only_a_pki_root_is_trusted() -> None:
    _, root_pem = pki_token(KEYS, now=NOW)
    identity = BrokerIdentity(
        image_digests=frozenset({IMAGE}), root_pem=root_pem, audience=AUDIENCE, issuer=DEV_ISSUER
    )
    refused(good(), "signature", identity=identity)


def test_real_google_pki_token_passes_the_token_checks() -> None:
    """The PKI path accepts a real Confidential Space token at its issue time (its claims are
    a runner's, not a broker's, so only steps 2-5 apply)."""
    token = (REAL / "cs_pki_token_tdx_2025-04.jwt").read_text().strip()
    identity = BrokerIdentity(
        image_digests=frozenset({IMAGE}),
        root_pem=(REAL / "google_confidential_space_root.crt").read_bytes(),
        audience="https://sts.google.com",
    )
    claims, token_type = verify_token(
        token, identity, now=datetime(2025, 4, 23, 16, 27, 20, tzinfo=UTC)
    )
    assert token_type == "PKI"
    assert claims["swname"] == "CONFIDENTIAL_SPACE"


def test_identity_without_trust_anchor_or_image_is_a_usage_error() -> None:
    with pytest.raises(ValueError, match="jwks"):
        BrokerIdentity(image_digests=frozenset({IMAGE}))
    with pytest.raises(ValueError, match="image"):
        BrokerIdentity(image_digests=frozenset(), jwks="{}")
    with pytest.raises(ValueError, match="sha256"):
        BrokerIdentity(image_digests=frozenset({"latest"}), jwks="{}")
