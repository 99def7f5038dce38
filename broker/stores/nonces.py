"""Challenge nonces that cost nothing to hand out: stateless, MAC'd, single use.

A challenge is 32 bytes, base64url (43 characters, inside Confidential Space's nonce limits):

    key id (1) ‖ random (15) ‖ expiry, unix seconds (4, big-endian) ‖ HMAC-SHA-256 (12)

The MAC is keyed from configuration (``[nonces] challenge_key``: 32 random bytes in a file the
workers of a host share, created if absent; replicas behind one load balancer must share it) and
covers the other 20 bytes. Handing one out touches no store, so an unauthenticated flood of
``POST /v1/challenge`` cannot fill anything or lock anyone out.

Using one is two steps, in this order (``decisions/release.py``, ``decisions/attest.py``):

1. ``verify_challenge``: the MAC (constant-time), the key id and the expiry, no store touched
   (``nonce_unknown`` when any fails — forged, from another key, expired, malformed);
2. the evidence that carries the nonce is verified (signature, issuer, audience, binding to
   this nonce and the runner key); only then ``spend_challenge``: one atomic insert-if-absent
   in the configured store, kept only until the challenge would have expired, so of any number
   of concurrent uses across processes and replicas exactly one succeeds and the others see
   ``nonce_reused``. Forged or garbage evidence therefore spends nothing, and the spent store
   holds only nonces of evidence an attestation service really signed for this broker.

DPoP proofs' ``jti``s (``spend_jti``) live in a namespace of their own with a bound of their own
(a second table, key prefix or map), so a flood of proofs cannot fill the challenges' space, nor
the other way round. Where spent values live is chosen by ``[nonces] store``:

* ``memory`` — one process (the default);
* ``sqlite:///PATH`` — several processes on one host;
* ``redis://HOST:PORT/DB`` — replicas (``SET NX EXAT``);
* ``postgresql://USER@HOST/DB`` — replicas without Redis (``INSERT … ON CONFLICT DO NOTHING``).

A store that cannot answer raises ``503 nonce_store_unavailable``: a nonce is never accepted
without the store having recorded it spent. The memory and SQLite stores are bounded, each
namespace on its own (``[server] max_outstanding_nonces`` values within their lifetime, 503
``nonce_store_full`` past it); docs/decisions.md gives the arithmetic of why no client or
handful of addresses can reach that bound.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode, UpstreamError
from broker.core.secrets_files import load_or_create_secret

NONCE_BYTES = 32
MAX_NONCE_CHARS = 128
RANDOM_BYTES = 15
MAC_BYTES = 12
MAC_CONTEXT = b"sealed-broker challenge v1\0"
# RFC 9449 §8 server nonces for DPoP proofs: the same construction under another MAC context,
# so one can never pass for the other; not single use, good for DPOP_NONCE_TTL
DPOP_NONCE_CONTEXT = b"sealed-broker dpop-nonce v1\0"
DPOP_NONCE_TTL = timedelta(minutes=5)
DEFAULT_JTI_CAPACITY = 100_000  # spent DPoP jtis within their lifetime, when none is configured

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Challenge:
    nonce: str  # base64url of NONCE_BYTES
    expires_at: datetime


@dataclass(frozen=True)
class VerifiedChallenge:
    """A challenge this broker made and that has not expired (``verify_challenge``); not yet
    spent. Only such a value can be spent (``spend_challenge``)."""

    nonce: str
    expires_at: datetime


class NonceStore(Protocol):
    """What the service uses: hand out a challenge, spend one."""

    async def open(self) -> None:
        """Load what the store needs (keys, connections) before the first request."""
        ...

    async def issue(self, now: datetime) -> Challenge:
        """A fresh challenge (no store is touched)."""
        ...

    def verify_challenge(self, nonce: str, now: datetime) -> VerifiedChallenge:
        """Step 1: this broker made ``nonce`` and it is fresh (no store is touched); raise
        ``nonce_unknown``."""
        ...

    async def spend_challenge(self, challenge: VerifiedChallenge, now: datetime) -> None:
        """Step 2, once the evidence carrying it verified: atomically mark it used; raise
        ``nonce_reused`` (or 503 ``nonce_store_full`` / ``nonce_store_unavailable``)."""
        ...

    async def consume(self, nonce: str, now: datetime) -> None:
        """Steps 1 and 2 at once (for callers with nothing to verify in between)."""
        ...

    async def spend_jti(self, value: str, expires_at: datetime, now: datetime) -> None:
        """Spend a DPoP proof's ``jti`` in its own namespace of the shared store (its own
        bound); raise ``nonce_reused`` if it already was."""
        ...

    def server_nonce(self, now: datetime) -> str:
        """A ``DPoP-Nonce`` for the next proof (no store is touched)."""
        ...

    def server_nonce_valid(self, nonce: str, now: datetime) -> bool:
        """Whether this broker (any worker or replica sharing the key) made ``nonce`` and it
        is still fresh."""
        ...

    async def check(self) -> None:
        """Raise ``UpstreamError`` when the store cannot answer (``/readyz``)."""
        ...

    async def close(self) -> None: ...


class SpentNonces(Protocol):
    """Where spent nonces are remembered until they expire."""

    async def spend(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        """Record ``nonce`` spent until ``expires_at``; raise ``nonce_reused`` if it already was
        (one atomic insert-if-absent)."""
        ...

    async def check(self) -> None: ...

    async def close(self) -> None: ...


class ChallengeCodec:
    """Makes and checks challenges under one 32-byte key (pure: ``now`` is passed in)."""

    def __init__(self, key: bytes, ttl: timedelta, *, context: bytes = MAC_CONTEXT) -> None:
        self._key = key
        self._key_id = hashlib.sha256(b"key id\0" + key).digest()[:1]
        self._ttl = ttl
        self._context = context

    def issue(self, now: datetime) -> Challenge:
        expires = math.ceil((now + self._ttl).timestamp())
        body = self._key_id + secrets.token_bytes(RANDOM_BYTES) + struct.pack(">I", expires)
        return Challenge(
            nonce=b64url_encode(body + self._mac(body)),
            expires_at=datetime.fromtimestamp(expires, UTC),
        )

    def verify(self, nonce: str, now: datetime) -> datetime:
        """The challenge's expiry, if this key made it and it has not expired.

        Raises:
            AttestationError: ``nonce_unknown``.
        """
        try:
            raw = b64url_decode(nonce) if len(nonce) <= MAX_NONCE_CHARS else b""
        except ValueError:
            raw = b""
        if len(raw) != NONCE_BYTES or raw[:1] != self._key_id:
            raise unknown_nonce()
        body, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body)):
            raise unknown_nonce()
        (expires,) = struct.unpack(">I", body[-4:])
        expires_at = datetime.fromtimestamp(expires, UTC)
        if expires_at <= now:
            raise unknown_nonce()
        return expires_at

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, self._context + body, hashlib.sha256).digest()[:MAC_BYTES]


class StatelessNonceStore:
    """``NonceStore``: challenges from a ``ChallengeCodec``, spent nonces in ``spent``, spent
    DPoP ``jti``s in ``jtis`` (default: a process-local store of ``DEFAULT_JTI_CAPACITY``)."""

    def __init__(
        self,
        spent: SpentNonces,
        *,
        key_path: Path,
        ttl: timedelta,
        jtis: SpentNonces | None = None,
    ) -> None:
        self._spent = spent
        self._jtis = jtis if jtis is not None else MemorySpentNonces(capacity=DEFAULT_JTI_CAPACITY)
        self._key_path = key_path
        self._ttl = ttl
        self._codec: ChallengeCodec | None = None
        self._dpop: ChallengeCodec | None = None

    async def open(self) -> None:
        import asyncio  # noqa: PLC0415

        key = await asyncio.to_thread(load_or_create_secret, self._key_path, "nonces.challenge_key")
        self._codec = ChallengeCodec(key, self._ttl)
        self._dpop = ChallengeCodec(key, DPOP_NONCE_TTL, context=DPOP_NONCE_CONTEXT)

    async def issue(self, now: datetime) -> Challenge:
        return self._ready().issue(now)

    def verify_challenge(self, nonce: str, now: datetime) -> VerifiedChallenge:
        return VerifiedChallenge(nonce, self._ready().verify(nonce, now))

    async def spend_challenge(self, challenge: VerifiedChallenge, now: datetime) -> None:
        await self._spent.spend(challenge.nonce, challenge.expires_at, now)

    async def consume(self, nonce: str, now: datetime) -> None:
        await self.spend_challenge(self.verify_challenge(nonce, now), now)

    async def spend_jti(self, value: str, expires_at: datetime, now: datetime) -> None:
        await self._jtis.spend(value, expires_at, now)

    def server_nonce(self, now: datetime) -> str:
        if self._dpop is None:
            raise store_unavailable()
        return self._dpop.issue(now).nonce

    def server_nonce_valid(self, nonce: str, now: datetime) -> bool:
        if self._dpop is None:
            raise store_unavailable()
        try:
            self._dpop.verify(nonce, now)
        except AttestationError:
            return False
        return True

    async def check(self) -> None:
        await self._spent.check()
        await self._jtis.check()

    async def close(self) -> None:
        try:
            await self._spent.close()
        finally:
            await self._jtis.close()

    def _ready(self) -> ChallengeCodec:
        if self._codec is None:
            raise store_unavailable()
        return self._codec


def unknown_nonce() -> AttestationError:
    return AttestationError(
        "nonce was not issued by this broker or has expired", code=ErrorCode.NONCE_UNKNOWN
    )


def reused_nonce() -> AttestationError:
    return AttestationError("nonce was already used", code=ErrorCode.NONCE_REUSED)


def store_full() -> UpstreamError:
    return UpstreamError(
        "too many nonces spent within their lifetime; retry shortly",
        code=ErrorCode.NONCE_STORE_FULL,
    )


def store_unavailable() -> UpstreamError:
    return UpstreamError("the nonce store did not answer", code=ErrorCode.NONCE_STORE_UNAVAILABLE)


class MemorySpentNonces:
    """Spent values of one process: 16 bytes of each value's SHA-256 with its expiry (unix
    seconds), ~110 bytes an entry. Insertion order is (nearly) expiry order: expired entries
    are dropped from the front. Operations are atomic: no ``await`` inside them."""

    def __init__(self, *, capacity: int) -> None:
        self._capacity = capacity
        self._entries: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def spend(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        cutoff = now.timestamp()
        while self._entries:
            oldest, expiry = next(iter(self._entries.items()))
            if expiry > cutoff:
                break
            del self._entries[oldest]
        value = hashlib.sha256(nonce.encode("utf-8", "surrogatepass")).digest()[:16]
        if value in self._entries:
            raise reused_nonce()
        if len(self._entries) >= self._capacity:
            raise store_full()
        self._entries[value] = math.ceil(expires_at.timestamp())

    async def check(self) -> None:
        return None

    async def close(self) -> None:
        return None


def unavailable(kind: str, exc: BaseException) -> Exception:
    """503 for the client; the cause (never a secret: no URL, no password) for the operator."""
    log.warning("%s nonce store: %s: %s", kind, type(exc).__name__, str(exc)[:300])
    return store_unavailable()
