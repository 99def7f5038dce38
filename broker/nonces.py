"""Challenge nonces: 32 random bytes, single use, short-lived, in a bounded store.

A consumed nonce stays in the store as a tombstone until it would have expired, so a second use
is reported as ``nonce_reused`` rather than ``nonce_unknown``. Both outstanding nonces and
tombstones count toward the bound; when it is reached, new challenges are refused (503
``nonce_store_full``) instead of evicting live nonces an attacker could otherwise flush out.

Where the store lives is chosen by ``[nonces] store`` (docs/configuration.md):

* ``memory`` — one process (the default);
* ``sqlite:///PATH`` — several processes on one host, single use by SQLite's write lock;
* ``redis://HOST:PORT/DB`` — several replicas, single use by an atomic script, expiry by Redis;
* ``postgresql://USER@HOST/DB`` — several replicas without Redis, single use by a row update.

A store that cannot answer raises ``503 nonce_store_unavailable``: a nonce is never accepted
without the store having marked it spent.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from broker.attestation.jose import b64url_encode
from broker.errors import AttestationError, ErrorCode, UpstreamError

NONCE_BYTES = 32
MAX_NONCE_CHARS = 128


@dataclass(frozen=True)
class Challenge:
    nonce: str  # base64url of NONCE_BYTES random bytes
    expires_at: datetime


class NonceStore(Protocol):
    async def issue(self, now: datetime) -> Challenge:
        """Create and remember a fresh nonce."""
        ...

    async def consume(self, nonce: str, now: datetime) -> None:
        """Atomically mark ``nonce`` used; raise ``nonce_unknown`` or ``nonce_reused``."""
        ...

    async def check(self) -> None:
        """Raise ``UpstreamError`` when the store cannot answer (``/readyz``)."""
        ...

    async def close(self) -> None: ...


def new_nonce() -> str:
    return b64url_encode(secrets.token_bytes(NONCE_BYTES))


def unknown_nonce() -> AttestationError:
    return AttestationError(
        "nonce was not issued by this broker or has expired", code=ErrorCode.NONCE_UNKNOWN
    )


def reused_nonce() -> AttestationError:
    return AttestationError("nonce was already used", code=ErrorCode.NONCE_REUSED)


def store_full() -> UpstreamError:
    return UpstreamError(
        "too many outstanding challenges; retry shortly", code=ErrorCode.NONCE_STORE_FULL
    )


def store_unavailable() -> UpstreamError:
    return UpstreamError("the nonce store did not answer", code=ErrorCode.NONCE_STORE_UNAVAILABLE)


class MemoryNonceStore:
    """Single-process nonce store. Operations are atomic: no ``await`` inside them."""

    def __init__(self, *, ttl: timedelta, capacity: int) -> None:
        self._ttl = ttl
        self._capacity = capacity
        # nonce -> (expires_at, consumed); insertion order == expiry order (constant TTL)
        self._entries: OrderedDict[str, tuple[datetime, bool]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def issue(self, now: datetime) -> Challenge:
        self._purge(now)
        if len(self._entries) >= self._capacity:
            raise store_full()
        nonce = new_nonce()
        expires_at = now + self._ttl
        self._entries[nonce] = (expires_at, False)
        return Challenge(nonce=nonce, expires_at=expires_at)

    async def consume(self, nonce: str, now: datetime) -> None:
        self._purge(now)
        entry = self._entries.get(nonce) if len(nonce) <= MAX_NONCE_CHARS else None
        if entry is None:
            raise unknown_nonce()
        expires_at, consumed = entry
        if consumed:
            raise reused_nonce()
        self._entries[nonce] = (expires_at, True)

    async def check(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _purge(self, now: datetime) -> None:
        while self._entries:
            nonce, (expires_at, _) = next(iter(self._entries.items()))
            if expires_at > now:
                break
            del self._entries[nonce]
