"""Attested KBS sessions replicas share: Redis and PostgreSQL (``kbs_sessions.py`` opens them;
their clients load only when one is configured)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
from redis.exceptions import RedisError

from broker.stores.clients_shared import PostgresPool, redis_client
from broker.stores.kbs_sessions import AttestedSession, read_back
from broker.stores.nonces import unavailable


class RedisKbsSessions:
    """``broker:kbs-session:<hash>`` holds ``<expiry>:<token>`` and expires with the session
    (``EXAT``)."""

    PREFIX = "broker:kbs-session:"

    def __init__(self, url: str, *, timeout: float) -> None:
        self._client = redis_client(url, timeout=timeout)

    async def put(self, session: AttestedSession, now: datetime) -> None:
        expires = int(session.expires_at.timestamp())
        try:
            await self._client.set(
                self.PREFIX + session.id_hash,
                f"{expires}:{session.token}".encode("ascii"),
                exat=expires,
            )
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc

    async def get(self, id_hash: str, now: datetime) -> AttestedSession | None:
        try:
            value = await self._client.get(self.PREFIX + id_hash)
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc
        expires, _, token = (value or b"").decode("ascii", "replace").partition(":")
        if not expires.isdigit() or int(expires) <= now.timestamp():
            return None
        return read_back(id_hash, float(expires), token)

    async def close(self) -> None:
        await self._client.aclose()


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS broker_kbs_sessions (
    id text PRIMARY KEY,
    expires_at timestamptz NOT NULL,
    token text NOT NULL
);
CREATE INDEX IF NOT EXISTS broker_kbs_sessions_expiry ON broker_kbs_sessions (expires_at);
"""
_PG_SCHEMA_LOCK = 0x6B6273  # pg_advisory_xact_lock key ("kbs"): replicas create it one at a time
PG_PURGE_EVERY = 256  # delete expired rows on one put in this many (each replica)


class PostgresKbsSessions:
    """Replicas share the table ``broker_kbs_sessions`` (created on first use)."""

    def __init__(self, dsn: str, *, timeout: float) -> None:
        self._pool = PostgresPool(
            dsn,
            timeout=timeout,
            schema=_PG_SCHEMA,
            schema_lock=_PG_SCHEMA_LOCK,
            size=2,
            unavailable=unavailable,
        )
        self._puts = 0

    async def put(self, session: AttestedSession, now: datetime) -> None:
        self._puts += 1
        purge = self._puts % PG_PURGE_EVERY == 1

        async def upsert(db: asyncpg.Connection) -> None:
            if purge:
                await db.execute("DELETE FROM broker_kbs_sessions WHERE expires_at <= $1", now)
            await db.execute(
                "INSERT INTO broker_kbs_sessions (id, expires_at, token) VALUES ($1, $2, $3) "
                "ON CONFLICT (id) DO UPDATE SET expires_at = $2, token = $3",
                session.id_hash,
                session.expires_at,
                session.token,
            )

        await self._pool.run(upsert)

    async def get(self, id_hash: str, now: datetime) -> AttestedSession | None:
        async def select(db: asyncpg.Connection) -> Any:
            return await db.fetchrow(
                "SELECT expires_at, token FROM broker_kbs_sessions "
                "WHERE id = $1 AND expires_at > $2",
                id_hash,
                now,
            )

        row = await self._pool.run(select)
        if row is None:
            return None
        return read_back(id_hash, row["expires_at"].timestamp(), str(row["token"]))

    async def close(self) -> None:
        await self._pool.close()
