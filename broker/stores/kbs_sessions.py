"""Attested KBS sessions, shared by every worker and replica (docs/kbs.md): the token a guest
was answered at ``POST /kbs/v0/attest``, under the SHA-256 of its session cookie (never the
cookie), until the first of the session's and the token's expiry. A resource request with the
cookie reads it here on any worker or replica, then verifies it like a Bearer token: the store
is trusted to say which of this broker's tokens a session holds, never for a token's content.

Before a guest attests nothing is stored (``decisions/kbs_session.py``). The store is the
nonce store's (``[nonces] store``), as for attestation results: ``memory`` (one process, at
most ``capacity`` sessions, the oldest forgotten first: that guest attests again),
``sqlite:///PATH`` (one host), ``redis://…`` and ``postgresql://…`` (replicas;
``kbs_sessions_shared.py``). A store that does not answer is ``503 nonce_store_unavailable``.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from broker.core.errors import ConfigError
from broker.core.refs import MemoryRef, PostgresRef, RedisRef, SqliteRef, StoreRef
from broker.stores.clients import SqliteThread
from broker.stores.nonces import unavailable

MAX_TOKEN_CHARS = 16 * 1024  # a token read back longer than this is not one the broker wrote


@dataclass(frozen=True)
class AttestedSession:
    id_hash: str  # ``kbs_session.session_hash`` of the cookie
    token: str
    expires_at: datetime


class KbsSessionStore(Protocol):
    async def put(self, session: AttestedSession, now: datetime) -> None:
        """Hold ``session`` (replacing one under its hash) until it expires."""
        ...

    async def get(self, id_hash: str, now: datetime) -> AttestedSession | None:
        """The unexpired session under ``id_hash``, or ``None``."""
        ...

    async def close(self) -> None: ...


class MemoryKbsSessions:
    """One process (``[nonces] store = "memory"``), at most ``capacity`` sessions."""

    def __init__(self, *, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self._sessions: dict[str, AttestedSession] = {}

    async def put(self, session: AttestedSession, now: datetime) -> None:
        if len(self._sessions) >= self._capacity:  # the expired first, then the oldest
            self._sessions = {k: s for k, s in self._sessions.items() if s.expires_at > now}
            while len(self._sessions) >= self._capacity:
                del self._sessions[next(iter(self._sessions))]
        self._sessions.pop(session.id_hash, None)
        self._sessions[session.id_hash] = session

    async def get(self, id_hash: str, now: datetime) -> AttestedSession | None:
        session = self._sessions.get(id_hash)
        return session if session is not None and session.expires_at > now else None

    async def close(self) -> None:
        self._sessions.clear()


class SqliteKbsSessions:
    """Processes on one host share the nonce store's SQLite file (table ``kbs_sessions``)."""

    def __init__(self, path: Path, *, timeout: float) -> None:
        self._db = SqliteThread(
            path,
            timeout=timeout,
            schema=_SQLITE_SCHEMA,
            thread_name="kbs-sqlite",
            unavailable=unavailable,
        )

    async def put(self, session: AttestedSession, now: datetime) -> None:
        def insert(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM kbs_sessions WHERE expires_at <= ?", (now.timestamp(),))
            db.execute(
                "INSERT OR REPLACE INTO kbs_sessions (id, expires_at, token) VALUES (?, ?, ?)",
                (session.id_hash, session.expires_at.timestamp(), session.token),
            )

        await self._db.run(insert)

    async def get(self, id_hash: str, now: datetime) -> AttestedSession | None:
        def select(db: sqlite3.Connection) -> tuple[float, str] | None:
            row = db.execute(
                "SELECT expires_at, token FROM kbs_sessions WHERE id = ? AND expires_at > ?",
                (id_hash, now.timestamp()),
            ).fetchone()
            return None if row is None else (float(row[0]), str(row[1]))

        row = await self._db.run(select)
        return None if row is None else read_back(id_hash, row[0], row[1])

    async def close(self) -> None:
        await self._db.close()


def read_back(id_hash: str, expires: float, token: str) -> AttestedSession | None:
    """A stored session as read back; a token no broker would write is none (it is verified
    before any use anyway)."""
    if not 0 < len(token) <= MAX_TOKEN_CHARS or not token.isascii():
        return None
    return AttestedSession(id_hash, token, datetime.fromtimestamp(expires, UTC))


_SQLITE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kbs_sessions (id TEXT PRIMARY KEY, "
    "expires_at REAL NOT NULL, token TEXT NOT NULL) WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS kbs_sessions_expiry ON kbs_sessions (expires_at);"
)


def open_kbs_session_store(store: StoreRef, *, timeout: float, capacity: int) -> KbsSessionStore:
    """The store ``[nonces] store`` names (``NonceSettings.store_ref``)."""
    if isinstance(store, MemoryRef):
        return MemoryKbsSessions(capacity=capacity)
    if isinstance(store, SqliteRef):
        return SqliteKbsSessions(store.path, timeout=timeout)
    # The Redis and PostgreSQL clients load only where such a store is configured.
    if isinstance(store, RedisRef):
        from broker.stores.kbs_sessions_shared import RedisKbsSessions  # noqa: PLC0415

        return RedisKbsSessions(store.uri, timeout=timeout)
    if isinstance(store, PostgresRef):
        from broker.stores.kbs_sessions_shared import PostgresKbsSessions  # noqa: PLC0415

        return PostgresKbsSessions(store.uri, timeout=timeout)
    raise ConfigError("nonces.store", f"{store.kind} cannot hold KBS sessions")
