"""Building the key service from configuration URIs (``[keys] store`` and ``kek``)."""

from __future__ import annotations

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
        if not kek_path.exists():
            if not create_missing_kek:
                raise ConfigError("keys.kek", f"KEK file {kek_path} does not exist")
            if await store.list_versions():
                raise ConfigError(
                    "keys.kek", f"KEK file {kek_path} is missing but the store holds wrapped keys"
                )
            create_kek_file(kek_path)
            log.warning("created a new development KEK at %s", kek_path)
        yield KeyService(store, LocalKek(kek_path))
    finally:
        await store.close()
