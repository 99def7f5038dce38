"""How the shared stores reach a database, written once: a SQLite file used from one dedicated
thread (here), and a Redis client and an asyncpg pool (``clients_shared.py``, loaded only where
such a store is configured). The nonce stores (``spent_nonces*.py``) and the attestation stores
(``attestations*.py``) keep their own tables and statements; how a connection is
opened, which errors mean "the store did not answer", and schema creation live here.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from broker.core.sqlite_wal import connect_wal

Unavailable = Callable[[str, BaseException], Exception]  # (store kind, cause) -> the 503 to raise


class SqliteThread:
    """One SQLite file (WAL, ``synchronous=FULL``: a write survives a power loss; several
    processes of one host share it), its ``schema`` created on first use, every call on one
    dedicated thread with its own connection."""

    def __init__(
        self,
        path: Path,
        *,
        timeout: float,
        schema: str,
        thread_name: str,
        unavailable: Unavailable,
    ) -> None:
        self._path = path
        self._timeout = timeout
        self._schema = schema
        self._unavailable = unavailable
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._connection: sqlite3.Connection | None = None

    async def run(self, operation: Callable[..., Any], *args: Any) -> Any:
        """``operation(connection, *args)`` on the store's thread.

        Raises: what ``unavailable`` makes of a SQLite or OS error (the directory cannot be
        created, the file cannot be opened, the lock timed out)."""

        def call() -> Any:
            return operation(self._db(), *args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except (sqlite3.Error, OSError) as exc:
            raise self._unavailable("sqlite", exc) from exc

    async def close(self) -> None:
        def shut() -> None:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

        await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        self._executor.shutdown(wait=True)

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            db = connect_wal(self._path, timeout=self._timeout)
            db.executescript(self._schema)
            self._connection = db
        return self._connection
