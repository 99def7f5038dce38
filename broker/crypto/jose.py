"""The one place that verifies JWS/JWT signatures and times.

Our verifiers take ``now`` as a value so that a year-old real token can be verified at its issue
time: this module requires the time claims and checks ``exp``/``nbf``/``iat`` against the
injected ``now`` with one named leeway. Signatures are checked with ``cryptography`` directly
(the token is split and decoded once, with the strict base64url and JSON parsers; PyJWT spent
most of its ~240 µs re-parsing, docs/decisions.md); ``tests/unit/test_jose_reference.py``
compares the result with PyJWT on generated tokens.

Header rules (docs/api.md and docs/threat-model.md):

1. The header is a JSON object of bounded size, parsed by us before any key is chosen.
2. ``alg`` must be in the caller's allow-list (never ``none``, never HMAC for these issuers).
3. ``jku``, ``x5u``, ``jwk`` (keys named by the token) and ``crit`` are refused outright.
4. The key comes only from the caller-provided trust anchors, chosen by ``kid``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from broker.core.encoding import b64url_decode
from broker.core.errors import AttestationError, ErrorCode
from broker.core.jsonsafe import MAX_JSON_DEPTH, loads_bounded

MAX_TOKEN_BYTES = 64 * 1024
MAX_HEADER_BYTES = 16 * 1024
HEADER_DEPTH = 8  # a JOSE header is flat but for x5c (a list of strings)
DEFAULT_LEEWAY = timedelta(seconds=30)
DEFAULT_MAX_LIFETIME = timedelta(hours=1)  # exp - iat; issuers may configure their own
FORBIDDEN_HEADERS = frozenset({"jku", "x5u", "jwk", "crit"})
TIME_CLAIMS = ("exp", "iat", "nbf")


@dataclass(frozen=True)
class UnverifiedHeader:
    """A parsed, not yet trusted JOSE header."""

    alg: str
    kid: str | None
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class VerifiedJws:
    """A token whose signature verified with a trusted key; times checked."""

    header: Mapping[str, Any]
    claims: Mapping[str, Any]


def parse_header(
    token: str, allowed_algorithms: Collection[str], *, tolerated_jku: Collection[str] = ()
) -> UnverifiedHeader:
    """Split a compact JWS and parse its header under the header rules above.

    ``tolerated_jku`` is the one narrow exception: Intel Trust Authority stamps every token with
    ``jku: https://portal.trustauthority.intel.com/certs``. A ``jku`` exactly equal to a value
    the issuer's configuration lists is tolerated and ignored (never fetched); any other is
    refused.

    Raises:
        AttestationError: ``token_too_large``, ``token_malformed``,
            ``token_header_forbidden`` or ``token_algorithm_forbidden``.
    """
    if len(token) > MAX_TOKEN_BYTES:
        raise AttestationError("token exceeds the size limit", code=ErrorCode.TOKEN_TOO_LARGE)
    parts = token.split(".")
    if len(parts) != 3 or not all(parts[:2]):
        raise AttestationError("token is not a compact JWS (three dot-separated parts)")
    if len(parts[0]) > MAX_HEADER_BYTES:
        raise AttestationError("token header exceeds the size limit")
    try:
        shared = json_segment(parts[0], HEADER_DEPTH)
    except ValueError as exc:
        raise AttestationError("token header is not base64url JSON") from exc
    if not isinstance(shared, dict):
        raise AttestationError("token header is not a JSON object")
    header = dict(shared)
    forbidden = sorted(FORBIDDEN_HEADERS.intersection(header))
    if forbidden == ["jku"] and header["jku"] in tolerated_jku:
        forbidden = []
    if forbidden:
        raise AttestationError(
            f"token header parameters are refused: {', '.join(forbidden)}",
            code=ErrorCode.TOKEN_HEADER_FORBIDDEN,
        )
    alg = header.get("alg")
    if not isinstance(alg, str) or alg not in allowed_algorithms:
        raise AttestationError(
            f"token algorithm {alg!r} is not allowed for this issuer",
            code=ErrorCode.TOKEN_ALGORITHM_FORBIDDEN,
        )
    kid = header.get("kid")
    if kid is not None and not isinstance(kid, str):
        raise AttestationError("token header kid is not a string")
    return UnverifiedHeader(alg=alg, kid=kid, fields=header)


def parse_header_with_kid(
    token: str, allowed_algorithms: Collection[str], *, tolerated_jku: Collection[str] = ()
) -> UnverifiedHeader:
    """``parse_header``, and the header must name its key (``kid``): every issuer we trust
    (Google, Intel, NVIDIA) does, and choosing a key without one would be guesswork.

    Raises:
        AttestationError: as ``parse_header``, or ``token_malformed`` without a kid.
    """
    header = parse_header(token, allowed_algorithms, tolerated_jku=tolerated_jku)
    if not header.kid:
        raise AttestationError("token header has no kid")
    return header


@functools.lru_cache(maxsize=64)
def json_segment(segment: str, max_depth: int) -> Any:
    """A token segment as JSON (strict base64url, strict bounded JSON).

    Cached: a release reads the same header and payload in the fetch step and in the pure
    verifier; each is decoded once. The value is shared between callers, none of which
    mutates it (headers are copied at the top level). Errors are not cached. 64 entries (32
    requests between their two steps; at most 4 MiB of 64 KiB tokens): a miss only decodes
    again.

    Raises:
        ValueError: not canonical base64url, or not strict JSON within ``max_depth``.
    """
    return loads_bounded(b64url_decode(segment), max_depth=max_depth)


def unverified_claim(token: str, name: str) -> str | None:
    """Read one string claim without verifying, only to choose which trust to verify with.

    The async layer and the pure verifier both ask for ``iss`` of the same token; the payload
    is decoded once for both (and for the verifier's claims) by ``json_segment``'s cache."""
    parts = token.split(".")
    if len(parts) != 3 or len(token) > MAX_TOKEN_BYTES:
        return None
    try:
        unverified_claims = json_segment(parts[1], MAX_JSON_DEPTH)
    except ValueError:
        return None
    if not isinstance(unverified_claims, dict):
        return None
    value = unverified_claims.get(name)
    return value if isinstance(value, str) else None


def verify_jws(
    token: str,
    header: UnverifiedHeader,
    key: Any,
    *,
    now: datetime,
    leeway: timedelta = DEFAULT_LEEWAY,
    required_claims: Collection[str] = TIME_CLAIMS,
    max_lifetime: timedelta = DEFAULT_MAX_LIFETIME,
) -> VerifiedJws:
    """Verify the signature with a trusted ``key`` and the time claims against ``now``.

    Args:
        token: the compact JWS whose header was parsed by ``parse_header``.
        header: that parsed header; its ``alg`` was checked against the allow-list.
        key: a public key object from the configured trust anchors.
        now: the one clock reading of this request (timezone-aware).
        leeway: tolerated clock skew for ``exp``, ``nbf`` and ``iat``.
        required_claims: claims that must be present.
        max_lifetime: the longest ``exp - iat`` accepted (both present).

    Raises:
        AttestationError: ``token_signature_invalid``, ``token_malformed``,
            ``token_claim_missing``, ``token_expired``, ``token_not_yet_valid`` or
            ``token_issued_in_future``.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise AttestationError("token is not a compact JWS (three dot-separated parts)")
    try:
        signature = b64url_decode(parts[2])
        payload = b64url_decode(parts[1])
    except ValueError as exc:
        raise AttestationError("token could not be decoded") from exc
    check_signature(header.alg, key, f"{parts[0]}.{parts[1]}".encode("ascii"), signature)
    del payload  # decoded above only to refuse a bad encoding before the signature check
    try:
        claims = json_segment(parts[1], MAX_JSON_DEPTH)
    except ValueError as exc:
        raise AttestationError("token payload is not strict JSON") from exc
    if isinstance(claims, dict):
        for name in required_claims:
            if name not in claims:
                raise AttestationError(
                    f"token lacks the required claim {name!r}", code=ErrorCode.TOKEN_CLAIM_MISSING
                )
    if not isinstance(claims, dict):  # its depth was bounded by loads_bounded
        raise AttestationError("token payload is not a JSON object of bounded depth")
    check_times(claims, now=now, leeway=leeway)
    exp, iat = claims.get("exp"), claims.get("iat")
    if (
        isinstance(exp, int | float)
        and isinstance(iat, int | float)
        and exp - iat > max_lifetime.total_seconds()
    ):
        raise AttestationError(
            f"token lifetime exp - iat exceeds {int(max_lifetime.total_seconds())} s",
            code=ErrorCode.TOKEN_CLAIM_INVALID,
        )
    return VerifiedJws(header=header.fields, claims=claims)


def check_signature(alg: str, key: Any, signing_input: bytes, signature: bytes) -> None:
    """Verify a JWS signature with ``cryptography`` directly (RFC 7518 §3).

    The key must be of the family ``alg`` names (an RSA key for RS*/PS*, an EC key on the
    matching curve for ES*); PSS uses a salt as long as the digest (RFC 7518 §3.5); an ECDSA
    signature is exactly R || S of the curve's size (RFC 7518 §3.4).

    Raises:
        AttestationError: ``token_algorithm_forbidden`` for an unknown ``alg`` or a key of the
            wrong kind; ``token_signature_invalid`` when the signature does not verify.
    """
    verify = _verifier(alg, key)
    try:
        verify(signature, signing_input)
    except InvalidSignature as exc:
        raise AttestationError(
            "token signature does not verify", code=ErrorCode.TOKEN_SIGNATURE_INVALID
        ) from exc


def _verifier(alg: str, key: Any) -> Callable[[bytes, bytes], None]:
    """A function that verifies (signature, data) for ``alg`` with ``key``, raising
    ``InvalidSignature``; refuses a key that is not of the family and size ``alg`` names."""
    family, bits = alg[:2], alg[2:]
    digest = _DIGESTS.get(bits)
    if digest is not None and family in ("RS", "PS") and isinstance(key, rsa.RSAPublicKey):
        pad: padding.AsymmetricPadding = (
            padding.PKCS1v15()
            if family == "RS"
            else padding.PSS(mgf=padding.MGF1(digest()), salt_length=digest.digest_size)
        )
        return lambda signature, data: key.verify(signature, data, pad, digest())
    if (
        digest is not None
        and family == "ES"
        and isinstance(key, ec.EllipticCurvePublicKey)
        and key.curve.name == _ES_CURVES[bits]
    ):
        size = (key.curve.key_size + 7) // 8

        def verify_ecdsa(signature: bytes, data: bytes) -> None:
            if len(signature) != 2 * size:  # JWS ECDSA signatures are R || S, fixed width
                raise InvalidSignature
            r, s = int.from_bytes(signature[:size], "big"), int.from_bytes(signature[size:], "big")
            key.verify(encode_dss_signature(r, s), data, ec.ECDSA(digest()))

        return verify_ecdsa
    raise AttestationError(
        f"token algorithm {alg!r} does not fit the trusted key",
        code=ErrorCode.TOKEN_ALGORITHM_FORBIDDEN,
    )


_DIGESTS: dict[str, type[hashes.SHA256 | hashes.SHA384 | hashes.SHA512]] = {
    "256": hashes.SHA256,
    "384": hashes.SHA384,
    "512": hashes.SHA512,
}
_ES_CURVES = {"256": "secp256r1", "384": "secp384r1", "512": "secp521r1"}


def check_times(claims: Mapping[str, Any], *, now: datetime, leeway: timedelta) -> None:
    """Check ``exp``, ``nbf`` and ``iat`` (those present) against ``now``.

    Raises:
        AttestationError: ``token_claim_invalid``, ``token_expired``, ``token_not_yet_valid``
            or ``token_issued_in_future``.
    """
    moment = now.timestamp()
    slack = leeway.total_seconds()
    times: dict[str, float] = {}
    for name in TIME_CLAIMS:
        if name in claims:
            value = claims[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise AttestationError(
                    f"token claim {name!r} is not a NumericDate",
                    code=ErrorCode.TOKEN_CLAIM_INVALID,
                )
            times[name] = float(value)
    checks: list[tuple[str, Callable[[float], bool], ErrorCode, str]] = [
        ("exp", lambda t: moment >= t + slack, ErrorCode.TOKEN_EXPIRED, "token has expired"),
        (
            "nbf",
            lambda t: moment < t - slack,
            ErrorCode.TOKEN_NOT_YET_VALID,
            "token is not yet valid",
        ),
        (
            "iat",
            lambda t: moment < t - slack,
            ErrorCode.TOKEN_ISSUED_IN_FUTURE,
            "token iat is in the future",
        ),
    ]
    for name, failed, code, message in checks:
        if name in times and failed(times[name]):
            raise AttestationError(message, code=code)
