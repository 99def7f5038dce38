"""Where spent nonces live across processes and replicas: SQLite (one host), Redis and
PostgreSQL (replicas).

Two namespaces, each with its own bound where the store has one: challenges (``challenge``) and
DPoP proofs' ``jti``s (``dpop_jti``), in a table, key prefix or map of their own.

Each keeps ``broker.stores.nonces.SpentNonces``' contract: a nonce is spent by one atomic
insert-if-absent in the store itself and remembered until it would have expired, so of any
number of concurrent uses across processes and replicas exactly one succeeds; the others see
``nonce_reused``. Nothing is stored when a challenge is handed out. Any failure to get an answer
(store down, locked past the timeout, disk error, authentication refused) is ``503
nonce_store_unavailable`` — never a nonce treated as valid — and the operator's log keeps the
cause.
"""

from __future__ import annotations

import logging
import sqlite3
from datetime import datetime, timedelta
from pathlib import Path

from broker.config import NONCE_STORE_FORMS
from broker.core.errors import ConfigError
from broker.core.refs import MemoryRef, PostgresRef, RedisRef, SqliteRef, StoreRef
from broker.stores.clients import SqliteThread
from broker.stores.nonces import (
    MemorySpentNonces,
    NonceStore,
    SpentNonces,
    StatelessNonceStore,
    reused_nonce,
    store_full,
    unavailable,
)

log = logging.getLogger(__name__)


def open_nonce_store(
    store: StoreRef, *, ttl: timedelta, capacity: int, timeout: float, key_path: Path
) -> NonceStore:
    """Challenges MAC'd with the key in ``key_path``; spent nonces and spent DPoP ``jti``s where
    ``[nonces] store`` names (validated by the config loader), each namespace bounded by
    ``capacity`` on its own."""
    return StatelessNonceStore(
        open_spent_store(store, capacity=capacity, timeout=timeout, namespace=CHALLENGES),
        key_path=key_path,
        ttl=ttl,
        jtis=open_spent_store(store, capacity=capacity, timeout=timeout, namespace=DPOP_JTIS),
    )


CHALLENGES = "challenge"
DPOP_JTIS = "dpop_jti"
# table (SQLite, PostgreSQL) and key prefix (Redis) of each namespace; the challenges' are the
# names stores have always used, so an upgrade keeps what was spent
SQLITE_TABLES = {CHALLENGES: "spent_nonces", DPOP_JTIS: "spent_dpop_jtis"}


def open_spent_store(
    store: StoreRef, *, capacity: int, timeout: float, namespace: str = CHALLENGES
) -> SpentNonces:
    """The store ``[nonces] store`` names (``NonceSettings.store_ref``)."""
    if isinstance(store, MemoryRef):
        return MemorySpentNonces(capacity=capacity)
    if isinstance(store, SqliteRef):
        return SqliteSpentNonces(
            store.path, capacity=capacity, timeout=timeout, table=SQLITE_TABLES[namespace]
        )
    # The Redis and PostgreSQL clients load only where such a store is configured.
    if isinstance(store, RedisRef):
        from broker.stores.spent_nonces_shared import RedisSpentNonces  # noqa: PLC0415

        return RedisSpentNonces(store.uri, timeout=timeout, namespace=namespace)
    if isinstance(store, PostgresRef):
        from broker.stores.spent_nonces_shared import PostgresSpentNonces  # noqa: PLC0415

        return PostgresSpentNonces(store.uri, timeout=timeout, namespace=namespace)
    raise ConfigError("nonces.store", NONCE_STORE_FORMS)


def _schema(table: str) -> str:
    return f"""
CREATE TABLE IF NOT EXISTS {table} (
    nonce TEXT PRIMARY KEY,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS {table}_expiry ON {table} (expires_at);
"""


class SqliteSpentNonces:
    """Processes on one host share a SQLite file (WAL, ``synchronous=FULL``).

    A nonce is spent by one ``INSERT OR IGNORE`` (one statement, the write lock held as briefly
    as SQLite allows: several workers contend for it). Every ``capacity // 8`` spends (at most
    256) a process deletes expired rows and counts the rest; past ``capacity`` it refuses spends
    (``nonce_store_full``) until a purge finds room, so the bound holds within an eighth.
    ``synchronous=FULL``: a spent mark survives a power loss, so a replay after a crash finds the
    nonce spent. Calls run on one dedicated thread with its own connection.
    """

    MAX_PURGE_EVERY = 256

    def __init__(
        self, path: Path, *, capacity: int, timeout: float, table: str = "spent_nonces"
    ) -> None:
        if table not in SQLITE_TABLES.values():
            raise ValueError(f"unknown spent-nonce table {table!r}")
        self._capacity = capacity
        self._table = table
        self._db = SqliteThread(
            path,
            timeout=timeout,
            schema=_schema(table),
            thread_name=f"nonce-sqlite-{table}",
            unavailable=unavailable,
        )
        self._spends = 0
        self._full = False
        self._purge_every = max(1, min(self.MAX_PURGE_EVERY, capacity // 8))

    async def spend(self, nonce: str, expires_at: datetime, now: datetime) -> None:
        self._spends += 1
        purge = self._spends % self._purge_every == 1 % self._purge_every
        outcome = await self._db.run(
            self._spend, nonce, expires_at.timestamp(), now.timestamp(), purge
        )
        if outcome == "reused":
            raise reused_nonce()
        if outcome == "full":
            raise store_full()

    async def check(self) -> None:
        await self._db.run(lambda db: db.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        await self._db.close()

    def _spend(
        self, db: sqlite3.Connection, nonce: str, expires_at: float, now: float, purge: bool
    ) -> str:
        if purge:
            db.execute(f"DELETE FROM {self._table} WHERE expires_at <= ?", (now,))  # noqa: S608
            (count,) = db.execute(f"SELECT count(*) FROM {self._table}").fetchone()  # noqa: S608
            self._full = count >= self._capacity
        if self._full:
            return "full"
        inserted = db.execute(
            f"INSERT OR IGNORE INTO {self._table} (nonce, expires_at) VALUES (?, ?)",  # noqa: S608
            (nonce, expires_at),
        ).rowcount
        return "ok" if inserted == 1 else "reused"
