"""EAR claims (draft-ietf-rats-ear-04) checked against a JSON Schema written from the draft's
CDDL (``EAR_SCHEMA`` below, JSON serialisation), signed here with ``sign_ear`` and verified by
two JOSE libraries the broker does not sign with (PyJWT and jwcrypto)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import jsonschema
import jwt
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from jwcrypto import jwk as jw_jwk
from jwcrypto import jwt as jw_jwt

from broker.attestation.ear import (
    CLAIM,
    EAR_PROFILE,
    LEGACY_PROFILE,
    MEDIA_TYPE,
    Submod,
    ear_claims,
    overall_status,
    sign_ear,
    status_of,
    verify_ear,
)
from broker.core.errors import AttestationError
from broker.crypto.jwk import public_jwk, thumbprint

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
AUDIENCE = "https://broker.example"

# The draft's CDDL (§3, JSON serialisation) as a JSON Schema: ear-claims with the submods map,
# each ear-appraisal with its status, trustworthiness vector (AR4SI claims, -128..127) and
# policy ids; plus the JWT claims and RFC 7800 cnf this profile adds.
TIER = {"enum": ["none", "affirming", "warning", "contraindicated"]}
VECTOR_VALUE = {"type": "integer", "minimum": -128, "maximum": 127}
VECTOR_NAMES = [
    "instance-identity",
    "configuration",
    "executables",
    "file-system",
    "hardware",
    "runtime-opaque",
    "storage-opaque",
    "sourced-data",
]
APPRAISAL = {
    "type": "object",
    "required": ["ear_status"],
    "properties": {
        "ear_status": TIER,
        "ear_trustworthiness_vector": {
            "type": "object",
            "properties": dict.fromkeys(VECTOR_NAMES, VECTOR_VALUE),
            "additionalProperties": False,
        },
        "ear_appraisal_policy_ids": {
            "type": "array",
            "items": {"type": "string"},
            "minItems": 1,
        },
    },
}
DRAFT_REQUIRED = ("eat_profile", "iat", "ear_verifier_id", "submods")
PROFILE_REQUIRED = ("exp", "iss", "aud", "jti", "eat_nonce", "cnf", CLAIM)
EAR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [*DRAFT_REQUIRED, *PROFILE_REQUIRED],
    "properties": {
        "eat_profile": {"const": EAR_PROFILE},
        "iat": {"type": "integer"},
        "exp": {"type": "integer"},
        "ear_verifier_id": {
            "type": "object",
            "required": ["developer", "build"],
            "properties": {"developer": {"type": "string"}, "build": {"type": "string"}},
        },
        "ear_status": TIER,
        "eat_nonce": {"type": "string", "minLength": 8, "maxLength": 88},
        "submods": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": APPRAISAL,
            "propertyNames": {"pattern": "^(cpu|gpu)[0-9]+$"},
        },
        "cnf": {
            "type": "object",
            "required": ["jwk"],
            "properties": {"jwk": {"type": "object", "required": ["kty"]}},
        },
        CLAIM: {
            "type": "object",
            "required": ["encryption_key", "policy_digest", "evidence_digests"],
        },
    },
}


def raw_signer(key: ec.EllipticCurvePrivateKey) -> Any:
    def sign(data: bytes) -> bytes:
        r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")

    return sign


def claims_for(gpus: int = 1, **overrides: Any) -> dict[str, Any]:
    runner_pop = ec.generate_private_key(ec.SECP256R1())
    runner_enc = ec.generate_private_key(ec.SECP256R1())
    vector = {"instance-identity": 2, "hardware": 2, "executables": 2, "configuration": 2}
    policy = "sha256:" + "a" * 64
    submods = [Submod("cpu0", "affirming", vector, [policy])]
    submods += [Submod(f"gpu{i}", "affirming", {"hardware": 2}, [policy]) for i in range(gpus)]
    arguments: dict[str, Any] = {
        "issuer": "https://broker.example",
        "audience": AUDIENCE,
        "jti": "6f1c2a6e-4a3e-4cf1-9a57-0d1b3c7e9f10",
        "now": NOW,
        "ttl": timedelta(seconds=300),
        "not_after": NOW + timedelta(hours=1),
        "nonce": "n" * 43,
        "verifier_build": "sealed-runner-broker 0.1",
        "submods": submods,
        "pop_jwk": public_jwk(runner_pop.public_key()),
        "encryption_jwk": public_jwk(runner_enc.public_key()),
        "policy_digest": policy,
        # one digest per piece of evidence as sent (attestation.service.evidence_digests)
        "evidence_digests": {"gca": "sha256:" + "b" * 64, "nvidia": "sha256:" + "c" * 64},
    }
    arguments.update(overrides)
    return ear_claims(**arguments)


@pytest.fixture(scope="module")
def signing_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def test_the_claims_follow_the_drafts_schema() -> None:
    claims = claims_for(gpus=2)
    jsonschema.validate(claims, EAR_SCHEMA)
    assert claims["ear_status"] == "affirming"
    assert set(claims["submods"]) == {"cpu0", "gpu0", "gpu1"}
    assert MEDIA_TYPE == 'application/eat+jwt; eat_profile="tag:ietf.org,2026:rats/ear#04"'


def test_two_independent_jose_libraries_verify_the_signed_ear(
    signing_key: ec.EllipticCurvePrivateKey,
) -> None:
    claims = claims_for()
    token = sign_ear(claims, kid="ear-1", sign=raw_signer(signing_key))
    decoded = jwt.decode(
        token,
        signing_key.public_key(),
        algorithms=["ES256"],
        audience=AUDIENCE,
        options={"verify_exp": False, "verify_iat": False},
    )
    assert decoded == claims
    assert jwt.get_unverified_header(token) == {"alg": "ES256", "kid": "ear-1", "typ": "eat+jwt"}
    public = jw_jwk.JWK.from_pyca(signing_key.public_key())
    verified = jw_jwt.JWT(jwt=token, key=public, algs=["ES256"], check_claims=False)
    assert json.loads(verified.claims) == claims
    other = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(token, other.public_key(), algorithms=["ES256"], audience=AUDIENCE)


def test_eight_gpus_fit_in_four_kib(signing_key: ec.EllipticCurvePrivateKey) -> None:
    token = sign_ear(claims_for(gpus=8), kid="ear-1", sign=raw_signer(signing_key))
    assert len(token) < 4096, len(token)


def test_expiry_is_the_earliest_of_the_ttl_and_the_evidence() -> None:
    assert claims_for()["exp"] - claims_for()["iat"] == 300
    early = claims_for(not_after=NOW + timedelta(seconds=42))
    assert early["exp"] == int(NOW.timestamp()) + 42
    with pytest.raises(ValueError, match="expires"):
        claims_for(not_after=NOW)
    for ttl in (timedelta(0), timedelta(seconds=901)):
        with pytest.raises(ValueError, match="lives"):
            claims_for(ttl=ttl)


def test_the_overall_status_is_the_worst_submodule() -> None:
    claims = claims_for(
        submods=[Submod("cpu0", "affirming"), Submod("gpu0", "warning"), Submod("gpu1", "none")]
    )
    assert claims["ear_status"] == "warning"
    assert overall_status([]) == "none"
    assert [status_of(v) for v in (0, 1, 2, 31, 32, 95, 96, 127, -2, -96)] == [
        "none", "none", "affirming", "affirming", "warning", "warning",
        "contraindicated", "contraindicated", "affirming", "contraindicated",
    ]  # fmt: skip


def test_refused_shapes() -> None:
    with pytest.raises(ValueError, match="status"):
        claims_for(submods=[Submod("cpu0", "fine")])
    with pytest.raises(ValueError, match="trustworthiness"):
        claims_for(submods=[Submod("cpu0", "affirming", {"vibes": 2})])
    with pytest.raises(ValueError, match="labelled once"):
        claims_for(submods=[Submod("cpu0", "affirming"), Submod("cpu0", "affirming")])
    with pytest.raises(ValueError, match="64 bytes"):
        sign_ear(claims_for(), kid="k", sign=lambda data: b"short")


def test_legacy_names_for_veraison_and_trustee_policies() -> None:
    claims = claims_for(legacy=True)
    assert claims["eat_profile"] == LEGACY_PROFILE
    cpu = claims["submods"]["cpu0"]
    assert cpu["ear.status"] == "affirming"
    assert cpu["ear.trustworthiness-vector"]["hardware"] == 2
    assert cpu["ear.appraisal-policy-id"] == "sha256:" + "a" * 64
    assert "ear.verifier-id" in claims
    assert "ear_status" not in json.dumps(claims)


def signed(key: ec.EllipticCurvePrivateKey, claims: dict[str, Any], **header: Any) -> str:
    """``sign_ear``'s token, or one with the header changed (alg swaps, typ, kid)."""
    token = sign_ear(claims, kid=header.pop("kid", "ear-1"), sign=raw_signer(key))
    if not header:
        return token
    head, body, signature = token.split(".")
    fields = {**json.loads(_b64d(head)), **header}
    return f"{_b64e(json.dumps(fields).encode())}.{body}.{signature}"


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64d(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def test_a_presented_ear_verifies_and_names_its_pop_key(
    signing_key: ec.EllipticCurvePrivateKey,
) -> None:
    claims = claims_for()
    presented = verify_ear(
        signed(signing_key, claims),
        keys={"ear-1": signing_key.public_key()},
        audience=AUDIENCE,
        now=NOW + timedelta(seconds=10),
    )
    assert presented.jti == claims["jti"]
    pop = claims["cnf"]["jwk"]
    assert presented.pop_thumbprint == thumbprint({k: pop[k] for k in ("crv", "kty", "x", "y")})
    assert presented.expires_at == NOW + timedelta(seconds=300)


def test_hostile_presented_ears_are_refused(signing_key: ec.EllipticCurvePrivateKey) -> None:
    """An EAR from another broker's key, alg swaps, another audience, expired, too long, no
    PoP key, tampered: each refused with the code of the check that failed."""
    keys = {"ear-1": signing_key.public_key()}
    other = ec.generate_private_key(ec.SECP256R1())
    good = claims_for()
    head, _, signature = signed(signing_key, good).split(".")
    tampered_body = _b64e(json.dumps({**good, "aud": "https://elsewhere.example"}).encode())
    long_lived = {**good, "exp": good["iat"] + 3600}
    no_cnf = {k: v for k, v in good.items() if k != "cnf"}
    other_audience = {**good, "aud": "https://b.example"}
    rsa_cnf = {**good, "cnf": {"jwk": {"kty": "RSA"}}}
    cases: list[tuple[str, str, datetime, str]] = [
        ("another broker, unknown kid", signed(other, good, kid="ear-9"), NOW, "token_key_unknown"),
        ("another key, our kid", signed(other, good), NOW, "token_signature_invalid"),
        ("alg none", signed(signing_key, good, alg="none"), NOW, "token_algorithm_forbidden"),
        ("alg HS256", signed(signing_key, good, alg="HS256"), NOW, "token_algorithm_forbidden"),
        ("alg ES384", signed(signing_key, good, alg="ES384"), NOW, "token_algorithm_forbidden"),
        ("typ JWT", signed(signing_key, good, typ="JWT"), NOW, "token_malformed"),
        ("jwk header", signed(signing_key, good, jwk={"kty": "EC"}), NOW, "token_header_forbidden"),
        ("other audience", signed(signing_key, other_audience), NOW, "audience_mismatch"),
        ("expired", signed(signing_key, good), NOW + timedelta(seconds=400), "token_expired"),
        ("lives too long", signed(signing_key, long_lived), NOW, "token_claim_invalid"),
        ("no cnf", signed(signing_key, no_cnf), NOW, "token_claim_missing"),
        ("cnf RSA", signed(signing_key, rsa_cnf), NOW, "token_malformed"),
        ("tampered", f"{head}.{tampered_body}.{signature}", NOW, "token_signature_invalid"),
        ("not a token", "x.y", NOW, "token_malformed"),
    ]  # fmt: skip
    for name, token, now, code in cases:
        with pytest.raises(AttestationError) as caught:
            verify_ear(token, keys=keys, audience=AUDIENCE, now=now)
        assert (caught.value.status, caught.value.code.value) == (401, code), name
