"""Attestation stores replicas share: Redis and PostgreSQL (``stores/attestations.py`` opens
them; their clients load only when one is configured)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import asyncpg
from redis.exceptions import RedisError, WatchError

from broker.attestation.stored import (
    KEPT_WHILE_OWED,
    AttestationEntry,
    Change,
    ParsedEntries,
    parsed_entries,
    unavailable,
)
from broker.stores.clients_shared import PostgresPool, redis_client

log = logging.getLogger(__name__)
SCAN_BATCH = 500


class RedisAttestations:
    """``broker:attestation:<jti>`` holds the entry's JSON and expires with it (``EXAT``); a
    revocation rewrites it under ``WATCH`` (optimistic). While its revocation record is owed
    the key does not expire and its jti is in the set ``broker:attestations-owed``, changed in
    the same transaction: a member whose key is gone was dropped (evicted) unwritten."""

    PREFIX = "broker:attestation:"
    OWED = "broker:attestations-owed"  # not under PREFIX: ``unexpired``'s scan skips it

    def __init__(self, url: str, *, timeout: float) -> None:
        self._client = redis_client(url, timeout=timeout)
        self._parsed = ParsedEntries()  # a release's read: equal text, the same entry

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
        entry = self._parsed.parse(body)
        return entry if entry.expires_at > now else None

    async def update(
        self, jti: str, now: datetime, change: Change, *, expired_too: bool = False
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
                        if before.expires_at <= now and not expired_too:
                            return None
                        after = change(before)
                        pipe.multi()  # type: ignore[no-untyped-call]
                        if after.owed:  # kept until its record is written
                            pipe.set(key, after.to_json().encode())
                            pipe.sadd(self.OWED, jti)
                        else:  # an expiry already past deletes it
                            exat = int(after.kept_until.timestamp()) + 1
                            pipe.set(key, after.to_json().encode(), exat=exat)
                            pipe.srem(self.OWED, jti)
                        await pipe.execute()
                        return before, after
                    except WatchError:  # another update got there first: read it again
                        continue
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        bodies: list[bytes] = []
        try:
            async for batch in _batches(
                self._client.scan_iter(match=self.PREFIX + "*", count=SCAN_BATCH)
            ):
                bodies.extend(body for body in await self._client.mget(batch) if body is not None)
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc
        entries = parsed_entries(bodies)  # one in an unexpected form: skipped
        return [e for e in entries if e.expires_at > now]

    async def owed(self) -> list[AttestationEntry]:
        try:
            jtis = sorted(await self._client.smembers(self.OWED))  # type: ignore[misc]
            if not jtis:
                return []
            bodies = await self._client.mget([self.PREFIX.encode() + jti for jti in jtis])
            missing = [jti for jti, body in zip(jtis, bodies, strict=True) if body is None]
            if missing:
                await self._forget_dropped(missing)
        except (RedisError, OSError) as exc:
            raise unavailable("redis", exc) from exc
        entries = parsed_entries(body for body in bodies if body is not None)  # bad ones: skipped
        return [entry for entry in entries if entry.owed]

    async def _forget_dropped(self, missing: list[bytes]) -> None:
        """Owed jtis whose key was read gone: those still owed now were dropped unwritten (a
        record written takes its jti out of the set in the write that may delete the key)."""
        still = await self._client.smismember(self.OWED, missing)  # type: ignore[misc]
        dropped = [jti.decode() for jti, owed in zip(missing, still, strict=True) if owed]
        if dropped:
            log.error(
                "revocation records owed for %s are lost: Redis dropped their entries "
                "(evicted? its maxmemory-policy must not be allkeys-*)",
                dropped,
            )
            await self._client.srem(self.OWED, *dropped)  # type: ignore[misc]

    async def close(self) -> None:
        await self._client.aclose()


# ``expires_at`` is when the row may be deleted: the entry's expiry, or ``KEPT_WHILE_OWED``
# while its revocation record is owed (the body holds the expiry itself)
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
        self._parsed = ParsedEntries()  # a release's read: equal text, the same entry

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
        entry = None if body is None else self._parsed.parse(body)
        return (
            entry if entry is not None and entry.expires_at > now else None
        )  # kept for its record: expired

    async def update(
        self, jti: str, now: datetime, change: Change, *, expired_too: bool = False
    ) -> tuple[AttestationEntry, AttestationEntry] | None:
        async def rewrite(db: asyncpg.Connection) -> Any:
            async with db.transaction():
                body = await db.fetchval(
                    "SELECT body FROM broker_attestations WHERE jti = $1 FOR UPDATE", jti
                )
                if body is None:
                    return None
                before = AttestationEntry.from_json(body)
                if before.expires_at <= now and not expired_too:
                    return None
                after = change(before)
                await db.execute(
                    "UPDATE broker_attestations SET body = $2, expires_at = $3 WHERE jti = $1",
                    jti,
                    after.to_json(),
                    after.kept_until,
                )
                return before, after

        result: tuple[AttestationEntry, AttestationEntry] | None = await self._pool.run(rewrite)
        return result

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        async def select(db: asyncpg.Connection) -> Any:
            return await db.fetch("SELECT body FROM broker_attestations WHERE expires_at > $1", now)

        rows = await self._pool.run(select)
        entries = parsed_entries(row["body"] for row in rows)  # one in an unexpected form: skipped
        return [entry for entry in entries if entry.expires_at > now]  # not those kept, expired

    async def owed(self) -> list[AttestationEntry]:
        async def select(db: asyncpg.Connection) -> Any:
            return await db.fetch(
                "SELECT body FROM broker_attestations WHERE expires_at >= $1", KEPT_WHILE_OWED
            )

        return parsed_entries(row["body"] for row in await self._pool.run(select))  # bad: skipped

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
