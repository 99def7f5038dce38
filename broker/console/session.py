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
to ``console.revoked`` beside it (every worker reads it before it accepts a cookie), until the
latest moment any copy of that session could still be open — its log-in plus
``MAX_SESSION_SECONDS`` (and the clock skew), not the logged-out cookie's own expiry: a copy
renewed before the log-out expires later. Entries are dropped once past it, so the file stays
as small as the sessions that could still be alive. A file past ``MAX_REVOKED_BYTES`` is not
read partly (a newer entry would be missed): every session is refused, with an error in the
log, until its entries expire (fail closed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
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
MAX_REVOKED_BYTES = 1024 * 1024  # ~13,000 log-outs within MAX_SESSION_SECONDS; past it: fail closed
VERSION = "v1"
AUDITOR = "auditor"
log = logging.getLogger(__name__)


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
        no longer holds the ``auditor`` role alone. (Revocation is checked by ``is_revoked``.)"""
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
        """``token:<12 hex>`` of the configured token the ref names, if it is an auditor-only
        one (a token given another role since ends its sessions, as one that lost the role)."""
        found = None
        for digest in (*admin.token_sha256, *(d for d, _ in admin.tokens)):
            if hmac.compare_digest(self.token_ref(digest).encode(), ref.encode()):
                found = digest  # no early exit: every digest is compared
        if found is None or not auditor_only(admin.roles_of(found)):
            return None
        return f"token:{found[:12]}"

    def revoke(self, session: Session, now: int) -> None:
        """Write the session off for every worker until no copy of it can be open: its log-in
        plus ``MAX_SESSION_SECONDS`` (a copy renewed before the log-out lives past the logged-out
        cookie's expiry, never past that). Entries of the file past their time are dropped;
        every other one is kept, however many. Blocking."""
        until = session.login + MAX_SESSION_SECONDS + CLOCK_SKEW_SECONDS
        entry = f"{_sid_digest(session.sid)} {until}\n"
        fd = os.open(self._revoked, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "r+", encoding="ascii", errors="replace") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            live = [line.rstrip("\n") + "\n" for line in handle if _live(line, now)]
            handle.seek(0)
            handle.truncate()
            handle.write("".join(live) + entry)
            handle.flush()
            os.fsync(handle.fileno())
            if os.fstat(handle.fileno()).st_size > MAX_REVOKED_BYTES:
                self._overflowing()

    def is_revoked(self, session: Session) -> bool:
        """Whether a log-out wrote this session off — or the file is past its bound, when
        every session counts as written off (it is never read partly). Blocking."""
        with (
            contextlib.suppress(FileNotFoundError),
            self._revoked.open(encoding="ascii", errors="replace") as handle,
        ):
            text = handle.read(MAX_REVOKED_BYTES + 1)
            if len(text) > MAX_REVOKED_BYTES:
                self._overflowing()
                return True
            wanted = _sid_digest(session.sid)
            return any(line.split(" ")[0] == wanted for line in text.splitlines())
        return False

    def _overflowing(self) -> None:
        log.error(
            "console: %s holds more than %d bytes of log-outs: every console session is refused "
            "until they expire (at most %d s after their log-ins) or the file is removed",
            self._revoked,
            MAX_REVOKED_BYTES,
            MAX_SESSION_SECONDS,
        )


def auditor_only(roles: frozenset[str]) -> bool:
    """Whether a token's roles let it open the console: ``auditor`` and nothing else."""
    return roles == {AUDITOR}


def _sid_digest(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def _live(line: str, now: int) -> bool:
    _, _, until = line.rstrip("\n").partition(" ")
    return until.isascii() and until.isdigit() and int(until) > now
