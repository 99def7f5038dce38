"""JWE wrap/unwrap, cross-checked against jwcrypto (an independent implementation)."""

from __future__ import annotations

import json
import os

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa, x25519
from jwcrypto import jwe as jw_jwe
from jwcrypto import jwk as jw_jwk

from broker.client.unwrap import new_ephemeral_key, unwrap_release
from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import ErrorCode, InputError
from broker.crypto import jwe
from broker.crypto.jwk import parse_runner_key, public_jwk, x25519_small_order
from broker.crypto.wrap import wrap_to_runner

KEY_TYPES = ["EC-P256", "EC-P384", "X25519", "RSA-3072"]


def runner(key_type: str) -> tuple[jwe.RunnerPrivateKey, object]:
    private = new_ephemeral_key(key_type)
    return private, parse_runner_key(public_jwk(private.public_key()))


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_wrap_roundtrip_binds_kid_and_decision(key_type: str) -> None:
    private, runner_key = runner(key_type)
    dek = os.urandom(32)
    token = wrap_to_runner(dek, runner_key, name="models/a", version=3, decision_id="d-1")  # type: ignore[arg-type]
    body = {"key": "models/a", "version": 3, "decision_id": "d-1", "wrapped_key": token}
    released = unwrap_release(body, private, expected_key="models/a", expected_version=None)
    assert released.dek == dek
    header = json.loads(b64url_decode(token.split(".")[0]))
    assert header["kid"] == "models/a#3"
    assert header["decision_id"] == "d-1"
    assert header["alg"] == ("RSA-OAEP-256" if key_type.startswith("RSA") else "ECDH-ES+A256KW")
    assert header["enc"] == "A256GCM"


def _jwcrypto_key(private: jwe.RunnerPrivateKey) -> jw_jwk.JWK:
    return jw_jwk.JWK.from_pyca(private)


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_jwcrypto_decrypts_what_we_encrypt(key_type: str) -> None:
    private, runner_key = runner(key_type)
    token = jwe.encrypt(b"secret-dek-bytes", runner_key, {"kid": "k#1"})  # type: ignore[arg-type]
    message = jw_jwe.JWE()
    message.deserialize(token, key=_jwcrypto_key(private))
    assert message.payload == b"secret-dek-bytes"


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_we_decrypt_what_jwcrypto_encrypts(key_type: str) -> None:
    private, _ = runner(key_type)
    alg = "RSA-OAEP-256" if key_type.startswith("RSA") else "ECDH-ES+A256KW"
    public = jw_jwk.JWK.from_pyca(private.public_key())
    message = jw_jwe.JWE(b"from-jwcrypto", json.dumps({"alg": alg, "enc": "A256GCM", "kid": "x"}))
    message.add_recipient(public)
    decrypted = jwe.decrypt(message.serialize(compact=True), private)
    assert decrypted.plaintext == b"from-jwcrypto"


def test_tampered_protected_header_fails_authentication() -> None:
    private, runner_key = runner("EC-P256")
    token = jwe.encrypt(b"k" * 32, runner_key, {"kid": "models/a#1", "decision_id": "d"})  # type: ignore[arg-type]
    header = json.loads(b64url_decode(token.split(".")[0]))
    header["kid"] = "models/b#1"
    forged = b64url_encode(json.dumps(header, separators=(",", ":")).encode())
    with pytest.raises(jwe.JweError):
        jwe.decrypt(".".join([forged, *token.split(".")[1:]]), private)


def test_wrapped_key_for_another_runner_does_not_decrypt() -> None:
    _, runner_key = runner("EC-P256")
    other_private, _ = runner("EC-P256")
    token = jwe.encrypt(b"k" * 32, runner_key, {})  # type: ignore[arg-type]
    with pytest.raises(jwe.JweError):
        jwe.decrypt(token, other_private)


def test_client_refuses_wrapped_key_naming_another_release() -> None:
    private, runner_key = runner("X25519")
    token = wrap_to_runner(b"k" * 32, runner_key, name="models/a", version=1, decision_id="d-1")  # type: ignore[arg-type]
    body = {"key": "models/a", "version": 1, "decision_id": "d-2", "wrapped_key": token}
    with pytest.raises(jwe.JweError):
        unwrap_release(body, private, expected_key="models/a", expected_version=None)


def test_runner_key_with_private_member_rejected() -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    jwk = public_jwk(private.public_key())
    with pytest.raises(InputError) as caught:
        parse_runner_key({**jwk, "d": "AAAA"})
    assert caught.value.code is ErrorCode.RUNNER_KEY_INVALID


def test_small_rsa_runner_key_rejected() -> None:
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(InputError):
        parse_runner_key(public_jwk(small.public_key()))


def test_off_curve_runner_key_rejected() -> None:
    jwk = public_jwk(ec.generate_private_key(ec.SECP256R1()).public_key())
    y = bytearray(b64url_decode(jwk["y"]))
    y[-1] ^= 1
    with pytest.raises(InputError):
        parse_runner_key({**jwk, "y": b64url_encode(bytes(y))})


@pytest.mark.parametrize(
    "jwk",
    [
        None,
        {"kty": "oct", "k": "AAAA"},
        {"kty": "EC", "crv": "P-521", "x": "AA", "y": "AA"},
        {"kty": "OKP", "crv": "Ed25519", "x": "A" * 43},
        {"kty": "OKP", "crv": "X25519", "x": "A" * 10},
        {"kty": "RSA", "n": "!!", "e": "AQAB"},
    ],
)
def test_unusable_runner_keys_rejected(jwk: object) -> None:
    with pytest.raises(InputError):
        parse_runner_key(jwk)


def test_thumbprint_matches_rfc7638_example() -> None:
    # RFC 7638 §3.1 example key and its published thumbprint.
    n = (
        "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECP"
        "ebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY"
        "368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0f"
        "M4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw"
    )
    parsed = parse_runner_key({"kty": "RSA", "n": n, "e": "AQAB", "alg": "RS256", "kid": "x"})
    assert parsed.thumbprint == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs"


def test_x25519_thumbprint_uses_required_members_only() -> None:
    key = x25519.X25519PrivateKey.generate().public_key()
    jwk = public_jwk(key)
    assert parse_runner_key({**jwk, "use": "enc"}).thumbprint == parse_runner_key(jwk).thumbprint


# --- the small-order set against the reference test (a key agreement) ------------------------

_P = 2**255 - 19
_ORACLE = x25519.X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))


def _agreement_refused(raw: bytes) -> bool:
    """The reference: OpenSSL refuses the all-zero secret, which a clamped scalar yields
    exactly for the small-order points (RFC 7748 §6.1)."""
    try:
        _ORACLE.exchange(x25519.X25519PublicKey.from_public_bytes(raw))
    except ValueError:
        return True
    return False


def _encodings(u: int) -> list[bytes]:
    """Every 32-byte spelling X25519 reads as ``u``: canonical, + p when it fits, top bit set."""
    values = [u] + ([u + _P] if u + _P < 2**255 else [])
    return [(v | high).to_bytes(32, "little") for v in values for high in (0, 1 << 255)]


def test_small_order_set_agrees_with_a_key_agreement() -> None:
    small = [0, 1, _P - 1]
    small += [
        int.from_bytes(bytes.fromhex(h), "little")
        for h in (
            "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
            "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
        )
    ]
    candidates = [raw for u in small for raw in _encodings(u)]
    candidates += [raw for u in small for d in (-2, -1, 1, 2) for raw in _encodings((u + d) % _P)]
    candidates += [os.urandom(32) for _ in range(3000)]
    refused = 0
    for raw in candidates:
        assert x25519_small_order(raw) is _agreement_refused(raw), raw.hex()
        refused += x25519_small_order(raw)
    assert refused >= 5 * 2 + 2 * 2  # every listed point in each of its spellings
