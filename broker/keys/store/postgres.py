"""PostgreSQL DEK store (``[keys] store = "postgresql://…"``): one store for many replicas.

The same contract as the SQLite store: one row per key version, wrapped material only; every
write is one statement (atomic, durable on commit); ``replace`` is a compare-and-swap on the
whole row it was read as (``UPDATE … WHERE`` state, wrapped DEK, ``kek_ref``, public half, and
not destroyed), so a ``rewrap`` or a lifecycle change racing another one on another replica
never writes a stale row back over a newer change (a destroyed version stays destroyed).

The schema is created and migrated only by ``broker keys migrate`` (under an advisory lock, one
transaction per step, the reached version recorded in ``broker_schema``). Opening the store
checks that version: a database that was never migrated, or was migrated by a newer broker, is
refused at start-up with what to run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from broker.core.errors import ConfigError, Conflict, ErrorCode, UpstreamError
from broker.core.protocol import Algorithm
from broker.keys.store.base import KeyVersionRecord, Purpose, VersionState

T = TypeVar("T")
COMPONENT = "keys"
SCHEMA_LOCK = 0x62726B6B  # "brkk": pg_advisory_xact_lock key for migrations
# Each step moves the schema from version i to i + 1; never edit a released step, append one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE broker_key_versions (
        name TEXT NOT NULL,
        version INTEGER NOT NULL CHECK (version > 0),
        purpose TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('enabled', 'disabled', 'destroyed')),
        wrapped_dek BYTEA NOT NULL,
        kek_ref TEXT NOT NULL,
        created_at TIMESTAMPTZ NOT NULL,
        updated_at TIMESTAMPTZ,
        algorithm TEXT NOT NULL DEFAULT 'AES-256',
        public_key BYTEA NOT NULL DEFAULT ''::bytea,
        PRIMARY KEY (name, version)
    )
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
COLUMNS = (
    "name, version, purpose, state, wrapped_dek, kek_ref, created_at, updated_at, algorithm, "
    "public_key"
)
SELECT = f"SELECT {COLUMNS} FROM broker_key_versions"  # noqa: S608 - constant column list


log = logging.getLogger(__name__)


def _unavailable(
    message: str = "key store is unavailable", cause: BaseException | None = None
) -> UpstreamError:
    """503 ``key_store_unavailable``, saying why (authentication refused, unreachable, slow):
    the operator must tell a wrong password from a down server. Never the URL or password."""
    if cause is not None:
        message = f"{message}: {_cause(cause)}"
        log.warning("%s (%s: %s)", message, type(cause).__name__, str(cause)[:300])
    return UpstreamError(message, code=ErrorCode.KEY_STORE_UNAVAILABLE)


def _cause(exc: BaseException) -> str:
    if isinstance(
        exc,
        asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError,
    ):
        return (
            "PostgreSQL refused the credentials (give the password in the URL, percent-encoded, "
            "in PGPASSWORD, or in a password file: ?passfile=PATH, PGPASSFILE; docs/keys.md)"
        )
    if isinstance(exc, TimeoutError):
        return "PostgreSQL did not answer in time"
    if isinstance(exc, OSError):
        return f"PostgreSQL is unreachable ({exc.strerror or type(exc).__name__})"
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return "the database does not exist"
    return f"PostgreSQL error {type(exc).__name__}"


async def schema_version(db: asyncpg.Connection) -> int:
    """The migrated version (0: never migrated)."""
    exists = await db.fetchval("SELECT to_regclass('broker_schema') IS NOT NULL")
    if not exists:
        return 0
    version = await db.fetchval("SELECT version FROM broker_schema WHERE component = $1", COMPONENT)
    return int(version or 0)


async def migrate(dsn: str, *, timeout_seconds: float) -> tuple[int, int]:
    """Bring the schema to ``SCHEMA_VERSION``; return (version before, version after).

    Safe to run from several places at once: an advisory lock serialises the runs, and each
    step commits together with the version it reaches.

    Raises:
        UpstreamError: ``key_store_unavailable`` when the server cannot be reached.
        ConfigError: when the database was migrated by a newer broker.
    """
    try:
        async with asyncio.timeout(timeout_seconds):
            db = await asyncpg.connect(dsn)
        try:
            async with db.transaction():
                await db.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
                await db.execute(
                    "CREATE TABLE IF NOT EXISTS broker_schema "
                    "(component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
                )
                before = current = await schema_version(db)
                if current > SCHEMA_VERSION:
                    raise _newer(current)
                for step in MIGRATIONS[current:]:
                    await db.execute(step)
                    current += 1
                await db.execute(
                    "INSERT INTO broker_schema (component, version) VALUES ($1, $2) "
                    "ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version",
                    COMPONENT,
                    current,
                )
        finally:
            await db.close()
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
        raise _unavailable("cannot migrate the key store", exc) from exc
    return before, current


def _newer(version: int) -> ConfigError:
    return ConfigError(
        "keys.store",
        f"the database's key schema is version {version}, newer than this broker's "
        f"{SCHEMA_VERSION}: upgrade the broker",
    )


class PostgresKeyStore:
    def __init__(self, dsn: str, *, timeout: float) -> None:
        self._dsn = dsn
        self._timeout = timeout
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        """Connect (a small pool, opened once) and check the schema version.

        Raises:
            UpstreamError: ``key_store_unavailable`` when the server cannot be reached.
            ConfigError: when the schema is not at this broker's version.
        """
        try:
            async with asyncio.timeout(self._timeout):
                pool = await asyncpg.create_pool(
                    self._dsn, min_size=2, max_size=4, max_inactive_connection_lifetime=0
                )
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise _unavailable(cause=exc) from exc
        self._pool = pool
        version = await self._run(schema_version)
        if version == SCHEMA_VERSION:
            return
        await self.close()
        if version > SCHEMA_VERSION:
            raise _newer(version)
        raise ConfigError(
            "keys.store",
            f"the key schema is at version {version}, this broker needs {SCHEMA_VERSION}: run "
            "`broker keys migrate --config …` first",
        )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def add_version(self, record: KeyVersionRecord) -> None:
        async def insert(db: asyncpg.Connection) -> None:
            try:
                await db.execute(
                    f"INSERT INTO broker_key_versions ({COLUMNS}) "  # noqa: S608
                    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                    *_row(record),
                )
            except asyncpg.UniqueViolationError as exc:
                raise Conflict(f"key {record.name} version {record.version} exists") from exc

        await self._run(insert)

    async def get_version(self, name: str, version: int) -> KeyVersionRecord | None:
        return await self._one(f"{SELECT} WHERE name = $1 AND version = $2", name, version)

    async def latest_version(self, name: str, *, enabled_only: bool) -> KeyVersionRecord | None:
        if enabled_only:
            return await self._one(
                f"{SELECT} WHERE name = $1 AND state = $2 ORDER BY version DESC LIMIT 1",
                name,
                VersionState.ENABLED.value,
            )
        return await self._one(f"{SELECT} WHERE name = $1 ORDER BY version DESC LIMIT 1", name)

    async def list_versions(self, name: str | None = None) -> list[KeyVersionRecord]:
        async def select(db: asyncpg.Connection) -> list[KeyVersionRecord]:
            if name is None:
                rows = await db.fetch(f"{SELECT} ORDER BY name, version")
            else:
                rows = await db.fetch(f"{SELECT} WHERE name = $1 ORDER BY version", name)
            return [_record(row) for row in rows]

        return await self._run(select)

    async def has_purpose(self, purpose: Purpose) -> bool:
        async def exists(db: asyncpg.Connection) -> bool:
            sql = "SELECT 1 FROM broker_key_versions WHERE purpose = $1 LIMIT 1"
            return await db.fetchval(sql, purpose.value) is not None

        return await self._run(exists)

    async def replace(self, record: KeyVersionRecord, *, expected: KeyVersionRecord) -> bool:
        async def update(db: asyncpg.Connection) -> bool:
            status: str = await db.execute(
                "UPDATE broker_key_versions SET state = $1, wrapped_dek = $2, kek_ref = $3, "
                "updated_at = $4, public_key = $5 "
                "WHERE name = $6 AND version = $7 AND state = $8 AND wrapped_dek = $9 "
                "AND kek_ref = $10 AND public_key = $11 AND state <> 'destroyed'",
                record.state.value,
                record.wrapped_dek,
                record.kek_ref,
                record.updated_at,
                record.public_key,
                record.name,
                record.version,
                expected.state.value,
                expected.wrapped_dek,
                expected.kek_ref,
                expected.public_key,
            )
            return status == "UPDATE 1"

        return await self._run(update)

    async def _one(self, sql: str, *params: object) -> KeyVersionRecord | None:
        async def select(db: asyncpg.Connection) -> KeyVersionRecord | None:
            row = await db.fetchrow(sql, *params)
            return None if row is None else _record(row)

        return await self._run(select)

    async def _run(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        if self._pool is None:
            raise _unavailable("key store is not open")
        try:
            async with asyncio.timeout(self._timeout), self._pool.acquire() as db:
                return await work(db)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise _unavailable(cause=exc) from exc


def _row(record: KeyVersionRecord) -> tuple[object, ...]:
    return (
        record.name,
        record.version,
        record.purpose.value,
        record.state.value,
        record.wrapped_dek,
        record.kek_ref,
        record.created_at,
        record.updated_at,
        record.algorithm.value,
        record.public_key,
    )


def _record(row: Any) -> KeyVersionRecord:
    return KeyVersionRecord(
        name=row["name"],
        version=int(row["version"]),
        purpose=Purpose(row["purpose"]),
        state=VersionState(row["state"]),
        wrapped_dek=bytes(row["wrapped_dek"]),
        kek_ref=row["kek_ref"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        algorithm=Algorithm(row["algorithm"]),
        public_key=bytes(row["public_key"]),
    )
