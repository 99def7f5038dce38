"""The Redis client and the asyncpg pool the replica stores share (``stores/clients.py`` says why
they are written once); loaded only where such a store is configured."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from broker.stores.clients import Unavailable


def redis_client(url: str, *, timeout: float) -> aioredis.Redis:
    """A client that answers or fails within ``timeout`` (no retry hiding an outage)."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry_on_timeout=False,
        decode_responses=False,
        # No CLIENT SETINFO: it would read the package metadata (file I/O) on the event loop at
        # each new connection.
        driver_info=None,
    )


class PostgresPool:
    """An asyncpg pool opened on first use, its ``schema`` created then under a transaction-scoped
    advisory lock (replicas starting together create it one at a time). Connections open once
    and stay open: asyncpg reads ~/.pgpass and TLS files (a local stat) whenever it opens one, so
    that happens at start-up, not per request."""

    def __init__(
        self,
        dsn: str,
        *,
        timeout: float,
        schema: str,
        schema_lock: int,
        size: int,
        unavailable: Unavailable,
    ) -> None:
        self._dsn = dsn
        self._timeout = timeout
        self._schema = schema
        self._schema_lock = schema_lock
        self._size = size
        self._unavailable = unavailable
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()

    async def run(self, operation: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        """``operation(connection)`` within the store's timeout.

        Raises: what ``unavailable`` makes of a PostgreSQL, connection or timeout error."""
        try:
            async with asyncio.timeout(self._timeout):
                pool = await self._open()
                async with pool.acquire() as db:
                    return await operation(db)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise self._unavailable("postgresql", exc) from exc

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _open(self) -> asyncpg.Pool:
        async with self._opening:
            if self._pool is None:
                pool = await asyncpg.create_pool(
                    self._dsn,
                    min_size=self._size,
                    max_size=self._size,
                    max_inactive_connection_lifetime=0,
                )
                async with pool.acquire() as db, db.transaction():
                    await db.execute("SELECT pg_advisory_xact_lock($1)", self._schema_lock)
                    await db.execute(self._schema)
                self._pool = pool
            return self._pool
