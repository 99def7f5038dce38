"""The DEK store port: wrapped DEKs and their metadata, never plaintext.

One record per key version. A destroyed version keeps its metadata (and its history in the
decision log) but its wrapped material is gone for good (crypto-shredding).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Protocol

from broker.core.protocol import Algorithm


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
    """One stored version of a key: metadata plus the KEK-wrapped material."""

    name: str
    version: int
    purpose: Purpose
    state: VersionState
    wrapped_dek: bytes
    kek_ref: str
    created_at: datetime
    updated_at: datetime | None = None
    algorithm: Algorithm = Algorithm.AES_256
    public_key: bytes = b""  # HPKE public key for query keys; empty for symmetric keys

    def evolve(self, **changes: object) -> KeyVersionRecord:
        return replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> dict[str, object]:
        """What a key version looks like to people: metadata only, never key material."""
        return {
            "name": self.name,
            "version": self.version,
            "purpose": self.purpose.value,
            "algorithm": self.algorithm.value,
            "state": self.state.value,
            "kek": self.kek_ref,
            "created_at": self.created_at.isoformat(),
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
        }


def same_row(stored: KeyVersionRecord, expected: KeyVersionRecord) -> bool:
    """Whether ``stored`` is still the row ``expected`` was read as: what a change may rest on
    (``KeyStore.replace`` compares exactly these; timestamps are not compared)."""
    return (
        stored.name == expected.name
        and stored.version == expected.version
        and stored.state is expected.state
        and stored.wrapped_dek == expected.wrapped_dek
        and stored.kek_ref == expected.kek_ref
        and stored.public_key == expected.public_key
    )


class KeyStore(Protocol):
    async def add_version(self, record: KeyVersionRecord) -> None:
        """Store a new version; raise ``Conflict`` if that (name, version) exists."""
        ...

    async def get_version(self, name: str, version: int) -> KeyVersionRecord | None: ...

    async def latest_version(self, name: str, *, enabled_only: bool) -> KeyVersionRecord | None:
        """The highest version (optionally: the highest enabled one); ``None`` when absent."""
        ...

    async def list_versions(self, name: str | None = None) -> list[KeyVersionRecord]:
        """Versions ordered by name then version (of one key, or of all)."""
        ...

    async def has_purpose(self, purpose: Purpose) -> bool:
        """Whether any version of ``purpose`` is stored, in one cheap call that reads no key
        material (``/readyz`` asks it in the background; a store that cannot answer raises
        ``key_store_unavailable``)."""
        ...

    async def replace(self, record: KeyVersionRecord, *, expected: KeyVersionRecord) -> bool:
        """Write ``record`` over its (name, version) in one atomic compare-and-swap: only if
        the stored row is still ``expected`` (``same_row``: state, wrapped DEK, KEK reference,
        public half), and never over a destroyed row (destruction is terminal). False when the
        row changed meanwhile, is destroyed, or is gone; nothing is written then."""
        ...

    async def close(self) -> None: ...
