"""Key lifecycle and DEK access: the only code that sees plaintext DEKs on the broker side.

Plaintext DEKs exist only in process memory, only for the time needed to wrap them to a runner
key (``keys/wrap.py``); the store holds the KEK-wrapped form and metadata.
"""

from __future__ import annotations

import os
import re
from datetime import datetime

from broker.errors import ErrorCode, InputError, KeyUnavailable, NotFound
from broker.keys.kek.base import KekProvider, dek_aad
from broker.keys.store.base import KeyStore, KeyVersionRecord, Purpose, VersionState

DEK_BYTES = 32
KEY_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")
MAX_KEY_NAME = 128


def validate_key_name(name: str) -> str:
    """Key names: lower-case path segments (``models/llama-70b``), at most 128 characters.

    Raises:
        InputError: ``bad_request`` for another form.
    """
    if len(name) > MAX_KEY_NAME or not KEY_NAME.match(name):
        raise InputError(
            "key names are lower-case segments of [a-z0-9._-] joined by '/', "
            f"at most {MAX_KEY_NAME} characters"
        )
    return name


class KeyService:
    def __init__(self, store: KeyStore, kek: KekProvider) -> None:
        self._store = store
        self._kek = kek

    @property
    def kek(self) -> KekProvider:
        return self._kek

    async def create(self, name: str, purpose: Purpose, *, now: datetime) -> KeyVersionRecord:
        """Generate a random AES-256 DEK, wrap it with the KEK, store version 1.

        Raises:
            InputError: for a bad name; ``Conflict`` when the key exists.
            UpstreamError: when the KEK or the store cannot answer.
        """
        validate_key_name(name)
        dek = os.urandom(DEK_BYTES)
        record = KeyVersionRecord(
            name=name,
            version=1,
            purpose=purpose,
            state=VersionState.ENABLED,
            wrapped_dek=await self._kek.wrap(dek, dek_aad(name, 1)),
            kek_ref=self._kek.reference,
            created_at=now,
        )
        await self._store.add_version(record)
        return record

    async def list(self) -> list[KeyVersionRecord]:
        return await self._store.list_versions()

    async def resolve(self, name: str, version: int | None) -> KeyVersionRecord:
        """The version a release would use: the named one, or the newest enabled one.

        Raises:
            NotFound: ``key_unknown``.
            KeyUnavailable: ``key_version_unavailable`` when disabled or destroyed.
        """
        record = await self._store.get_version(name, version)
        if record is None:
            raise NotFound(
                f"no key {name!r}" + (f" version {version}" if version else ""),
                code=ErrorCode.KEY_UNKNOWN,
            )
        if record.state is not VersionState.ENABLED:
            raise KeyUnavailable(f"key {name!r} version {record.version} is {record.state.value}")
        return record

    async def unwrap(self, record: KeyVersionRecord) -> bytes:
        """The plaintext DEK of a resolved version.

        Raises:
            UpstreamError: ``kek_unavailable`` when the KEK cannot unwrap it.
        """
        return await self._kek.unwrap(record.wrapped_dek, dek_aad(record.name, record.version))
