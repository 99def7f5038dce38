"""``broker keys migrate --from --to``, ``backup`` and ``restore``: wrapped keys between stores.

Each is recorded in the configured decision log as ``key_admin`` records (who, what, how many,
the verified digest): ``backup`` (a read) once it is written; ``restore`` and ``migrate-store``
(changes to a store) as every key change is, an intent before the copy and an outcome after it
(``broker.keys.changes``). See ``broker.keys.transfer`` for the guarantees and docs/keys.md for
the workflow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from broker.audit.log import DecisionLog
from broker.audit.records import LogCorrupt, iter_records
from broker.config import Settings, key_store_ref, load_settings
from broker.config.tables import resolve_sqlite_uri
from broker.core.errors import ConfigError, FileFormatError, InputError
from broker.core.jsonsafe import loads_bounded
from broker.core.refs import PostgresRef, StoreRef
from broker.keys.admin import cli_actor
from broker.keys.changes import Recorder, key_admin_entry, recorded
from broker.keys.factory import open_store
from broker.keys.store.base import KeyStore, KeyVersionRecord
from broker.keys.transfer import (
    CopyProgress,
    backup_document,
    copy_versions,
    read_backup,
    record_json,
)

MAX_BACKUP_BYTES = 1024 * 1024 * 1024
NOT_A_BACKUP = "name a file `broker keys backup -o FILE` wrote"
MAX_LISTED_WRITES = 100  # versions a cut-short copy's outcome names (``written`` counts them all)


def add_commands(command: Any) -> None:
    backup = command("backup", "write every wrapped DEK and its metadata to a file", _backup)
    backup.add_argument("-o", "--output", type=Path, required=True)
    restore = command("restore", "copy a backup file's versions into the key store", _restore)
    restore.add_argument(
        "file",
        type=Path,
        metavar="FILE",
        help="a key backup (broker.keys-backup/v1 JSON) that `broker keys backup -o FILE` wrote",
    )
    restore.add_argument(
        "--digest", help="the digest you trust (default: one a `backup` record in the log names)"
    )


async def _open(settings: Settings, uri: str | None = None) -> KeyStore:
    return await open_store(settings.keys if uri is None else replace(settings.keys, store=uri))


@asynccontextmanager
async def _decision_log(settings: Settings) -> AsyncIterator[DecisionLog]:
    audit = DecisionLog(settings.audit.log, replica=settings.server.replica_id)
    await audit.open()
    try:
        yield audit
    finally:
        await audit.close()


async def _log(settings: Settings, action: str, detail: dict[str, Any]) -> None:
    async with _decision_log(settings) as audit:
        entry = key_admin_entry(action, detail, now=datetime.now(UTC), who=cli_actor())
        await audit.append_entry(entry)


async def _recorded_copy(
    settings: Settings,
    action: str,
    fields: Mapping[str, Any],
    records: list[KeyVersionRecord],
    target: KeyStore,
) -> dict[str, Any]:
    """Copy ``records`` into ``target``: the intent recorded first (a copy the log cannot take
    is not made), then the outcome with the copy's report. A copy that stops after a write, or
    fails in a way that may have reached the store, is re-read: ``ok`` only when every version
    is there, ``error`` when none it was to write is, else ``unknown`` (partly made); its
    outcome lists the versions it wrote."""
    progress = CopyProgress()

    async def commit() -> Mapping[str, Any]:
        return (await copy_versions(records, target, progress)).describe()

    async def check() -> bool | None:
        if progress.to_write is None:
            return False  # stopped while checking: nothing was written
        if all([await _holds(target, record) for record in records]):
            return True
        wrote = [await _holds(target, record) for record in progress.to_write]
        return None if any(wrote) else False  # partly made: re-run it (the copy is idempotent)

    def written() -> dict[str, Any]:
        if not progress.written:
            return {}
        listed = [{"key": r.name, "version": r.version} for r in progress.written]
        return {"written": len(listed), "written_versions": listed[:MAX_LISTED_WRITES]}

    async with _decision_log(settings) as audit:
        recorder = Recorder(audit.append_entry, action, fields, datetime.now(UTC), cli_actor())
        return {**fields, **await recorded(recorder, commit, check, written)}


async def _holds(target: KeyStore, record: KeyVersionRecord) -> bool:
    """Whether ``target`` holds ``record`` exactly."""
    found = await target.get_version(record.name, record.version)
    return found is not None and record_json(found) == record_json(record)


def store_argument(option: str, uri: str | None, settings: Settings) -> str:
    """The store ``--from``/``--to`` names, or the configured one (``[keys] store``, with
    ``BROKER_KEYS_STORE`` applied, as ``serve`` reads it) when the option is absent. A relative
    SQLite path on the command line is relative to the working directory.

    Raises:
        ConfigError: ``option`` for another form.
    """
    if uri is None:
        return settings.keys.store
    key_store_ref(uri, option)
    return resolve_sqlite_uri(option, uri, Path.cwd())


def migrate_stores(args: argparse.Namespace) -> dict[str, Any]:
    """``keys migrate --from A --to B``: copy, idempotently, and verify. Either side defaults
    to the configured store.

    Raises:
        ConfigError: for a malformed store, or the same store on both sides.
    """
    settings = load_settings(args.config)
    source = store_argument("--from", args.source, settings)
    to = store_argument("--to", args.to, settings)
    if source == to:
        raise ConfigError(
            "--to", "the source and the target are the same store: name the other with --from/--to"
        )
    source_ref, to_ref = key_store_ref(source, "--from"), key_store_ref(to, "--to")
    if isinstance(to_ref, PostgresRef):
        from broker.keys.store.postgres import migrate  # noqa: PLC0415

        asyncio.run(migrate(to, timeout_seconds=settings.keys.upstream_timeout_seconds))

    async def run() -> dict[str, Any]:
        source_store, target = await _open(settings, source), await _open(settings, to)
        try:
            records = await source_store.list_versions()
            fields = {"from": _kind(source_ref), "to": _kind(to_ref), "versions": len(records)}
            return await _recorded_copy(settings, "migrate-store", fields, records, target)
        finally:
            await source_store.close()
            await target.close()

    return asyncio.run(run())


def _backup(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)

    async def run() -> dict[str, Any]:
        store = await _open(settings)
        try:
            records = await store.list_versions()
        finally:
            await store.close()
        document = backup_document(records, now=datetime.now(UTC))
        await asyncio.to_thread(_write_private, args.output, json.dumps(document, indent=1))
        detail = {"versions": len(records), "digest": document["digest"], "file": str(args.output)}
        await _log(settings, "backup", detail)
        return detail

    print(json.dumps(asyncio.run(run()), indent=2))
    return 0


def _restore(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    records, digest = _read_backup_file(args.file)
    trusted = args.digest or _logged_backup_digest(settings, digest)
    if trusted != digest:
        raise InputError(
            f"the backup's digest {digest} is not one this broker logged for a backup (nor the "
            "--digest given): refused"
        )

    async def run() -> dict[str, Any]:
        store = await _open(settings)
        try:
            fields = {"file": str(args.file), "versions": len(records), "digest": digest}
            return await _recorded_copy(settings, "restore", fields, records, store)
        finally:
            await store.close()

    print(json.dumps(asyncio.run(run()), indent=2))
    return 0


def _read_backup_file(path: Path) -> tuple[list[KeyVersionRecord], str]:
    """The versions and the digest of a ``keys backup`` file whose content matches that digest
    (whether the digest is one to trust is the caller's question).

    Raises:
        FileFormatError: the file cannot be read or is not a key backup (exit 2).
        InputError: a backup whose content does not match its digest (exit 1).
    """
    try:
        if path.stat().st_size > MAX_BACKUP_BYTES:
            raise FileFormatError(path, "too large for a key backup", NOT_A_BACKUP)
        raw = path.read_bytes()
    except OSError as exc:
        raise FileFormatError(path, f"cannot read it ({exc.strerror})", NOT_A_BACKUP) from exc
    try:
        document = loads_bounded(raw)
    except ValueError as exc:
        raise FileFormatError(path, "not a key backup (not JSON)", NOT_A_BACKUP) from exc
    if not isinstance(document, dict) or "versions" not in document:
        raise FileFormatError(path, "not a key backup (broker.keys-backup/v1)", NOT_A_BACKUP)
    try:
        return read_backup(document)
    except InputError as exc:
        if "match its digest" in exc.message:  # changed after it was made: the answer is no
            raise
        raise FileFormatError(path, exc.message, NOT_A_BACKUP) from exc


def _logged_backup_digest(settings: Settings, digest: str) -> str | None:
    """``digest`` when a ``key_admin`` ``backup`` record in the decision log names it."""
    try:
        data = settings.audit.log.read_bytes()
    except OSError:
        return None
    try:
        for _, record in iter_records(data):
            if record.get("action") == "backup" and record.get("digest") == digest:
                return digest
    except LogCorrupt as exc:
        raise FileFormatError(
            settings.audit.log,
            f"the decision log is damaged at {exc}",
            "run `broker audit verify` on it, or pass --digest with the digest you trust",
        ) from exc
    return None


def _write_private(path: Path, text: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _kind(ref: StoreRef) -> str:
    """A store for records: its kind and place, never credentials."""
    if isinstance(ref, PostgresRef):  # no user, password or query (passfile=…)
        parts = urlsplit(ref.uri)
        host = parts.netloc.rsplit("@", 1)[-1]
        return f"postgresql://{host}{parts.path}"
    return ref.uri
