"""``broker keys migrate --from --to``, ``backup`` and ``restore``: wrapped keys between stores.

Each logs one ``key_admin`` record (who, what, how many, the verified digest) in the configured
decision log. See ``broker.keys.transfer`` for the guarantees and docs/keys.md for the workflow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from broker.audit.log import DecisionLog
from broker.audit.records import iter_records
from broker.config import Settings, load_settings
from broker.core.errors import ConfigError, InputError
from broker.core.jsonsafe import loads_bounded
from broker.keys.admin import cli_actor
from broker.keys.factory import open_store
from broker.keys.store.base import KeyStore
from broker.keys.transfer import backup_document, copy_versions, read_backup

MAX_BACKUP_BYTES = 1024 * 1024 * 1024


def add_commands(command: Any) -> None:
    backup = command("backup", "write every wrapped DEK and its metadata to a file", _backup)
    backup.add_argument("-o", "--output", type=Path, required=True)
    restore = command("restore", "copy a backup file's versions into the key store", _restore)
    restore.add_argument("file", type=Path)
    restore.add_argument(
        "--digest", help="the digest you trust (default: one a `backup` record in the log names)"
    )


async def _open(settings: Settings, uri: str | None = None) -> KeyStore:
    return await open_store(settings.keys if uri is None else replace(settings.keys, store=uri))


async def _log(settings: Settings, action: str, detail: dict[str, Any]) -> None:
    audit = DecisionLog(settings.audit.log, replica=settings.server.replica_id)
    await audit.open()
    try:
        await audit.append(
            {
                "type": "key_admin",
                "action": action,
                "time": datetime.now(UTC).isoformat(),
                "who": cli_actor(),
                **detail,
            }
        )
    finally:
        await audit.close()


def migrate_stores(args: argparse.Namespace) -> dict[str, Any]:
    """``keys migrate --from A --to B``: copy, idempotently, and verify."""
    settings = load_settings(args.config)
    if args.to.startswith(("postgresql://", "postgres://")):
        from broker.keys.store.postgres import migrate  # noqa: PLC0415

        asyncio.run(migrate(args.to, timeout_seconds=settings.keys.upstream_timeout_seconds))

    async def run() -> dict[str, Any]:
        source, target = await _open(settings, args.source), await _open(settings, args.to)
        try:
            report = await copy_versions(await source.list_versions(), target)
        finally:
            await source.close()
            await target.close()
        detail = {"from": _kind(args.source), "to": _kind(args.to), **report.describe()}
        await _log(settings, "migrate-store", detail)
        return detail

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
    try:
        raw = args.file.read_bytes()
    except OSError as exc:
        raise ConfigError("FILE", f"cannot read {args.file}") from exc
    if len(raw) > MAX_BACKUP_BYTES:
        raise InputError("the backup file is too large")
    try:
        document = loads_bounded(raw)
    except ValueError as exc:
        raise InputError("the backup file is not JSON") from exc
    if not isinstance(document, dict):
        raise InputError("the backup file is not a key backup")
    records, digest = read_backup(document)
    trusted = args.digest or _logged_backup_digest(settings, digest)
    if trusted != digest:
        raise InputError(
            f"the backup's digest {digest} is not one this broker logged for a backup (nor the "
            "--digest given): refused"
        )

    async def run() -> dict[str, Any]:
        store = await _open(settings)
        try:
            report = await copy_versions(records, store)
        finally:
            await store.close()
        detail = {"file": str(args.file), **report.describe()}
        await _log(settings, "restore", detail)
        return detail

    print(json.dumps(asyncio.run(run()), indent=2))
    return 0


def _logged_backup_digest(settings: Settings, digest: str) -> str | None:
    """``digest`` when a ``key_admin`` ``backup`` record in the decision log names it."""
    try:
        data = settings.audit.log.read_bytes()
    except OSError:
        return None
    for _, record in iter_records(data):
        if record.get("action") == "backup" and record.get("digest") == digest:
            return digest
    return None


def _write_private(path: Path, text: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _kind(uri: str) -> str:
    """A store for records: its kind and place, never credentials."""
    kind, _, rest = uri.partition(":")
    if kind in ("postgresql", "postgres"):
        return f"postgresql://{rest.rsplit('@', 1)[-1]}"
    return uri
