"""The KBS session cookie (``kbs-session-id``): random, unguessable, and a handshake that costs
nothing to hand out (docs/kbs.md, docs/decisions.md "KBS sessions").

``POST /kbs/v0/auth`` stores nothing. Its cookie carries what the attestation that follows
needs, under a MAC keyed from ``[nonces] challenge_key`` (the key every worker and replica
already shares for challenges):

    version (1) ‖ random (16) ‖ expiry, unix seconds (4) ‖ tee (1) ‖ SHA-256(nonce)[:16] ‖
    HMAC-SHA-256 (16)

so ``POST /kbs/v0/attest`` learns the guest's ``tee`` and that the nonce it answers is the one
handed out with this very cookie (a nonce of another session is refused), on any worker or
replica, with no lookup. The nonce itself is the broker's stateless challenge
(``stores/nonces.py``), spent once in the shared spent-nonce store. Only once a guest attested
is anything stored: its token, under the SHA-256 of the cookie (``stores/kbs_sessions.py``),
never the cookie itself. Records name a session by that hash too. Pure.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.kbs.wire import SESSION_COOKIE

COOKIE_NAME = SESSION_COOKIE
VERSION = b"\x01"
RANDOM_BYTES = 16
NONCE_DIGEST_BYTES = 16
MAC_BYTES = 16
COOKIE_BYTES = 1 + RANDOM_BYTES + 4 + 1 + NONCE_DIGEST_BYTES + MAC_BYTES
MAX_COOKIE_CHARS = 128
# A cookie names its tee by this byte. Pinned: a number is never reused or renumbered (a cookie
# issued before an upgrade, or by another replica's version, must open to the same tee); a new
# tee name gets the next free number. tests/unit/test_kbs_session.py pins the table.
TEE_NUMBERS: dict[str, int] = {
    "az-snp-vtpm": 0,
    "az-tdx-vtpm": 1,
    "cca": 2,
    "csv": 3,
    "hygondcu": 4,
    "nvidia": 5,
    "nvidia-dpu": 6,
    "sample": 7,
    "sampledevice": 8,
    "se": 9,
    "sgx": 10,
    "snp": 11,
    "tdx": 12,
    "tpm": 13,
}
TEE_BY_NUMBER = {number: tee for tee, number in TEE_NUMBERS.items()}
KEY_CONTEXT = b"sealed-broker kbs-session key v1"
MAC_CONTEXT = b"sealed-broker kbs-session v1\0"


@dataclass(frozen=True)
class KbsSession:
    """A session cookie this broker made, not expired: who the guest said it is."""

    id_hash: str  # base64url SHA-256 of the cookie: the store's key and the records' name
    tee: str
    expires_at: datetime
    nonce_digest: bytes


def session_hash(cookie: str) -> str:
    """How the store and the records name a session (never by the cookie itself)."""
    return b64url_encode(hashlib.sha256(b"kbs-session-id\0" + cookie.encode("ascii")).digest())


class SessionCodec:
    """Makes and opens session cookies under a key derived from the challenge key."""

    def __init__(self, challenge_key: bytes, ttl: timedelta) -> None:
        self._key = hmac.new(challenge_key, KEY_CONTEXT, hashlib.sha256).digest()
        self.ttl = ttl

    def issue(self, tee: str, nonce: str, now: datetime) -> tuple[str, KbsSession]:
        """A new cookie for a guest of ``tee`` handed ``nonce``; the session it opens to."""
        expires = math.ceil((now + self.ttl).timestamp())
        body = (
            VERSION
            + secrets.token_bytes(RANDOM_BYTES)
            + struct.pack(">I", expires)
            + bytes([TEE_NUMBERS[tee]])
            + _nonce_digest(nonce)
        )
        cookie = b64url_encode(body + self._mac(body))
        return cookie, self._session(cookie, body)

    def open(self, cookie: str | None, now: datetime) -> KbsSession:
        """The session of a presented cookie.

        Raises:
            AttestationError: ``kbs_session_invalid`` (absent, malformed, not made here),
                ``kbs_session_expired``.
        """
        if not cookie:
            raise AttestationError(
                f"no {COOKIE_NAME} cookie: start with POST /kbs/v0/auth",
                code=ErrorCode.KBS_SESSION_INVALID,
            )
        try:
            raw = b64url_decode(cookie) if len(cookie) <= MAX_COOKIE_CHARS else b""
        except ValueError:
            raw = b""
        body, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if (
            len(raw) != COOKIE_BYTES
            or raw[:1] != VERSION
            or not hmac.compare_digest(mac, self._mac(body))
            or body[21] not in TEE_BY_NUMBER
        ):
            raise AttestationError(
                "the session cookie was not made by this broker; start again",
                code=ErrorCode.KBS_SESSION_INVALID,
            )
        session = self._session(cookie, body)
        if session.expires_at <= now:
            raise AttestationError(
                "the session expired; start again", code=ErrorCode.KBS_SESSION_EXPIRED
            )
        return session

    @staticmethod
    def check_nonce(session: KbsSession, nonce: str) -> None:
        """The attested nonce is the one handed out with this session's cookie.

        Raises:
            AttestationError: ``kbs_session_invalid``.
        """
        if not hmac.compare_digest(session.nonce_digest, _nonce_digest(nonce)):
            raise AttestationError(
                "the nonce was not handed out with this session cookie; start again",
                code=ErrorCode.KBS_SESSION_INVALID,
            )

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, MAC_CONTEXT + body, hashlib.sha256).digest()[:MAC_BYTES]

    @staticmethod
    def _session(cookie: str, body: bytes) -> KbsSession:
        (expires,) = struct.unpack(">I", body[17:21])
        return KbsSession(
            id_hash=session_hash(cookie),
            tee=TEE_BY_NUMBER[body[21]],
            expires_at=datetime.fromtimestamp(expires, UTC),
            nonce_digest=body[22:],
        )


def _nonce_digest(nonce: str) -> bytes:
    return hashlib.sha256(nonce.encode("utf-8", "surrogatepass")).digest()[:NONCE_DIGEST_BYTES]
