"""Spent-nonce stores that replicas share: Redis and PostgreSQL (``nonce_stores.py`` opens them;
their clients load only when one is configured)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
from redis.exceptions import RedisError

from broker.nonces import reused_nonce, unavailable
from broker.store_clients_shared import PostgresPool, redis_client


class RedisSpentNonces:
    """Replicas share a Redis database: ``SET broker:spent:<nonce> 1 NX EXAT <expiry>``, one
    atomic command; Redis forgets the key when the nonce would have expired (memory bounded by
    the release rate times the TTL)."""

    PREFIX = "broker:spent:"

    def __init__(self, url: str, *, timeout: float) -> None:
        self._client = redis_client(url, timeout=timeout)

    async def spend(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        try:
            created = await self._client.set(
                self.PREFIX + nonce, b"1", nx=True, exat=int(expires_at.timestamp())
            )
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc
        if not created:
            raise reused_nonce()

    async def check(self) -> None:
        try:
            await self._client.ping()  # type: ignore[misc]
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc

    async def close(self) -> None:
        await self._client.aclose()


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS broker_spent_nonces (
    nonce text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS broker_spent_nonces_expiry ON broker_spent_nonces (expires_at);
"""
_PG_SCHEMA_LOCK = 0x6E6F6E6365  # pg_advisory_xact_lock key: replicas create the table one at a time
PG_PURGE_EVERY = 256  # delete expired rows on one spend in this many (each replica)


class PostgresSpentNonces:
    """Replicas share a PostgreSQL table ``broker_spent_nonces`` (created on first use).

    A nonce is spent by one ``INSERT … ON CONFLICT DO NOTHING``: the unique index lets exactly one
    of any concurrent inserts through. Expired rows are deleted now and then, by any replica.
    """

    def __init__(self, dsn: str, *, timeout: float) -> None:
        self._pool = PostgresPool(
            dsn,
            timeout=timeout,
            schema=_PG_SCHEMA,
            schema_lock=_PG_SCHEMA_LOCK,
            size=4,
            unavailable=unavailable,
        )
        self._spends = 0

    async def spend(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        self._spends += 1
        purge = self._spends % PG_PURGE_EVERY == 1

        async def insert(db: asyncpg.Connection) -> str:
            if purge:
                await db.execute("DELETE FROM broker_spent_nonces WHERE expires_at <= $1", now)
            status: str = await db.execute(
                "INSERT INTO broker_spent_nonces (nonce, expires_at) VALUES ($1, $2) "
                "ON CONFLICT (nonce) DO NOTHING",
                nonce,
                expires_at,
            )
            return status

        if await self._pool.run(insert) != "INSERT 0 1":
            raise reused_nonce()

    async def check(self) -> None:
        async def ping(db: asyncpg.Connection) -> Any:
            return await db.fetchval("SELECT 1")

        await self._pool.run(ping)

    async def close(self) -> None:
        await self._pool.close()
