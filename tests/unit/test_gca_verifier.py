"""The GCA verifier against forged and broken tokens: one test per attack."""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import timedelta

import pytest
from cryptography.hazmat.primitives import serialization

from broker.attestation.gca import GcaTrust, verify_gca_token
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.jwks import parse_jwks
from tests.vectors import tokens as v

KEYS = parse_jwks(json.dumps(v.jwks()).encode())


def verify(token: str, **overrides: object) -> object:
    trust = GcaTrust(
        issuer=v.ISSUER,
        algorithms=overrides.pop("algorithms", ("RS256",)),  # type: ignore[arg-type]
        keys=overrides.pop("keys", KEYS),  # type: ignore[arg-type]
    )
    params: dict[str, object] = {
        "audience": v.AUDIENCE,
        "now": v.NOW,
        "leeway": timedelta(seconds=30),
    }
    params.update(overrides)
    return verify_gca_token(token, trust=trust, **params)  # type: ignore[arg-type]


def rejected(token: str, code: ErrorCode, **overrides: object) -> None:
    with pytest.raises(AttestationError) as caught:
        verify(token, **overrides)
    assert caught.value.code is code, caught.value.message
    assert caught.value.status == 401


def test_valid_token_verifies_with_its_claims() -> None:
    verified = verify(v.sign(v.claims()))
    assert verified.claims["submods"]["container"]["image_digest"] == v.DIGEST  # type: ignore[attr-defined]
    assert verified.kid == v.KID  # type: ignore[attr-defined]


def test_alg_none_rejected() -> None:
    token = v.unsigned({"alg": "none", "kid": v.KID}, v.claims())
    rejected(token, ErrorCode.TOKEN_ALGORITHM_FORBIDDEN)


def test_alg_none_with_signature_stripped_from_real_shape_rejected() -> None:
    good = v.sign(v.claims())
    header_none = v.b64(json.dumps({"alg": "none", "kid": v.KID, "typ": "JWT"}).encode())
    rejected(header_none + "." + good.split(".")[1] + ".", ErrorCode.TOKEN_ALGORITHM_FORBIDDEN)


def test_hs256_with_public_key_rejected() -> None:
    public_pem = (
        v.key()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    header = v.b64(json.dumps({"alg": "HS256", "kid": v.KID}).encode())
    payload = v.b64(json.dumps(v.claims()).encode())
    mac = hmac.new(public_pem, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    rejected(f"{header}.{payload}.{v.b64(mac)}", ErrorCode.TOKEN_ALGORITHM_FORBIDDEN)


def test_hs256_rejected_even_if_issuer_config_lists_it() -> None:
    # The verifier never lets PyJWT treat an RSA public key as an HMAC secret.
    header = v.b64(json.dumps({"alg": "HS256", "kid": v.KID}).encode())
    payload = v.b64(json.dumps(v.claims()).encode())
    with pytest.raises(AttestationError):
        verify(f"{header}.{payload}.{v.b64(b'x' * 32)}", algorithms=("RS256", "HS256"))


@pytest.mark.parametrize("alg", ["RS512", "PS256", "ES256"])
def test_algorithm_outside_allow_list_rejected(alg: str) -> None:
    token = v.unsigned({"alg": alg, "kid": v.KID}, v.claims(), b"sig")
    rejected(token, ErrorCode.TOKEN_ALGORITHM_FORBIDDEN)


def test_unknown_kid_rejected() -> None:
    rejected(v.sign(v.claims(), headers={"kid": "not-published"}), ErrorCode.TOKEN_KEY_UNKNOWN)


def test_missing_kid_rejected() -> None:
    token = v.unsigned({"alg": "RS256"}, v.claims(), b"sig")
    rejected(token, ErrorCode.TOKEN_MALFORMED)


@pytest.mark.parametrize("header", ["jku", "x5u", "jwk", "crit"])
def test_key_naming_and_crit_headers_rejected(header: str) -> None:
    value: object = (
        {"kty": "RSA"}
        if header == "jwk"
        else (["exp"] if header == "crit" else "https://attacker.invalid/keys")
    )
    token = v.sign(v.claims(), headers={header: value})
    rejected(token, ErrorCode.TOKEN_HEADER_FORBIDDEN)


def test_jku_pointing_at_attacker_keys_rejected() -> None:
    token = v.sign(
        v.claims(), headers={"jku": "https://attacker.invalid/jwks"}, signer="attacker_rsa.pem"
    )
    rejected(token, ErrorCode.TOKEN_HEADER_FORBIDDEN)


def test_x5c_token_refused_by_oidc_issuer() -> None:
    rejected(v.sign(v.claims(), headers={"x5c": ["AAAA"]}), ErrorCode.TOKEN_HEADER_FORBIDDEN)


def test_token_signed_by_attacker_key_with_trusted_kid_rejected() -> None:
    rejected(v.sign(v.claims(), signer="attacker_rsa.pem"), ErrorCode.TOKEN_SIGNATURE_INVALID)


def test_tampered_payload_rejected() -> None:
    header, _, signature = v.sign(v.claims()).split(".")
    forged = v.claims(submods={"container": {"image_digest": "sha256:" + "cd" * 32}})
    payload = v.b64(json.dumps(forged).encode())
    rejected(f"{header}.{payload}.{signature}", ErrorCode.TOKEN_SIGNATURE_INVALID)


def test_flipped_signature_byte_rejected() -> None:
    header, payload, signature = v.sign(v.claims()).split(".")
    flipped = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    rejected(f"{header}.{payload}.{flipped}", ErrorCode.TOKEN_SIGNATURE_INVALID)


def test_expired_token_rejected() -> None:
    rejected(
        v.sign(v.claims()), ErrorCode.TOKEN_EXPIRED, now=v.NOW + timedelta(hours=1, seconds=31)
    )


def test_expiry_within_leeway_accepted() -> None:
    verify(v.sign(v.claims()), now=v.NOW + timedelta(hours=1, seconds=29))


def test_not_yet_valid_token_rejected() -> None:
    token = v.sign(v.claims(nbf=int(v.NOW.timestamp()) + 600))
    rejected(token, ErrorCode.TOKEN_NOT_YET_VALID)


def test_token_issued_in_future_rejected() -> None:
    issued = int(v.NOW.timestamp()) + 600
    token = v.sign(v.claims(iat=issued, nbf=int(v.NOW.timestamp())))
    rejected(token, ErrorCode.TOKEN_ISSUED_IN_FUTURE)


def test_missing_exp_rejected() -> None:
    payload = v.claims()
    del payload["exp"]
    rejected(v.sign(payload), ErrorCode.TOKEN_CLAIM_MISSING)


def test_string_exp_rejected() -> None:
    token = v.sign(v.claims(exp="9999999999"))
    with pytest.raises(AttestationError):
        verify(token)


def test_wrong_issuer_rejected() -> None:
    rejected(v.sign(v.claims(iss="https://evil.invalid")), ErrorCode.ISSUER_UNKNOWN)


def test_wrong_audience_rejected() -> None:
    rejected(v.sign(v.claims(aud="https://sts.googleapis.com")), ErrorCode.AUDIENCE_MISMATCH)


def test_audience_array_containing_broker_accepted() -> None:
    verify(v.sign(v.claims(aud=["https://other.invalid", v.AUDIENCE])))


def test_jwk_alg_mismatch_rejected() -> None:
    keys = parse_jwks(json.dumps(v.jwks(alg="PS384")).encode())
    rejected(v.sign(v.claims()), ErrorCode.TOKEN_ALGORITHM_FORBIDDEN, keys=keys)


@pytest.mark.parametrize(
    "token",
    ["", "a.b", "a.b.c.d", "!!!.e30.sig", v.b64(b"[1]") + ".e30.sig", "x" * 70000],
)
def test_malformed_tokens_rejected(token: str) -> None:
    with pytest.raises(AttestationError) as caught:
        verify(token)
    assert caught.value.code in {ErrorCode.TOKEN_MALFORMED, ErrorCode.TOKEN_TOO_LARGE}
