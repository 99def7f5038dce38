"""Building the key service from configuration URIs (``[keys] store`` and ``kek``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from broker.config import KeySettings
from broker.errors import ConfigError
from broker.keys.kek.local import LocalKek, create_kek_file
from broker.keys.service import KeyService
from broker.keys.store.sqlite import SqliteKeyStore, sqlite_path

log = logging.getLogger(__name__)


def local_kek_path(uri: str) -> Path:
    """The path of a ``local:PATH`` KEK URI.

    Raises:
        ConfigError: ``keys.kek`` for another form.
    """
    if not uri.startswith("local:") or len(uri) == len("local:"):
        raise ConfigError("keys.kek", "expected local:PATH")
    return Path(uri.removeprefix("local:"))


@asynccontextmanager
async def open_key_service(
    settings: KeySettings, *, create_missing_kek: bool = False
) -> AsyncIterator[KeyService]:
    """Open the store and the KEK; close the store on exit.

    Args:
        settings: the ``[keys]`` section.
        create_missing_kek: create a new development KEK file when none exists and the store
            is empty (``broker keys create`` on a fresh install). ``serve`` never does.

    Raises:
        ConfigError: when the KEK is missing, unreadable, or would orphan existing keys.
    """
    store = SqliteKeyStore(sqlite_path(settings.store))
    await store.open()
    try:
        kek_path = local_kek_path(settings.kek)
        may_create = create_missing_kek and not await store.list_versions()
        kek = await asyncio.to_thread(_local_kek, kek_path, may_create=may_create)
        yield KeyService(store, kek)
    finally:
        await store.close()


def _local_kek(path: Path, *, may_create: bool) -> LocalKek:
    if not path.exists():
        if not may_create:
            raise ConfigError(
                "keys.kek",
                f"KEK file {path} does not exist (only `broker keys create` on an empty store "
                "makes a new development KEK)",
            )
        create_kek_file(path)
        log.warning("created a new development KEK at %s", path)
    return LocalKek(path)
