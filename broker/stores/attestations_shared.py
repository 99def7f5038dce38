"""Attestation stores replicas share: Redis and PostgreSQL (``stores/attestations.py`` opens
them; their clients load only when one is configured)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
from redis.exceptions import RedisError, WatchError

from broker.attestation.stored import AttestationEntry, Change, unavailable
from broker.stores.clients_shared import PostgresPool, redis_client

SCAN_BATCH = 500


class RedisAttestations:
    """``broker:attestation:<jti>`` holds the entry's JSON and expires with it (``EXAT``); a
    revocation rewrites it under ``WATCH`` (optimistic), keeping the expiry."""

    PREFIX = "broker:attestation:"

    def __init__(self, url: str, *, timeout: float) -> None:
        self._client = redis_client(url, timeout=timeout)

    async def put(self, entry: AttestationEntry) -> None:
        try:
            await self._client.set(
                self.PREFIX + entry.jti,
                entry.to_json().encode(),
                exat=int(entry.expires_at.timestamp()) + 1,
            )
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc

    async def get(self, jti: str, now: datetime) -> AttestationEntry | None:
        try:
            body = await self._client.get(self.PREFIX + jti)
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc
        if body is None:
            return None
        entry = AttestationEntry.from_json(body)
        return entry if entry.expires_at > now else None

    async def update(
        self, jti: str, now: datetime, change: Change
    ) -> tuple[AttestationEntry, AttestationEntry] | None:
        key = self.PREFIX + jti
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        body = await pipe.get(key)
                        if body is None:
                            return None
                        before = AttestationEntry.from_json(body)
                        if before.expires_at <= now:
                            return None
                        after = change(before)
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.set(key, after.to_json().encode(), keepttl=True)
                        await pipe.execute()
                        return before, after
                    except WatchError:  # another update got there first: read it again
                        continue
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        entries: list[AttestationEntry] = []
        try:
            async for batch in _batches(
                self._client.scan_iter(match=self.PREFIX + "*", count=SCAN_BATCH)
            ):
                for body in await self._client.mget(batch):
                    if body is not None:
                        entries.append(AttestationEntry.from_json(body))
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc
        return [e for e in entries if e.expires_at > now]

    async def close(self) -> None:
        await self._client.aclose()


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS broker_attestations (
    jti text PRIMARY KEY,
    expires_at timestamptz NOT NULL,
    body text NOT NULL
);
CREATE INDEX IF NOT EXISTS broker_attestations_expiry ON broker_attestations (expires_at);
"""
_PG_SCHEMA_LOCK = 0x6174746573  # pg_advisory_xact_lock key: one replica creates the table


class PostgresAttestations:
    """Replicas share ``broker_attestations`` (created on first use); a revocation is one
    ``UPDATE … WHERE`` under a row lock."""

    def __init__(self, dsn: str, *, timeout: float) -> None:
        self._pool = PostgresPool(
            dsn,
            timeout=timeout,
            schema=_PG_SCHEMA,
            schema_lock=_PG_SCHEMA_LOCK,
            size=2,
            unavailable=unavailable,
        )

    async def put(self, entry: AttestationEntry) -> None:
        async def insert(db: asyncpg.Connection) -> None:
            await db.execute("DELETE FROM broker_attestations WHERE expires_at <= now()")
            await db.execute(
                "INSERT INTO broker_attestations (jti, expires_at, body) VALUES ($1, $2, $3)",
                entry.jti,
                entry.expires_at,
                entry.to_json(),
            )

        await self._pool.run(insert)

    async def get(self, jti: str, now: datetime) -> AttestationEntry | None:
        async def select(db: asyncpg.Connection) -> Any:
            return await db.fetchval(
                "SELECT body FROM broker_attestations WHERE jti = $1 AND expires_at > $2",
                jti,
                now,
            )

        body = await self._pool.run(select)
        return None if body is None else AttestationEntry.from_json(body)

    async def update(
        self, jti: str, now: datetime, change: Change
    ) -> tuple[AttestationEntry, AttestationEntry] | None:
        async def rewrite(db: asyncpg.Connection) -> Any:
            async with db.transaction():
                body = await db.fetchval(
                    "SELECT body FROM broker_attestations WHERE jti = $1 AND expires_at > $2 "
                    "FOR UPDATE",
                    jti,
                    now,
                )
                if body is None:
                    return None
                before = AttestationEntry.from_json(body)
                after = change(before)
                await db.execute(
                    "UPDATE broker_attestations SET body = $2 WHERE jti = $1", jti, after.to_json()
                )
                return before, after

        result: tuple[AttestationEntry, AttestationEntry] | None = await self._pool.run(rewrite)
        return result

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        async def select(db: asyncpg.Connection) -> Any:
            return await db.fetch("SELECT body FROM broker_attestations WHERE expires_at > $1", now)

        return [AttestationEntry.from_json(row["body"]) for row in await self._pool.run(select)]

    async def close(self) -> None:
        await self._pool.close()


async def _batches(keys: Any) -> Any:
    """``scan_iter``'s keys in lists of up to ``SCAN_BATCH`` (one ``MGET`` each)."""
    batch: list[Any] = []
    async for key in keys:
        batch.append(key)
        if len(batch) >= SCAN_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
