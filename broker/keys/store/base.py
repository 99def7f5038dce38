"""The DEK store port: wrapped DEKs and their metadata, never plaintext."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Protocol


class Purpose(StrEnum):
    MODEL_WEIGHTS = "model-weights"
    QUERY = "query"
    GENERIC = "generic"


class VersionState(StrEnum):
    ENABLED = "enabled"
    DISABLED = "disabled"
    DESTROYED = "destroyed"


@dataclass(frozen=True)
class KeyVersionRecord:
    """One stored version of a key: metadata plus the KEK-wrapped DEK."""

    name: str
    version: int
    purpose: Purpose
    state: VersionState
    wrapped_dek: bytes
    kek_ref: str
    created_at: datetime


class KeyStore(Protocol):
    async def add_version(self, record: KeyVersionRecord) -> None:
        """Store a new version; raise ``Conflict`` if that (name, version) exists."""
        ...

    async def get_version(self, name: str, version: int | None) -> KeyVersionRecord | None:
        """A given version, or with ``None`` the newest enabled one; ``None`` when absent."""
        ...

    async def list_versions(self) -> list[KeyVersionRecord]:
        """Every version of every key, ordered by name then version."""
        ...

    async def close(self) -> None: ...
