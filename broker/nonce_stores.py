"""Shared nonce stores: SQLite (processes on one host), Redis and PostgreSQL (replicas).

Both keep the memory store's contract (``broker.nonces.NonceStore``): a nonce is spent by one
atomic step in the store itself, so of any number of concurrent uses across processes and
replicas exactly one succeeds; the others see ``nonce_reused``. Any failure to get an answer
(store down, locked past the timeout, disk error) is ``503 nonce_store_unavailable`` — never a
nonce treated as valid.
"""

from __future__ import annotations

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from broker.config import NONCE_STORE_FORMS
from broker.errors import ConfigError
from broker.nonces import (
    MAX_NONCE_CHARS,
    Challenge,
    MemoryNonceStore,
    NonceStore,
    new_nonce,
    reused_nonce,
    store_full,
    store_unavailable,
    unknown_nonce,
)


def open_nonce_store(uri: str, *, ttl: timedelta, capacity: int, timeout: float) -> NonceStore:
    """The store ``[nonces] store`` names (validated by the config loader)."""
    if uri == "memory":
        return MemoryNonceStore(ttl=ttl, capacity=capacity)
    if uri.startswith("sqlite:///"):
        return SqliteNonceStore(
            Path(uri.removeprefix("sqlite://")), ttl=ttl, capacity=capacity, timeout=timeout
        )
    if uri.startswith(("redis://", "rediss://")):
        return RedisNonceStore(uri, ttl=ttl, timeout=timeout)
    if uri.startswith(("postgresql://", "postgres://")):
        return PostgresNonceStore(uri, ttl=ttl, capacity=capacity, timeout=timeout)
    raise ConfigError("nonces.store", NONCE_STORE_FORMS)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS nonces (
    nonce TEXT PRIMARY KEY,
    expires_at REAL NOT NULL,
    consumed INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS nonces_expiry ON nonces (expires_at);
"""


class SqliteNonceStore:
    """Processes on one host share a SQLite file (WAL, ``synchronous=FULL``).

    Single use comes from one ``UPDATE … WHERE consumed = 0`` under SQLite's database write
    lock. ``synchronous=FULL``: a spent mark survives a power loss, so a replay after a crash
    finds the nonce spent. Calls run on one dedicated thread with its own connection.
    """

    def __init__(self, path: Path, *, ttl: timedelta, capacity: int, timeout: float) -> None:
        self._path = path
        self._ttl = ttl
        self._capacity = capacity
        self._timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nonce-sqlite")
        self._connection: sqlite3.Connection | None = None

    async def issue(self, now: datetime) -> Challenge:
        nonce = new_nonce()
        expires_at = now + self._ttl
        inserted = await self._run(self._issue, nonce, now.timestamp(), expires_at.timestamp())
        if not inserted:
            raise store_full()
        return Challenge(nonce=nonce, expires_at=expires_at)

    async def consume(self, nonce: str, now: datetime) -> None:
        if len(nonce) > MAX_NONCE_CHARS:
            raise unknown_nonce()
        outcome = await self._run(self._consume, nonce, now.timestamp())
        if outcome == "reused":
            raise reused_nonce()
        if outcome == "unknown":
            raise unknown_nonce()

    async def check(self) -> None:
        await self._run(lambda db: db.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        def shut() -> None:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

        await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        self._executor.shutdown(wait=True)

    async def _run(self, operation: Any, *args: Any) -> Any:
        def call() -> Any:
            return operation(self._db(), *args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except (sqlite3.Error, OSError) as exc:  # OSError: its directory cannot be created
            raise store_unavailable() from exc

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self._path, timeout=self._timeout, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            self._connection = db
        return self._connection

    def _issue(self, db: sqlite3.Connection, nonce: str, now: float, expires_at: float) -> bool:
        db.execute("BEGIN IMMEDIATE")
        with db:  # commits the transaction, or rolls it back on an exception
            db.execute("DELETE FROM nonces WHERE expires_at <= ?", (now,))
            (count,) = db.execute("SELECT count(*) FROM nonces").fetchone()
            if count >= self._capacity:
                return False
            db.execute("INSERT INTO nonces (nonce, expires_at) VALUES (?, ?)", (nonce, expires_at))
            return True

    def _consume(self, db: sqlite3.Connection, nonce: str, now: float) -> str:
        spent = db.execute(
            "UPDATE nonces SET consumed = 1 WHERE nonce = ? AND consumed = 0 AND expires_at > ?",
            (nonce, now),
        ).rowcount
        if spent == 1:
            return "ok"
        row = db.execute(
            "SELECT consumed FROM nonces WHERE nonce = ? AND expires_at > ?", (nonce, now)
        ).fetchone()
        return "reused" if row is not None and row[0] else "unknown"


# Spend a nonce in one step: absent → 0 (unknown or expired), spent → 2, fresh → 1 and spent.
# The key keeps its TTL (KEEPTTL), so the tombstone expires when the nonce would have.
_CONSUME = """
local value = redis.call('GET', KEYS[1])
if not value then return 0 end
if value == '1' then return 2 end
redis.call('SET', KEYS[1], '1', 'KEEPTTL')
return 1
"""


class RedisNonceStore:
    """Replicas share a Redis database; keys ``broker:nonce:<nonce>`` expire by Redis TTL.

    There is no outstanding-challenge cap here: Redis bounds memory (``maxmemory``, with the
    ``noeviction`` policy so live nonces are never evicted; an out-of-memory Redis refuses new
    challenges, which surfaces as 503 ``nonce_store_unavailable``).
    """

    PREFIX = "broker:nonce:"

    def __init__(self, url: str, *, ttl: timedelta, timeout: float) -> None:
        self._ttl = ttl
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
            decode_responses=False,
            # No CLIENT SETINFO: it would read the package metadata (file I/O) on the event loop
            # at each new connection.
            driver_info=None,
        )
        self._consume_script = self._client.register_script(_CONSUME)

    async def issue(self, now: datetime) -> Challenge:
        nonce = new_nonce()
        ttl_ms = int(self._ttl.total_seconds() * 1000)
        try:
            created = await self._client.set(self.PREFIX + nonce, b"0", nx=True, px=ttl_ms)
        except (RedisError, OSError) as exc:
            raise store_unavailable() from exc
        if not created:  # 256 random bits collided: never in practice; refuse rather than reuse
            raise store_unavailable()
        return Challenge(nonce=nonce, expires_at=now + self._ttl)

    async def consume(self, nonce: str, now: datetime) -> None:
        if len(nonce) > MAX_NONCE_CHARS:
            raise unknown_nonce()
        try:
            # redis-py's Script sends EVALSHA and falls back to EVAL after a script-cache flush.
            outcome = await self._consume_script(keys=[self.PREFIX + nonce])
        except (RedisError, OSError) as exc:
            raise store_unavailable() from exc
        if outcome == 2:
            raise reused_nonce()
        if outcome != 1:
            raise unknown_nonce()

    async def check(self) -> None:
        try:
            await self._client.ping()  # type: ignore[misc]
        except (RedisError, OSError) as exc:
            raise store_unavailable() from exc

    async def close(self) -> None:
        await self._client.aclose()


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS broker_nonces (
    nonce text PRIMARY KEY,
    expires_at timestamptz NOT NULL,
    consumed boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS broker_nonces_expiry ON broker_nonces (expires_at);
"""
_PG_SCHEMA_LOCK = 0x6E6F6E6365  # pg_advisory_xact_lock key: replicas create the table one at a time


class PostgresNonceStore:
    """Replicas share a PostgreSQL table ``broker_nonces`` (created on first use).

    A nonce is spent by one ``UPDATE … WHERE NOT consumed`` — the row lock serialises concurrent
    spenders and READ COMMITTED re-checks the condition, so exactly one sees a row. Expiry uses the
    broker's clock (as the SQLite store); the outstanding cap is checked in the insert itself.
    """

    def __init__(self, dsn: str, *, ttl: timedelta, capacity: int, timeout: float) -> None:
        self._dsn = dsn
        self._ttl = ttl
        self._capacity = capacity
        self._timeout = timeout
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()

    async def issue(self, now: datetime) -> Challenge:
        nonce = new_nonce()
        expires_at = now + self._ttl

        async def insert(db: asyncpg.Connection) -> str:
            await db.execute("DELETE FROM broker_nonces WHERE expires_at <= $1", now)
            status: str = await db.execute(
                "INSERT INTO broker_nonces (nonce, expires_at) SELECT $1, $2 "
                "WHERE (SELECT count(*) FROM broker_nonces WHERE expires_at > $3) < $4",
                nonce,
                expires_at,
                now,
                self._capacity,
            )
            return status

        if await self._run(insert) != "INSERT 0 1":
            raise store_full()
        return Challenge(nonce=nonce, expires_at=expires_at)

    async def consume(self, nonce: str, now: datetime) -> None:
        if len(nonce) > MAX_NONCE_CHARS:
            raise unknown_nonce()

        async def spend(db: asyncpg.Connection) -> str:
            spent = await db.fetchval(
                "UPDATE broker_nonces SET consumed = true "
                "WHERE nonce = $1 AND NOT consumed AND expires_at > $2 RETURNING 1",
                nonce,
                now,
            )
            if spent is not None:
                return "ok"
            consumed = await db.fetchval(
                "SELECT consumed FROM broker_nonces WHERE nonce = $1 AND expires_at > $2",
                nonce,
                now,
            )
            return "reused" if consumed else "unknown"

        outcome = await self._run(spend)
        if outcome == "reused":
            raise reused_nonce()
        if outcome == "unknown":
            raise unknown_nonce()

    async def check(self) -> None:
        async def ping(db: asyncpg.Connection) -> Any:
            return await db.fetchval("SELECT 1")

        await self._run(ping)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _run(self, operation: Any) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                pool = await self._open()
                async with pool.acquire() as db:
                    return await operation(db)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise store_unavailable() from exc

    async def _open(self) -> asyncpg.Pool:
        async with self._opening:
            if self._pool is None:
                # Connections open here and stay open: asyncpg reads ~/.pgpass and TLS files (a
                # local stat) whenever it opens one, so that happens at start-up, not per request.
                pool = await asyncpg.create_pool(
                    self._dsn, min_size=4, max_size=4, max_inactive_connection_lifetime=0
                )
                async with pool.acquire() as db, db.transaction():
                    await db.execute("SELECT pg_advisory_xact_lock($1)", _PG_SCHEMA_LOCK)
                    await db.execute(_PG_SCHEMA)
                self._pool = pool
            return self._pool
