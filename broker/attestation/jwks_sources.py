"""Where verifiers' key sets come from (an adapter: all JWKS I/O is here).

``FileJwksSource`` reads a configured file once; ``UrlJwksSource`` fetches over the shared
``aiohttp.ClientSession``, caches, and refetches when a token names an unknown ``kid`` (keys
rotate), at most once per ``refresh_min_seconds`` so that a flood of bogus kids cannot turn into a
flood of fetches. The bytes are parsed by the pure ``jwks.parse_jwks``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import aiohttp

from broker.core.errors import ErrorCode, UpstreamError
from broker.crypto.jwks import MAX_JWKS_BYTES, JwksError, TrustedKeySet, parse_jwks

log = logging.getLogger(__name__)

JWKS_FETCH_TIMEOUT_SECONDS = 5.0


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
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self._on_request = on_request  # told of each fetch (broker_outbound_requests_total)
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
        status, body = await get_bounded(
            self._session,
            self._url,
            timeout_seconds=JWKS_FETCH_TIMEOUT_SECONDS,
            max_bytes=MAX_JWKS_BYTES,
            on_request=self._on_request,
        )
        if status != 200:
            raise JwksError(f"HTTP {status}")
        return body


async def get_bounded(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout_seconds: float,
    max_bytes: int,
    on_request: Callable[[], None] | None = None,
) -> tuple[int, bytes]:
    """GET ``url`` without following redirects: the status and, on 200, the body read to its
    end but never past ``max_bytes + 1`` bytes (so a caller sees an oversized body as one).
    Shared by the adapters that fetch trust material (JWKS, AMD certificates).

    Raises:
        aiohttp.ClientError, TimeoutError: the server could not be reached or answered in time.
    """
    if on_request is not None:
        on_request()
    timeout = aiohttp.ClientTimeout(total=timeout_seconds)
    async with session.get(url, timeout=timeout, allow_redirects=False) as response:
        if response.status != 200:
            return response.status, b""
        body = bytearray()
        # content.read(n) answers what is buffered so far: read until the end, or past the limit
        while len(body) <= max_bytes:
            chunk = await response.content.read(max_bytes + 1 - len(body))
            if not chunk:
                break
            body += chunk
        return 200, bytes(body)
