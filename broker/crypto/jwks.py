"""JSON Web Key Sets, pure: ``parse_jwks`` turns bytes into a ``TrustedKeySet``.

Fetching lives in ``jwks_sources`` (an adapter); the pipeline sees only parsed key sets.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

MAX_JWKS_BYTES = 256 * 1024
MAX_JWKS_KEYS = 64
MIN_RSA_BITS = 2048
MAX_X5C = 5  # leaf, intermediates, root: every vendor chain here has 3


class JwksError(ValueError):
    """The key set itself is unusable (a configuration or upstream problem)."""


@dataclass(frozen=True)
class TrustedKey:
    kid: str
    alg: str | None
    key: Any  # a cryptography public key object
    x5c: tuple[bytes, ...] = ()  # DER certificates as published (leaf first); unverified


@dataclass(frozen=True)
class TrustedKeySet:
    keys: Mapping[str, tuple[TrustedKey, ...]]

    def get(self, kid: str | None, alg: str | None = None) -> TrustedKey | None:
        """The key with this ``kid`` whose own ``alg`` (if it names one) equals ``alg``."""
        for entry in self.keys.get(kid or "", ()):
            if alg is None or entry.alg in (None, alg):
                return entry
        return None

    def has_kid(self, kid: str | None) -> bool:
        return bool(self.keys.get(kid or ""))


def parse_jwks(data: bytes) -> TrustedKeySet:
    """Parse a JWKS document into public keys indexed by ``kid``.

    Keys with ``use`` other than ``sig``, private members, symmetric keys and RSA keys under
    2048 bits are refused: a key set with such an entry is treated as broken, not filtered.

    Raises:
        JwksError: when the document is not a usable key set.
    """
    if len(data) > MAX_JWKS_BYTES:
        raise JwksError("JWKS exceeds the size limit")
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise JwksError("JWKS is not JSON") from exc
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise JwksError("JWKS has no keys")
    if len(entries) > MAX_JWKS_KEYS:
        raise JwksError("JWKS has too many keys")
    keys: dict[str, tuple[TrustedKey, ...]] = {}
    for entry in entries:
        trusted = _parse_entry(entry)
        # The same kid may appear once per algorithm (Intel publishes PS384 and RS256 twins).
        keys[trusted.kid] = (*keys.get(trusted.kid, ()), trusted)
    return TrustedKeySet(keys=keys)


def _parse_entry(entry: Any) -> TrustedKey:
    if not isinstance(entry, dict):
        raise JwksError("JWKS entry is not an object")
    kid = entry.get("kid")
    if not isinstance(kid, str) or not kid:
        raise JwksError("JWKS entry without a kid")
    if entry.get("kty") not in {"RSA", "EC"}:
        raise JwksError(f"JWKS entry {kid}: unsupported kty")
    if entry.get("use", "sig") != "sig":
        raise JwksError(f"JWKS entry {kid}: not a signing key")
    if any(member in entry for member in ("d", "p", "q", "k")):
        raise JwksError(f"JWKS entry {kid}: contains private key material")
    try:
        key = jwt.PyJWK(entry).key
    except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError) as exc:
        raise JwksError(f"JWKS entry {kid}: unusable key") from exc
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < MIN_RSA_BITS:
        raise JwksError(f"JWKS entry {kid}: RSA key under {MIN_RSA_BITS} bits")
    if not isinstance(key, rsa.RSAPublicKey | ec.EllipticCurvePublicKey):
        raise JwksError(f"JWKS entry {kid}: not a public key")
    alg = entry.get("alg")
    x5c = entry.get("x5c", [])
    if not isinstance(x5c, list) or len(x5c) > MAX_X5C or not all(isinstance(c, str) for c in x5c):
        raise JwksError(f"JWKS entry {kid}: x5c is not a short list of certificates")
    try:
        ders = tuple(base64.b64decode(c, validate=True) for c in x5c)
    except ValueError as exc:
        raise JwksError(f"JWKS entry {kid}: x5c is not base64") from exc
    return TrustedKey(kid=kid, alg=alg if isinstance(alg, str) else None, key=key, x5c=ders)
