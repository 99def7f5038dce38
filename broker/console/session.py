"""The console's session cookie: signed, short-lived, the same for every worker.

A session is a cookie value the broker signs and keeps nothing of:

    v1.<session id>.<token ref>.<login time>.<expiry>.<MAC>

* the session id: 16 random bytes (base64url), new at each log-in (no fixation);
* the token ref: HMAC of the auditor token's SHA-256 under the session key, so the cookie
  names the token without carrying it or its digest (a stolen cookie gives nothing to guess a
  token against), and a token removed from ``[admin]`` ends its sessions at the next request;
* times in Unix seconds: the log-in (a session is re-issued as it is used, never past
  ``MAX_SESSION_SECONDS`` after it) and the expiry (``SESSION_SECONDS`` after the last issue);
* the MAC: HMAC-SHA-256 under a key derived from the session key, over every field before it.

The session key is 32 random bytes in ``console.key`` beside the decision log (created 0600 by
the first process that starts; ``core/secrets_files.py``), so the workers of one host accept
each other's cookies and a restart keeps sessions. Logging out writes the session id's SHA-256
and expiry to ``console.revoked`` beside it (every worker reads it before it accepts a cookie);
entries are dropped once expired, so the file stays as small as the live sessions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from broker.config import AdminSettings
from broker.core.encoding import b64url_encode
from broker.core.secrets_files import load_or_create_secret

SESSION_SECONDS = 15 * 60  # idle lifetime: re-issued while used
MAX_SESSION_SECONDS = 8 * 60 * 60  # never longer than this after the log-in
CLOCK_SKEW_SECONDS = 60  # a cookie issued "in the future" by a worker whose clock runs ahead
MAX_COOKIE_CHARS = 256
MAX_REVOKED_BYTES = 1024 * 1024  # a bound on what one read takes (live sessions only)
VERSION = "v1"
AUDITOR = "auditor"


@dataclass(frozen=True)
class Session:
    """A verified session: who (as records name a token) and its times."""

    sid: str
    token_ref: str
    who: str
    login: int
    expires: int

    def due_for_renewal(self, now: int) -> bool:
        """Past half its idle lifetime, and a renewal would extend it."""
        return self.expires - now < SESSION_SECONDS // 2 and self.login + MAX_SESSION_SECONDS > now


SESSION: web.RequestKey[Session] = web.RequestKey("console_session", Session)


class SessionKeys:
    """The MAC and token-ref keys of ``console.key``, and the revocation file beside it."""

    def __init__(self, secret: bytes, revoked: Path) -> None:
        self._mac_key = hmac.new(secret, b"broker-console/session-mac", hashlib.sha256).digest()
        self._ref_key = hmac.new(secret, b"broker-console/token-ref", hashlib.sha256).digest()
        self._revoked = revoked

    @classmethod
    def beside(cls, log: Path) -> SessionKeys:
        """The keys of ``<log directory>/console.key`` (created if absent). Blocking.

        Raises:
            ConfigError: ``audit.log`` when the key file cannot be created or read.
        """
        secret = load_or_create_secret(log.parent / "console.key", "audit.log")
        return cls(secret, log.parent / "console.revoked")

    def token_ref(self, digest: str) -> str:
        return b64url_encode(hmac.new(self._ref_key, digest.encode(), hashlib.sha256).digest()[:16])

    def _mac(self, fields: list[str]) -> str:
        message = "\n".join(["broker-console-session", *fields]).encode()
        return b64url_encode(hmac.new(self._mac_key, message, hashlib.sha256).digest())

    def issue(self, digest: str, now: int) -> str:
        """A new session for the token whose SHA-256 (hex) is ``digest``."""
        return self._seal(b64url_encode(secrets.token_bytes(16)), self.token_ref(digest), now, now)

    def renew(self, session: Session, now: int) -> str:
        """The same session, its expiry moved on (never past the log-in's maximum)."""
        return self._seal(session.sid, session.token_ref, session.login, now)

    def _seal(self, sid: str, ref: str, login: int, now: int) -> str:
        expires = min(now + SESSION_SECONDS, login + MAX_SESSION_SECONDS)
        fields = [VERSION, sid, ref, str(login), str(expires)]
        return ".".join([*fields, self._mac(fields)])

    def open(self, cookie: str, admin: AdminSettings, now: int) -> Session | None:
        """The session the cookie holds, or ``None``: malformed, forged, expired, or its token
        no longer holds the ``auditor`` role. (Revocation is checked by ``is_revoked``.)"""
        usable = len(cookie) <= MAX_COOKIE_CHARS and cookie.isascii() and cookie.isprintable()
        parts = cookie.split(".") if usable else []  # aiohttp keeps undecodable bytes as surrogates
        if len(parts) != 6 or parts[0] != VERSION:
            return None
        *fields, mac = parts
        if not hmac.compare_digest(mac.encode(), self._mac(fields).encode()):
            return None
        _, sid, ref, login_text, expires_text = fields
        if not (login_text.isdigit() and expires_text.isdigit()):
            return None  # only this broker's MAC key makes cookies: never, but never a 500
        login, expires = int(login_text), int(expires_text)
        if not (login - CLOCK_SKEW_SECONDS <= now < expires):
            return None
        who = self._auditor(ref, admin)
        return None if who is None else Session(sid, ref, who, login, expires)

    def _auditor(self, ref: str, admin: AdminSettings) -> str | None:
        """``token:<12 hex>`` of the configured token the ref names, if it is an auditor's."""
        found = None
        for digest in (*admin.token_sha256, *(d for d, _ in admin.tokens)):
            if hmac.compare_digest(self.token_ref(digest).encode(), ref.encode()):
                found = digest  # no early exit: every digest is compared
        if found is None or AUDITOR not in admin.roles_of(found):
            return None
        return f"token:{found[:12]}"

    def revoke(self, session: Session, now: int) -> None:
        """Write the session off for every worker until it would have expired. Blocking."""
        entry = f"{_sid_digest(session.sid)} {session.expires}\n"
        fd = os.open(self._revoked, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "r+", encoding="ascii") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            live = [
                line for line in handle.read(MAX_REVOKED_BYTES).splitlines() if _live(line, now)
            ]
            handle.seek(0)
            handle.truncate()
            handle.write("".join(f"{line}\n" for line in live) + entry)
            handle.flush()
            os.fsync(handle.fileno())

    def is_revoked(self, session: Session) -> bool:
        """Whether a log-out wrote this session off. Blocking."""
        with contextlib.suppress(FileNotFoundError), self._revoked.open(encoding="ascii") as handle:
            wanted = _sid_digest(session.sid)
            return any(
                line.split(" ")[0] == wanted for line in handle.read(MAX_REVOKED_BYTES).splitlines()
            )
        return False


def _sid_digest(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def _live(line: str, now: int) -> bool:
    _, _, expires = line.partition(" ")
    return expires.isdigit() and int(expires) > now
