"""DPoP proofs (RFC 9449): the sender of a request proves it holds the private key an
attestation result is bound to (``cnf.jwk``, RFC 7800), so a leaked result alone releases
nothing.

A proof is a compact JWS the runner signs for each request: header ``typ: dpop+jwt``, an
``alg`` from ``DPOP_ALGORITHMS`` and the public ``jwk`` (a P-256 key made inside the TEE);
claims ``jti`` (single use: the caller spends it in the shared store), ``htm`` and ``htu`` (this
request's method and URL, without query or fragment), ``iat`` (recent), ``ath`` (the SHA-256 of
the access token the proof accompanies) and, when the server asks for one, its ``nonce``
(§8: a ``DPoP-Nonce`` the server handed out, so a proof cannot be made ahead of time).

``verify_dpop_proof`` is pure: it checks one proof against one request and returns the key's
RFC 7638 thumbprint and the ``jti``; spending the ``jti`` is the caller's. Given the result's
``cnf`` thumbprint (``bound_to``), the proof's key is matched to it before the signature is
checked or any claim is read (``dpop_key_mismatch``). ``htu`` is compared with the URLs the
broker is configured to be reached at (``[server] public_urls``), never with one built from the
request's ``Host`` (``dpop_htu_mismatch``: a proof made for another service). ``iat`` must be an
integer NumericDate within the proof's window (``dpop_iat_invalid``). The signature is checked
by ``jose.check_signature``, the one JWS verifier. ``tests/unit/test_dpop.py`` checks proofs
made by independent implementations (jwcrypto, and panva's ``dpop`` for Node) and the hostile
cases.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, BrokerError, ErrorCode, InputError
from broker.crypto.jose import check_signature, json_segment
from broker.crypto.jwk import RunnerKey, parse_runner_key

DPOP_TYP = "dpop+jwt"
DPOP_ALGORITHMS = ("ES256",)  # the proof key is P-256 (made in the TEE, docs/api.md)
MAX_PROOF_BYTES = 8 * 1024
MAX_PROOF_AGE = timedelta(seconds=60)  # a proof older than this is refused (§11.1)
FUTURE_LEEWAY = timedelta(seconds=5)  # a runner's clock slightly ahead of ours
MAX_JTI_CHARS = 128
REFUSED_HEADERS = frozenset({"jku", "x5u", "x5c", "kid", "crit"})  # the key is in ``jwk`` only
# iat beyond these is no time a proof can be made at; checked before any datetime is built
# (1e20 used to overflow into a 500)
MIN_IAT, MAX_IAT = 0, 253402300799  # 9999-12-31T23:59:59Z
DEFAULT_PORTS = {"https": 443, "http": 80}
# Headers (and htu values) seen lately, parsed once: a runner sends the same proof header, its
# key, with every proof. Pure functions of the text, so a hit concludes what parsing would;
# failures are never kept. Bounded (a flood of distinct ones only evicts).
PARSED_HEADERS = 1024
PARSED_URLS = 256


@dataclass(frozen=True)
class DpopProof:
    """A proof that verified for this request."""

    thumbprint: str  # RFC 7638 SHA-256 thumbprint of the proof's public key
    jti: str  # spend it: a proof is good once
    issued_at: datetime
    nonce: str | None


class DpopError(AttestationError):
    """A proof that does not verify (401, ``WWW-Authenticate: DPoP error="invalid_dpop_proof"``)."""

    default_code = ErrorCode.DPOP_PROOF_INVALID


class DpopNonceRequired(AttestationError):
    """The proof lacks the server's current nonce, or has a stale one (401 ``use_dpop_nonce``,
    with a fresh ``DPoP-Nonce`` header for the retry)."""

    default_code = ErrorCode.DPOP_NONCE_REQUIRED


@functools.lru_cache(maxsize=PARSED_URLS)
def target_uri(url: str) -> str:
    """``htu`` as compared (§4.3): scheme and host lowercased, the default port dropped, the
    path kept as is (``/`` when empty); no query, no fragment.

    Raises:
        DpopError: not an absolute http(s) URL.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise DpopError("DPoP htu is not a URL") from exc
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        raise DpopError("DPoP htu must be an absolute https URL")
    host = parts.hostname.lower()
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    authority = host if port in (None, DEFAULT_PORTS[scheme]) else f"{host}:{port}"
    return f"{scheme}://{authority}{parts.path or '/'}"


def access_token_hash(access_token: str) -> str:
    """``ath``: base64url of the SHA-256 of the token's ASCII bytes (§4.2)."""
    return b64url_encode(hashlib.sha256(access_token.encode("ascii")).digest())


def verify_dpop_proof(
    proof: Any,
    *,
    method: str,
    url: str | Sequence[str],
    now: datetime,
    access_token: str | None = None,
    nonce_valid: Callable[[str], bool] | None = None,
    bound_to: str | None = None,
) -> DpopProof:
    """Check one proof against the request it came with.

    Args:
        proof: the ``DPoP`` header's value (untrusted).
        method: this request's method; ``url``: the URL (or URLs) this broker is configured to
            be reached at for this route, never one derived from the request.
        now: the one clock reading of this request.
        access_token: the token the proof must be bound to (``ath``); ``None`` when the request
            carries none (then a proof naming one is refused).
        nonce_valid: when given, the proof must carry a ``nonce`` it accepts.
        bound_to: the RFC 7638 thumbprint the proof's key must have (the result's ``cnf``),
            compared before the signature and the claims.

    Raises:
        DpopError: ``dpop_proof_invalid``, saying which check failed; ``dpop_key_mismatch``,
            ``dpop_htu_mismatch``, ``dpop_iat_invalid`` for those checks.
        DpopNonceRequired: ``use_dpop_nonce`` (no nonce, or one no longer valid).
    """
    if not isinstance(proof, str) or not proof:
        raise DpopError("a DPoP proof is required")
    if len(proof) > MAX_PROOF_BYTES:
        raise DpopError("DPoP proof exceeds the size limit")
    if not proof.isascii():  # a compact JWS is base64url and dots; the signing input is ASCII
        raise DpopError("DPoP proof is not a compact JWS")
    parts = proof.split(".")
    if len(parts) != 3 or not all(parts):
        raise DpopError("DPoP proof is not a compact JWS")
    alg, key = _header_key(parts[0])
    if bound_to is not None and key.thumbprint != bound_to:
        raise DpopError(
            "the DPoP proof is not signed by the key the result is bound to",
            code=ErrorCode.DPOP_KEY_MISMATCH,
        )
    try:
        signature = _decode(parts[2])
        check_signature(alg, key.key, f"{parts[0]}.{parts[1]}".encode("ascii"), signature)
    except BrokerError as exc:
        raise DpopError("DPoP proof signature does not verify") from exc
    claims = _object(parts[1], "claims")
    jti = claims.get("jti")
    if not isinstance(jti, str) or not 0 < len(jti) <= MAX_JTI_CHARS or not jti.isprintable():
        raise DpopError(f"DPoP proof jti must be a string of 1..{MAX_JTI_CHARS} characters")
    if claims.get("htm") != method:
        raise DpopError("DPoP proof htm is not this request's method")
    htu = claims.get("htu")
    urls = (url,) if isinstance(url, str) else tuple(url)
    if not isinstance(htu, str) or _target_or_none(htu) not in {target_uri(u) for u in urls}:
        raise DpopError(
            "DPoP proof htu is not this broker's URL for this request",
            code=ErrorCode.DPOP_HTU_MISMATCH,
        )
    issued_at = _issued_at(claims.get("iat"), now)
    _check_ath(claims.get("ath"), access_token)
    nonce = claims.get("nonce")
    if nonce is not None and not isinstance(nonce, str):
        raise DpopError("DPoP proof nonce must be a string")
    if nonce_valid is not None and (nonce is None or not nonce_valid(nonce)):
        raise DpopNonceRequired("this server requires a fresh DPoP-Nonce in the proof")
    return DpopProof(thumbprint=key.thumbprint, jti=jti, issued_at=issued_at, nonce=nonce)


@functools.lru_cache(maxsize=PARSED_HEADERS)
def _header_key(segment: str) -> tuple[str, RunnerKey]:
    """The header's rules: ``typ``, an allowed ``alg``, no other way to name a key than a
    public P-256 ``jwk``."""
    header = _object(segment, "header")
    if header.get("typ") != DPOP_TYP:
        raise DpopError(f"DPoP proof typ must be {DPOP_TYP}")
    alg = header.get("alg")
    if not isinstance(alg, str) or alg not in DPOP_ALGORITHMS:
        raise DpopError(f"DPoP proof alg must be one of {', '.join(DPOP_ALGORITHMS)}")
    refused = sorted(REFUSED_HEADERS.intersection(header))
    if refused:
        raise DpopError(f"DPoP proof header parameters are refused: {', '.join(refused)}")
    try:
        key = parse_runner_key(header.get("jwk"))
    except InputError as exc:
        raise DpopError(f"DPoP proof jwk: {exc.message}") from exc
    if key.jwk.get("kty") != "EC" or key.jwk.get("crv") != "P-256":
        raise DpopError("DPoP proof jwk must be a P-256 public key")
    return alg, key


def _check_ath(ath: Any, access_token: str | None) -> None:
    if access_token is None:
        if ath is not None:
            raise DpopError("DPoP proof names an access token this request does not carry")
    elif ath != access_token_hash(access_token):
        raise DpopError("DPoP proof ath does not match the access token")


def _decode(segment: str) -> bytes:
    try:
        return b64url_decode(segment)
    except ValueError as exc:
        raise DpopError("DPoP proof is not base64url") from exc


def _object(segment: str, what: str) -> dict[str, Any]:
    try:
        value = json_segment(segment, 8)
    except ValueError as exc:
        raise DpopError(f"DPoP proof {what} is not base64url JSON") from exc
    if not isinstance(value, dict):
        raise DpopError(f"DPoP proof {what} is not a JSON object")
    return value


def _target_or_none(htu: str) -> str | None:
    try:
        return target_uri(htu)
    except DpopError:
        return None


def _issued_at(value: Any, now: datetime) -> datetime:
    """``iat``: a JSON integer (a fraction or an exponent form is refused, and so is anything
    outside years 1970..9999) within ``MAX_PROOF_AGE`` before ``now`` and ``FUTURE_LEEWAY``
    after it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _iat_error("DPoP proof iat must be an integer NumericDate")
    if not MIN_IAT <= value <= MAX_IAT:
        raise _iat_error("DPoP proof iat is out of range")
    issued = datetime.fromtimestamp(value, UTC)
    if issued > now + FUTURE_LEEWAY:
        raise _iat_error("DPoP proof iat is in the future")
    if issued < now - MAX_PROOF_AGE:
        raise _iat_error(f"DPoP proof is older than {int(MAX_PROOF_AGE.total_seconds())} s")
    return issued


def _iat_error(message: str) -> DpopError:
    return DpopError(message, code=ErrorCode.DPOP_IAT_INVALID)
