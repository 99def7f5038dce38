"""Runner public keys as JWKs: strict parsing and RFC 7638 thumbprints.

A runner key is the ephemeral public key made inside the TEE. Releases are wrapped to it, and the
evidence binds its thumbprint, so this parser is strict: public members only, known key types and
curves, RSA of at least 2048 bits, and no extra private members.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric import ec, mlkem, rsa, x25519

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import ErrorCode, InputError

MIN_RSA_BITS = 2048
MAX_RSA_BITS = 8192
EC_CURVES: dict[str, tuple[ec.EllipticCurve, int]] = {
    "P-256": (ec.SECP256R1(), 32),
    "P-384": (ec.SECP384R1(), 48),
}
PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
RunnerPublicKeyObject = (
    rsa.RSAPublicKey
    | ec.EllipticCurvePublicKey
    | x25519.X25519PublicKey
    | hpke.MLKEM768X25519PublicKey
)
HPKE_HYBRID_KEM = "MLKEM768-X25519"
MAX_HPKE_PK_CHARS = 2048


@dataclass(frozen=True)
class RunnerKey:
    """A validated runner public key with its RFC 7638 thumbprint."""

    jwk: Mapping[str, str]  # only the required public members, canonical
    key: RunnerPublicKeyObject
    thumbprint: str  # base64url(SHA-256(canonical JWK))


def _invalid(message: str) -> InputError:
    return InputError(message, code=ErrorCode.RUNNER_KEY_INVALID)


def parse_runner_key(unverified_jwk: Any) -> RunnerKey:
    """Validate a runner's public JWK and compute its thumbprint.

    Raises:
        InputError: ``runner_key_invalid`` naming what is wrong.
    """
    if not isinstance(unverified_jwk, dict):
        raise _invalid("runner_key must be a JWK object")
    if PRIVATE_MEMBERS.intersection(unverified_jwk):
        raise _invalid("runner_key contains private key members; send the public key only")
    kty = unverified_jwk.get("kty")
    try:
        if kty == "EC":
            members, key = _parse_ec(unverified_jwk)
        elif kty == "RSA":
            members, key = _parse_rsa(unverified_jwk)
        elif kty == "OKP":
            members, key = _parse_okp(unverified_jwk)
        elif kty == "HPKE":
            members, key = _parse_hybrid(unverified_jwk)
        else:
            raise _invalid("runner_key kty must be EC, RSA, OKP or HPKE")
    except ValueError as exc:
        raise _invalid("runner_key members are not a valid public key") from exc
    return RunnerKey(jwk=members, key=key, thumbprint=thumbprint(members))


def thumbprint(required_members: Mapping[str, str]) -> str:
    """RFC 7638 SHA-256 thumbprint over the required members, base64url."""
    canonical = json.dumps(dict(sorted(required_members.items())), separators=(",", ":"))
    return b64url_encode(hashlib.sha256(canonical.encode("utf-8")).digest())


def _member(jwk: Mapping[str, Any], name: str) -> str:
    value = jwk.get(name)
    if not isinstance(value, str) or not value:
        raise _invalid(f"runner_key member {name!r} is missing")
    return value


def _parse_ec(jwk: Mapping[str, Any]) -> tuple[dict[str, str], RunnerPublicKeyObject]:
    crv = _member(jwk, "crv")
    if crv not in EC_CURVES:
        raise _invalid("runner_key EC curve must be P-256 or P-384")
    curve, size = EC_CURVES[crv]
    x, y = _member(jwk, "x"), _member(jwk, "y")
    try:
        key = ec_public_key(curve, size, x, y)
    except KeyMembersError as exc:
        raise _invalid(f"runner_key {exc}") from exc
    return {"crv": crv, "kty": "EC", "x": x, "y": y}, key


def _parse_rsa(jwk: Mapping[str, Any]) -> tuple[dict[str, str], RunnerPublicKeyObject]:
    n, e = _member(jwk, "n"), _member(jwk, "e")
    try:
        key = rsa_public_key(n, e, MIN_RSA_BITS, MAX_RSA_BITS)
    except KeyMembersError as exc:
        raise _invalid(f"runner_key {exc}") from exc
    return {"e": e, "kty": "RSA", "n": n}, key


class KeyMembersError(ValueError):
    """A JWK's members do not make a usable public key; the message names what (no prefix)."""


def ec_public_key(curve: ec.EllipticCurve, size: int, x: str, y: str) -> ec.EllipticCurvePublicKey:
    """The EC public key of base64url coordinates ``x``, ``y`` of exactly ``size`` bytes each.

    Raises:
        KeyMembersError: wrong coordinate length, or a point not on the curve.
        ValueError: a coordinate that is not canonical base64url.
    """
    x_bytes, y_bytes = b64url_decode(x), b64url_decode(y)
    if len(x_bytes) != size or len(y_bytes) != size:
        raise KeyMembersError("EC coordinates have the wrong length")
    # from_encoded_point checks that the point is on the curve (invalid-curve attacks);
    # P-256, P-384 and P-521 have cofactor 1, so every point on the curve but infinity (which
    # the uncompressed form cannot express) has full order.
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(curve, b"\x04" + x_bytes + y_bytes)
    except ValueError as exc:
        raise KeyMembersError("EC point is not on the curve") from exc


def rsa_public_key(n: str, e: str, min_bits: int, max_bits: int) -> rsa.RSAPublicKey:
    """The RSA public key of base64url ``n`` and ``e``, its modulus ``min_bits..max_bits``.

    Raises:
        KeyMembersError: a modulus out of range or even, an exponent that is not valid.
        ValueError: a member that is not canonical base64url.
    """
    n_int = int.from_bytes(b64url_decode(n), "big")
    e_int = int.from_bytes(b64url_decode(e), "big")
    if not min_bits <= n_int.bit_length() <= max_bits:
        raise KeyMembersError(f"RSA modulus must be {min_bits}..{max_bits} bits")
    if e_int < 3 or e_int % 2 == 0 or e_int >= n_int:
        raise KeyMembersError("RSA exponent is not valid")
    if n_int % 2 == 0:
        raise KeyMembersError("RSA modulus is even")
    return rsa.RSAPublicNumbers(e_int, n_int).public_key()


def _parse_okp(jwk: Mapping[str, Any]) -> tuple[dict[str, str], RunnerPublicKeyObject]:
    crv = _member(jwk, "crv")
    if crv != "X25519":
        raise _invalid("runner_key OKP curve must be X25519")
    x = _member(jwk, "x")
    raw = b64url_decode(x)
    if len(raw) != 32:
        raise _invalid("runner_key X25519 key must be 32 bytes")
    return {"crv": crv, "kty": "OKP", "x": x}, _x25519_full_order(raw)


def _parse_hybrid(jwk: Mapping[str, Any]) -> tuple[dict[str, str], RunnerPublicKeyObject]:
    if jwk.get("kem") != HPKE_HYBRID_KEM:
        raise _invalid(f"runner_key kty HPKE needs kem {HPKE_HYBRID_KEM}")
    pk = _member(jwk, "pk")
    if len(pk) > MAX_HPKE_PK_CHARS:
        raise _invalid("runner_key pk is too long")
    raw = b64url_decode(pk)
    if len(raw) != 1184 + 32:
        raise _invalid("runner_key pk must be an ML-KEM-768 public key and an X25519 key")
    key = hpke.MLKEM768X25519PublicKey(
        mlkem.MLKEM768PublicKey.from_public_bytes(raw[:1184]),
        _x25519_full_order(raw[1184:]),
    )
    return {"kem": HPKE_HYBRID_KEM, "kty": "HPKE", "pk": pk}, key


# The points of small order (dividing 8) on Curve25519 and its twist have these u-coordinates
# modulo p (RFC 7748 §6.1; libsodium's blocklist): 0, 1, p-1 and the two points of order 8. A
# received u is reduced as X25519 reads it (top bit masked, then mod p), so every non-canonical
# spelling of them is caught too. A key agreement with these yields the all-zero secret.
# tests/unit/test_crypto_jwe.py checks the set against the reference test (an exchange with a
# clamped scalar, which OpenSSL refuses for exactly these points) on the listed points, all
# their encodings, their neighbours and random keys. A set lookup is ~1 µs; the exchange
# took ~35 µs of every release (bench/release_bench.py).
_P25519 = 2**255 - 19
_SMALL_ORDER_U = frozenset(
    {
        0,
        1,
        _P25519 - 1,
        325606250916557431795983626356110631294008115727848805560023387167927233504,
        39382357235489614581723060781553021112529911719440698176882885853963445705823,
    }
)


def x25519_small_order(raw: bytes) -> bool:
    """Whether the 32-byte X25519 public value ``raw`` is a small-order point."""
    return (int.from_bytes(raw, "little") & ((1 << 255) - 1)) % _P25519 in _SMALL_ORDER_U


def _x25519_full_order(raw: bytes) -> x25519.X25519PublicKey:
    key = x25519.X25519PublicKey.from_public_bytes(raw)
    if x25519_small_order(raw):
        raise _invalid("runner_key X25519 key is a small-order point")
    return key


def hybrid_jwk(raw_public: bytes) -> dict[str, str]:
    """The JWK form of a hybrid HPKE public key (ML-KEM-768 public || X25519 public)."""
    return {"kem": HPKE_HYBRID_KEM, "kty": "HPKE", "pk": b64url_encode(raw_public)}


def public_jwk(key: RunnerPublicKeyObject) -> dict[str, str]:
    """The public JWK (required members only) of a key object; used by the runner SDK."""
    if isinstance(key, hpke.MLKEM768X25519PublicKey):
        raise TypeError("hybrid HPKE keys have no raw accessor here; use hybrid_jwk(raw)")
    if isinstance(key, x25519.X25519PublicKey):
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return {"crv": "X25519", "kty": "OKP", "x": b64url_encode(raw)}
    if isinstance(key, ec.EllipticCurvePublicKey):
        numbers = key.public_numbers()
        crv = {"secp256r1": "P-256", "secp384r1": "P-384"}[key.curve.name]
        size = EC_CURVES[crv][1]
        return {
            "crv": crv,
            "kty": "EC",
            "x": b64url_encode(numbers.x.to_bytes(size, "big")),
            "y": b64url_encode(numbers.y.to_bytes(size, "big")),
        }
    rsa_numbers = key.public_numbers()
    return {
        "e": b64url_encode(_int_bytes(rsa_numbers.e)),
        "kty": "RSA",
        "n": b64url_encode(_int_bytes(rsa_numbers.n)),
    }


def _int_bytes(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 7) // 8, "big")
