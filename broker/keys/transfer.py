"""Moving wrapped keys between stores, and backing them up (as Vault's ``operator migrate`` and
snapshots do).

Only wrapped DEKs and metadata move: no plaintext, no KEK operation (the KEK that wrapped a DEK
must still be configured to use it). A copy is idempotent and resumable: a version already in the
target with the same content is skipped; one that differs stops the copy (``conflict``) rather
than overwrite, and every version is checked before the first is written, so such a copy writes
nothing. It ends by verifying the target: every source version is there with the same metadata
and the same SHA-256 of its wrapped DEK.

A backup file is JSON (``broker.keys-backup/v1``): every version, base64 where binary, and a
SHA-256 digest of the canonical list. ``broker keys backup`` logs that digest in a ``key_admin``
record; ``restore`` refuses a file whose content does not match its digest, or whose digest no
``backup`` record in the decision log names (unless the operator passes the digest they trust):
a file edited and re-digested is refused too. A wrapped DEK is bound to its key name and version
by the KEK's authenticated encryption, so one cannot be passed off as another.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.core.errors import Conflict, ErrorCode, InputError
from broker.core.protocol import Algorithm
from broker.keys.store.base import KeyStore, KeyVersionRecord, Purpose, VersionState

BACKUP_FORMAT = "broker.keys-backup/v1"
MAX_BACKUP_VERSIONS = 1_000_000


@dataclass(frozen=True)
class CopyReport:
    versions: int
    copied: int
    already_present: int
    digest: str  # of the source's versions, as verified in the target

    def describe(self) -> dict[str, Any]:
        return {
            "versions": self.versions,
            "copied": self.copied,
            "already_present": self.already_present,
            "verified_digest": self.digest,
        }


def record_json(record: KeyVersionRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "version": record.version,
        "purpose": record.purpose.value,
        "state": record.state.value,
        "algorithm": record.algorithm.value,
        "kek": record.kek_ref,
        "wrapped_dek": base64.b64encode(record.wrapped_dek).decode(),
        "public_key": base64.b64encode(record.public_key).decode(),
        "created_at": record.created_at.isoformat(),
        "updated_at": None if record.updated_at is None else record.updated_at.isoformat(),
    }


def record_from_json(value: Any) -> KeyVersionRecord:
    """Raises: InputError naming what is malformed."""
    if not isinstance(value, dict):
        raise InputError("a backup entry is not an object")
    try:
        updated = value.get("updated_at")
        return KeyVersionRecord(
            name=str(value["name"]),
            version=int(value["version"]),
            purpose=Purpose(value["purpose"]),
            state=VersionState(value["state"]),
            wrapped_dek=base64.b64decode(value["wrapped_dek"], validate=True),
            kek_ref=str(value["kek"]),
            created_at=datetime.fromisoformat(value["created_at"]),
            updated_at=None if updated is None else datetime.fromisoformat(updated),
            algorithm=Algorithm(value["algorithm"]),
            public_key=base64.b64decode(value.get("public_key", ""), validate=True),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise InputError(f"a backup entry is malformed: {exc}") from exc


def versions_digest(records: Iterable[KeyVersionRecord]) -> str:
    """``sha256:`` of the canonical list of versions (sorted by name and version)."""
    ordered = sorted(records, key=lambda r: (r.name, r.version))
    text = json.dumps([record_json(r) for r in ordered], sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass
class CopyProgress:
    """How far a copy got, for a caller that must say how a copy cut short ended: the versions
    it was to write (None until every version was checked: nothing written yet), and those it
    wrote."""

    to_write: list[KeyVersionRecord] | None = None
    written: list[KeyVersionRecord] = field(default_factory=list)


async def copy_versions(
    records: list[KeyVersionRecord], target: KeyStore, progress: CopyProgress | None = None
) -> CopyReport:
    """Copy ``records`` into ``target``, idempotently, then verify them there.

    Every version is checked before any is written, so a version that differs in the target
    stops the copy with nothing written. ``progress`` (when given) follows the copy: what it
    was to write, then each version as it is added (another writer, or a store failing, can
    still cut it short between two adds).

    Raises:
        Conflict: a version exists in the target with other content (nothing written), or
            another writer added one meanwhile.
        UpstreamError: a store cannot answer.
    """
    progress = CopyProgress() if progress is None else progress
    missing: list[KeyVersionRecord] = []
    for record in records:
        existing = await target.get_version(record.name, record.version)
        if existing is None:
            missing.append(record)
        elif record_json(existing) != record_json(record):
            raise Conflict(
                f"key {record.name!r} version {record.version} differs in the target; "
                "nothing was written",
                code=ErrorCode.CONFLICT,
            )
    progress.to_write = missing
    for record in missing:
        await target.add_version(record)
        progress.written.append(record)
    found = [await target.get_version(r.name, r.version) for r in records]
    if any(f is None for f in found) or versions_digest(
        [f for f in found if f is not None]
    ) != versions_digest(records):
        raise Conflict("the copy does not verify in the target", code=ErrorCode.CONFLICT)
    return CopyReport(
        len(records), len(missing), len(records) - len(missing), versions_digest(records)
    )


def backup_document(records: list[KeyVersionRecord], *, now: datetime) -> dict[str, Any]:
    ordered = sorted(records, key=lambda r: (r.name, r.version))
    return {
        "format": BACKUP_FORMAT,
        "created_at": now.isoformat(),
        "digest": versions_digest(ordered),
        "versions": [record_json(r) for r in ordered],
    }


def read_backup(document: Mapping[str, Any]) -> tuple[list[KeyVersionRecord], str]:
    """The versions of a backup whose content matches its digest; (versions, digest).

    Raises:
        InputError: another format, malformed, or a digest that does not match the content.
    """
    if document.get("format") != BACKUP_FORMAT:
        raise InputError(f"not a key backup ({BACKUP_FORMAT})")
    entries = document.get("versions")
    if not isinstance(entries, list) or len(entries) > MAX_BACKUP_VERSIONS:
        raise InputError("a key backup lists its versions")
    records = [record_from_json(entry) for entry in entries]
    digest = versions_digest(records)
    if digest != document.get("digest"):
        raise InputError("the backup's content does not match its digest: refused")
    return records, digest
