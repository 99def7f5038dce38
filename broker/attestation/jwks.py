"""JSON Web Key Sets: a pure parser and the async sources that feed verifiers.

``parse_jwks`` turns bytes into a ``TrustedKeySet`` (pure). ``FileJwksSource`` reads a configured
file once; ``UrlJwksSource`` fetches over the shared ``aiohttp.ClientSession``, caches, and
refetches when a token names an unknown ``kid`` (keys rotate), at most once per
``refresh_min_seconds`` so that a flood of bogus kids cannot turn into a flood of fetches.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from broker.errors import ErrorCode, UpstreamError

log = logging.getLogger(__name__)

MAX_JWKS_BYTES = 256 * 1024
MAX_JWKS_KEYS = 64
MIN_RSA_BITS = 2048
MAX_X5C = 5  # leaf, intermediates, root: every vendor chain here has 3
JWKS_FETCH_TIMEOUT_SECONDS = 5.0


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


class JwksSource(Protocol):
    """Where a verifier's keys come from. Failures become ``UpstreamError``."""

    async def key_set(self, *, unknown_kid: str | None = None) -> TrustedKeySet:
        """Return the current key set; ``unknown_kid`` asks for a refresh if allowed."""
        ...


class FileJwksSource:
    """A key set pinned in a file, read once at start-up (refreshed by restart)."""

    def __init__(self, keys: TrustedKeySet) -> None:
        self._keys = keys

    @classmethod
    async def load(cls, path: Path) -> FileJwksSource:
        """Read and parse the file off the event loop.

        Raises:
            JwksError: when the file is not a usable key set.
        """
        return cls(parse_jwks(await asyncio.to_thread(path.read_bytes)))

    async def key_set(self, *, unknown_kid: str | None = None) -> TrustedKeySet:
        return self._keys


class UrlJwksSource:
    """A key set fetched over HTTPS, cached, refreshed on an unknown kid (rate-limited)."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        cache_seconds: float,
        refresh_min_seconds: float,
    ) -> None:
        self._url = url
        self._session = session
        self._cache_seconds = cache_seconds
        self._refresh_min_seconds = refresh_min_seconds
        self._keys: TrustedKeySet | None = None
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()

    async def key_set(self, *, unknown_kid: str | None = None) -> TrustedKeySet:
        async with self._lock:
            age = time.monotonic() - self._fetched_at
            stale = self._keys is None or age >= self._cache_seconds
            wants_refresh = unknown_kid is not None and age >= self._refresh_min_seconds
            if stale or wants_refresh:
                return await self._refresh()
            if self._keys is None:
                raise UpstreamError(
                    "the issuer's signing keys are unavailable", code=ErrorCode.JWKS_UNAVAILABLE
                )
            return self._keys

    async def _refresh(self) -> TrustedKeySet:
        self._fetched_at = time.monotonic()
        try:
            self._keys = parse_jwks(await self._fetch())
            return self._keys
        except (aiohttp.ClientError, TimeoutError, JwksError) as exc:
            log.warning("JWKS fetch from %s failed: %s", self._url, exc)
            if self._keys is None:
                raise UpstreamError(
                    "the issuer's signing keys are unavailable", code=ErrorCode.JWKS_UNAVAILABLE
                ) from exc
            # Keep serving the last good set; an outage must not widen trust, only delay it.
            return self._keys

    async def _fetch(self) -> bytes:
        timeout = aiohttp.ClientTimeout(total=JWKS_FETCH_TIMEOUT_SECONDS)
        async with self._session.get(self._url, timeout=timeout, allow_redirects=False) as response:
            if response.status != 200:
                raise JwksError(f"HTTP {response.status}")
            return await response.content.read(MAX_JWKS_BYTES + 1)
