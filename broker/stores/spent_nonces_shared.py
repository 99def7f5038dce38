"""Spent-nonce stores that replicas share: Redis and PostgreSQL (``spent_nonces.py`` opens
them; their clients load only when one is configured)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
from redis.exceptions import RedisError

from broker.stores.clients_shared import PostgresPool, redis_client
from broker.stores.nonces import reused_nonce, unavailable

# key prefix (Redis) and table (PostgreSQL) of each namespace (``spent_nonces.open_spent_store``);
# the challenges' are the names these stores have always used
REDIS_PREFIXES = {"challenge": "broker:spent:", "dpop_jti": "broker:spent-dpop-jti:"}
PG_TABLES = {"challenge": "broker_spent_nonces", "dpop_jti": "broker_spent_dpop_jtis"}


class RedisSpentNonces:
    """Replicas share a Redis database: ``SET <prefix><nonce> 1 NX EXAT <expiry>``, one atomic
    command; Redis forgets the key when the nonce would have expired (memory bounded by the rate
    of verified releases times the TTL). Each namespace has its own prefix."""

    def __init__(self, url: str, *, timeout: float, namespace: str = "challenge") -> None:
        self._client = redis_client(url, timeout=timeout)
        self.prefix = REDIS_PREFIXES[namespace]

    async def spend(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        try:
            created = await self._client.set(
                self.prefix + nonce, b"1", nx=True, exat=int(expires_at.timestamp())
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


def _pg_schema(table: str) -> str:
    return f"""
CREATE TABLE IF NOT EXISTS {table} (
    nonce text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS {table}_expiry ON {table} (expires_at);
"""


_PG_SCHEMA_LOCK = 0x6E6F6E6365  # pg_advisory_xact_lock key: replicas create the table one at a time
PG_PURGE_EVERY = 256  # delete expired rows on one spend in this many (each replica)


class PostgresSpentNonces:
    """Replicas share a PostgreSQL table, ``broker_spent_nonces`` for challenges and
    ``broker_spent_dpop_jtis`` for DPoP ``jti``s (created on first use).

    A nonce is spent by one ``INSERT … ON CONFLICT DO NOTHING``: the unique index lets exactly one
    of any concurrent inserts through. Expired rows are deleted now and then, by any replica.
    """

    def __init__(self, dsn: str, *, timeout: float, namespace: str = "challenge") -> None:
        self._table = table = PG_TABLES[namespace]
        self._pool = PostgresPool(
            dsn,
            timeout=timeout,
            schema=_pg_schema(table),
            schema_lock=_PG_SCHEMA_LOCK,
            size=4 if namespace == "challenge" else 2,
            unavailable=unavailable,
        )
        self._spends = 0

    async def spend(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        self._spends += 1
        purge = self._spends % PG_PURGE_EVERY == 1
        table = self._table

        async def insert(db: asyncpg.Connection) -> str:
            if purge:
                await db.execute(f"DELETE FROM {table} WHERE expires_at <= $1", now)  # noqa: S608
            status: str = await db.execute(
                f"INSERT INTO {table} (nonce, expires_at) VALUES ($1, $2) "  # noqa: S608
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
