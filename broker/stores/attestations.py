"""Where attestations live while they may be used (issue 19): the record a release on an EAR
will be decided from, and its status, shared by every worker and replica that may see the EAR.

The store is the nonce store's (``[nonces] store``): ``memory`` (one process), ``sqlite:///PATH``
(one host), ``redis://…`` and ``postgresql://…`` (replicas) — the same sharing an EAR needs as a
nonce. An entry holds the attestation's policy input (unmasked: the release policy decides on
it; claims, never evidence or key material), the PoP key thumbprint,
its expiry, and its status (``active`` or ``revoked`` with a reason). Entries are forgotten when
they expire, but one whose revocation record is owed is kept until the record is written
(``AttestationEntry.kept_until``; once expired, only ``owed`` lists it). A revocation is one
write every replica reads on its next lookup.

Any failure to get an answer is ``503`` (``nonce_store_unavailable``, the store's code): never an
attestation treated as active. An entry in a form no broker writes is the store answering
nonsense (``stored.MalformedEntry``): ``503`` ``attestation_store_mismatch`` where it is read,
skipped (and logged) where entries are listed.
"""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

from broker.attestation.stored import (
    KEPT_WHILE_OWED,
    AttestationEntry,
    AttestationStore,
    Change,
    ParsedEntries,
    parsed_entries,
    unavailable,
)
from broker.core.errors import ConfigError
from broker.core.refs import MemoryRef, PostgresRef, RedisRef, SqliteRef, StoreRef
from broker.stores.clients import SqliteThread


class MemoryAttestations:
    """One process (``[nonces] store = "memory"``)."""

    def __init__(self) -> None:
        self._entries: dict[str, AttestationEntry] = {}

    async def put(self, entry: AttestationEntry) -> None:
        now = datetime.now(UTC)
        self._entries = {k: v for k, v in self._entries.items() if v.kept_until > now}
        self._entries[entry.jti] = entry

    async def get(self, jti: str, now: datetime) -> AttestationEntry | None:
        entry = self._entries.get(jti)
        return entry if entry is not None and entry.expires_at > now else None

    async def update(
        self, jti: str, now: datetime, change: Change, *, expired_too: bool = False
    ) -> tuple[AttestationEntry, AttestationEntry] | None:
        entry = self._entries.get(jti)  # no await between the read and the write below
        if entry is None or (entry.expires_at <= now and not expired_too):
            return None
        self._entries[jti] = after = change(entry)
        return entry, after

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        return [e for e in self._entries.values() if e.expires_at > now]

    async def owed(self) -> list[AttestationEntry]:
        return [e for e in self._entries.values() if e.owed]

    async def close(self) -> None:
        self._entries.clear()


class SqliteAttestations:
    """Processes on one host share the nonce store's SQLite file (table ``attestations``);
    calls run on one dedicated thread with its own connection."""

    def __init__(self, path: Path, *, timeout: float) -> None:
        self._db = SqliteThread(
            path,
            timeout=timeout,
            schema=_SQLITE_SCHEMA,
            thread_name="attest-sqlite",
            unavailable=unavailable,
        )
        self._parsed = ParsedEntries()  # a release's read: equal text, the same entry

    async def put(self, entry: AttestationEntry) -> None:
        def insert(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM attestations WHERE expires_at <= ?", (time.time(),))
            db.execute(
                "INSERT INTO attestations (jti, expires_at, body) VALUES (?, ?, ?)",
                (entry.jti, entry.expires_at.timestamp(), entry.to_json()),
            )

        await self._db.run(insert)

    async def get(self, jti: str, now: datetime) -> AttestationEntry | None:
        def select(db: sqlite3.Connection) -> str | None:
            row = db.execute(
                "SELECT body FROM attestations WHERE jti = ? AND expires_at > ?",
                (jti, now.timestamp()),
            ).fetchone()
            return None if row is None else str(row[0])

        body = await self._db.run(select)
        entry = None if body is None else self._parsed.parse(body)
        return (
            entry if entry is not None and entry.expires_at > now else None
        )  # kept for its record: expired

    async def update(
        self, jti: str, now: datetime, change: Change, *, expired_too: bool = False
    ) -> tuple[AttestationEntry, AttestationEntry] | None:
        def rewrite(db: sqlite3.Connection) -> tuple[AttestationEntry, AttestationEntry] | None:
            db.execute("BEGIN IMMEDIATE")  # the write lock first: no update lost between hosts
            try:
                row = db.execute("SELECT body FROM attestations WHERE jti = ?", (jti,)).fetchone()
                if row is None:
                    return None
                before = AttestationEntry.from_json(row[0])
                if before.expires_at <= now and not expired_too:
                    return None
                after = change(before)
                db.execute(
                    "UPDATE attestations SET body = ?, expires_at = ? WHERE jti = ?",
                    (after.to_json(), after.kept_until.timestamp(), jti),
                )
                db.execute("COMMIT")
                return before, after
            finally:  # whatever failed before the COMMIT, nothing of it stays
                if db.in_transaction:
                    db.execute("ROLLBACK")

        result: tuple[AttestationEntry, AttestationEntry] | None = await self._db.run(rewrite)
        return result

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        def select(db: sqlite3.Connection) -> list[str]:
            rows = db.execute(
                "SELECT body FROM attestations WHERE expires_at > ?", (now.timestamp(),)
            ).fetchall()
            return [str(row[0]) for row in rows]

        entries = parsed_entries(await self._db.run(select))  # one in an unexpected form: skipped
        return [entry for entry in entries if entry.expires_at > now]  # not those kept, expired

    async def owed(self) -> list[AttestationEntry]:
        def select(db: sqlite3.Connection) -> list[str]:
            rows = db.execute(
                "SELECT body FROM attestations WHERE expires_at >= ?",
                (KEPT_WHILE_OWED.timestamp(),),
            ).fetchall()
            return [str(row[0]) for row in rows]

        return parsed_entries(await self._db.run(select))  # one in an unexpected form: skipped

    async def close(self) -> None:
        await self._db.close()


# ``expires_at`` is when the row may be deleted: the entry's expiry, or ``KEPT_WHILE_OWED``
# while its revocation record is owed (the body holds the expiry itself)
_SQLITE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS attestations (jti TEXT PRIMARY KEY, "
    "expires_at REAL NOT NULL, body TEXT NOT NULL) WITHOUT ROWID;"
    "CREATE INDEX IF NOT EXISTS attestations_expiry ON attestations (expires_at);"
)


def open_attestation_store(store: StoreRef, *, timeout: float) -> AttestationStore:
    """The store ``[nonces] store`` names (``NonceSettings.store_ref``)."""
    if isinstance(store, MemoryRef):
        return MemoryAttestations()
    if isinstance(store, SqliteRef):
        return SqliteAttestations(store.path, timeout=timeout)
    # The Redis and PostgreSQL clients load only where such a store is configured.
    if isinstance(store, RedisRef):
        from broker.stores.attestations_shared import RedisAttestations  # noqa: PLC0415

        return RedisAttestations(store.uri, timeout=timeout)
    if isinstance(store, PostgresRef):
        from broker.stores.attestations_shared import PostgresAttestations  # noqa: PLC0415

        return PostgresAttestations(store.uri, timeout=timeout)
    raise ConfigError("nonces.store", f"{store.kind} cannot hold attestation results")
