"""SQLite DEK store (the default): WAL journal, ``synchronous=FULL`` so a commit is durable.

All database work runs on one dedicated thread that owns the connection, so the event loop never
blocks on disk and the connection is never shared between threads. Each write is one statement
in autocommit mode: atomic, and durable when it returns. ``replace`` is a compare-and-swap on the
whole row it was read as (``UPDATE … WHERE`` state, wrapped DEK, KEK, public half, and not
destroyed).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from broker.core.errors import Conflict, ErrorCode, UpstreamError
from broker.core.protocol import Algorithm
from broker.core.sqlite_wal import connect_wal
from broker.keys.store.base import KeyVersionRecord, Purpose, VersionState

T = TypeVar("T")
SCHEMA = """
CREATE TABLE IF NOT EXISTS key_versions (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    purpose TEXT NOT NULL,
    state TEXT NOT NULL,
    wrapped_dek BLOB NOT NULL,
    kek_ref TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT,
    algorithm TEXT NOT NULL DEFAULT 'AES-256',
    public_key BLOB NOT NULL DEFAULT x'',
    PRIMARY KEY (name, version)
) STRICT;
"""
COLUMNS = (
    "name, version, purpose, state, wrapped_dek, kek_ref, created_at, updated_at, algorithm, "
    "public_key"
)
SELECT = f"SELECT {COLUMNS} FROM key_versions"  # noqa: S608 - constant column list


class SqliteKeyStore:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keystore")
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        await self._run(self._open_sync)

    def _open_sync(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # Wrapped keys only, but still nobody else's business: SQLite gives its -wal and -shm
        # files the database file's mode.
        self._path.touch(mode=0o600, exist_ok=True)
        conn = connect_wal(self._path, timeout=5.0)
        conn.executescript(SCHEMA)
        self._conn = conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._run(self._conn.close)
            self._conn = None
        self._executor.shutdown(wait=False)  # the close above already ran on it

    async def add_version(self, record: KeyVersionRecord) -> None:
        def insert() -> None:
            try:
                self._db().execute(
                    f"INSERT INTO key_versions ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",  # noqa: S608
                    _row(record),
                )
            except sqlite3.IntegrityError as exc:
                raise Conflict(f"key {record.name} version {record.version} exists") from exc

        await self._run(insert)

    async def get_version(self, name: str, version: int) -> KeyVersionRecord | None:
        return await self._one(f"{SELECT} WHERE name = ? AND version = ?", (name, version))

    async def latest_version(self, name: str, *, enabled_only: bool) -> KeyVersionRecord | None:
        if enabled_only:
            return await self._one(
                f"{SELECT} WHERE name = ? AND state = ? ORDER BY version DESC LIMIT 1",
                (name, VersionState.ENABLED.value),
            )
        return await self._one(f"{SELECT} WHERE name = ? ORDER BY version DESC LIMIT 1", (name,))

    async def list_versions(self, name: str | None = None) -> list[KeyVersionRecord]:
        def select_all() -> list[KeyVersionRecord]:
            if name is None:
                rows = self._db().execute(f"{SELECT} ORDER BY name, version").fetchall()
            else:
                rows = (
                    self._db()
                    .execute(f"{SELECT} WHERE name = ? ORDER BY version", (name,))
                    .fetchall()
                )
            return [_record(row) for row in rows]

        return await self._run(select_all)

    async def has_purpose(self, purpose: Purpose) -> bool:
        def exists() -> bool:
            sql = "SELECT 1 FROM key_versions WHERE purpose = ? LIMIT 1"
            return self._db().execute(sql, (purpose.value,)).fetchone() is not None

        return await self._run(exists)

    async def replace(self, record: KeyVersionRecord, *, expected: KeyVersionRecord) -> bool:
        def update() -> bool:
            cursor = self._db().execute(
                "UPDATE key_versions SET state = ?, wrapped_dek = ?, kek_ref = ?, updated_at = ?, "
                "public_key = ? WHERE name = ? AND version = ? AND state = ? AND wrapped_dek = ? "
                "AND kek_ref = ? AND public_key = ? AND state <> 'destroyed'",
                (
                    record.state.value,
                    record.wrapped_dek,
                    record.kek_ref,
                    None if record.updated_at is None else record.updated_at.isoformat(),
                    record.public_key,
                    record.name,
                    record.version,
                    expected.state.value,
                    expected.wrapped_dek,
                    expected.kek_ref,
                    expected.public_key,
                ),
            )
            return cursor.rowcount == 1

        return await self._run(update)

    async def _one(self, sql: str, params: tuple[object, ...]) -> KeyVersionRecord | None:
        def select() -> KeyVersionRecord | None:
            row = self._db().execute(sql, params).fetchone()
            return None if row is None else _record(row)

        return await self._run(select)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise UpstreamError("key store is not open", code=ErrorCode.KEY_STORE_UNAVAILABLE)
        return self._conn

    async def _run(self, work: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, work)
        except sqlite3.Error as exc:
            raise UpstreamError(
                "key store is unavailable", code=ErrorCode.KEY_STORE_UNAVAILABLE
            ) from exc


def _row(record: KeyVersionRecord) -> tuple[object, ...]:
    return (
        record.name,
        record.version,
        record.purpose.value,
        record.state.value,
        record.wrapped_dek,
        record.kek_ref,
        record.created_at.isoformat(),
        None if record.updated_at is None else record.updated_at.isoformat(),
        record.algorithm.value,
        record.public_key,
    )


def _record(row: tuple[object, ...]) -> KeyVersionRecord:
    name, version, purpose, state, wrapped, kek_ref, created, updated, algorithm, public = row
    return KeyVersionRecord(
        name=str(name),
        version=int(str(version)),
        purpose=Purpose(str(purpose)),
        state=VersionState(str(state)),
        wrapped_dek=bytes(wrapped) if isinstance(wrapped, bytes | bytearray) else b"",
        kek_ref=str(kek_ref),
        created_at=datetime.fromisoformat(str(created)),
        updated_at=None if updated is None else datetime.fromisoformat(str(updated)),
        algorithm=Algorithm(str(algorithm)),
        public_key=bytes(public) if isinstance(public, bytes | bytearray) else b"",
    )
