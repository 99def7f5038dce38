"""Building the key service from the configured references (``[keys] store``, ``kek``,
``kek_previous``), parsed once by the configuration (``KeySettings.store_ref``, ``kek_refs``)
and matched on by type here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import assert_never

from broker.config import KeySettings
from broker.core.errors import ConfigError
from broker.core.refs import (
    CloudKmsRef,
    KekRef,
    LocalFileRef,
    Pkcs11Ref,
    PostgresRef,
    SecretManagerRef,
    SqliteRef,
    kek_ref,
)
from broker.keys.caches import DekCache, MetadataCache
from broker.keys.changes import ChangeLogger
from broker.keys.kek.base import KekProvider
from broker.keys.kek.local import LocalKek, create_kek_file
from broker.keys.kek.ring import KekRing
from broker.keys.service import KeyService
from broker.keys.store.base import KeyStore
from broker.keys.store.sqlite import SqliteKeyStore

log = logging.getLogger(__name__)


async def open_store(settings: KeySettings) -> KeyStore:
    """Open the DEK store a ``[keys] store`` URI names.

    Raises:
        ConfigError: for an unsupported URI.
        UpstreamError: ``key_store_unavailable`` when it cannot be opened.
    """
    ref = settings.store_ref
    if isinstance(ref, SecretManagerRef):
        from broker.keys.store.secretmanager import SecretManagerKeyStore, parse_project  # noqa: PLC0415

        manager = SecretManagerKeyStore(
            parse_project(ref.uri),
            endpoint=settings.secretmanager_endpoint,
            timeout_seconds=settings.upstream_timeout_seconds,
        )
        await manager.open()
        return manager
    if isinstance(ref, PostgresRef):
        from broker.keys.store.postgres import PostgresKeyStore  # noqa: PLC0415

        shared = PostgresKeyStore(ref.uri, timeout=settings.upstream_timeout_seconds)
        await shared.open()
        return shared
    if not isinstance(ref, SqliteRef):
        raise ConfigError("keys.store", f"{ref.kind} is not a key store")
    store = SqliteKeyStore(ref.path)
    await store.open()
    return store


@asynccontextmanager
async def open_key_service(
    settings: KeySettings,
    *,
    create_missing_kek: bool = False,
    kek_uri: str | None = None,
    change_log: ChangeLogger | None = None,
) -> AsyncIterator[KeyService]:
    """Open the store and the KEKs; close them on exit.

    Args:
        settings: the ``[keys]`` section.
        create_missing_kek: create a new development KEK file when a ``local:`` KEK does not
            exist and the store is empty (``broker keys create`` on a fresh install).
        kek_uri: make this KEK the primary (``keys rewrap --to``); the configured ``kek`` and
            ``kek_previous`` stay available for unwrapping. Not a setting, so it is parsed here,
            once, by the same parser (``core/refs.py``) under the same name (``keys.kek``).
        change_log: where key changes are recorded (the decision log's ``append_entry``: the
            outcome names its intent's leaf index); without
            it, changes are not recorded (read-only commands).

    Raises:
        ConfigError: when a KEK is missing, malformed, or would orphan existing keys.
        UpstreamError: when the store, an HSM or a KMS cannot be reached.
    """
    configured = settings.kek_refs  # kek, then kek_previous
    primary = kek_ref(kek_uri, "keys.kek") if kek_uri else configured[0]
    async with AsyncExitStack() as stack:
        store = await open_store(settings)
        stack.push_async_callback(store.close)
        may_create = create_missing_kek and not await store.list_versions()
        providers: list[KekProvider] = []
        for ref in dict.fromkeys([primary, *configured]):  # primary first, no duplicates
            provider = await _open(ref, settings, may_create=may_create and ref == configured[0])
            stack.push_async_callback(provider.close)
            providers.append(provider)
        ring = KekRing(providers[0], providers[1:])
        cache = DekCache(ttl_seconds=settings.dek_cache_seconds, max_entries=settings.dek_cache_max)
        metadata = MetadataCache(
            ttl_seconds=settings.metadata_cache_seconds, max_entries=settings.dek_cache_max
        )
        yield KeyService(
            store,
            ring,
            cache=cache,
            metadata=metadata,
            change_log=change_log,
            query_keys_publishable=settings.signing_key is not None,
        )


async def _open(ref: KekRef, settings: KeySettings, *, may_create: bool) -> KekProvider:
    """Open the provider a KEK reference names.

    Raises:
        ConfigError: for a missing local file, or a PKCS#11 or Cloud KMS URI its backend
            refuses.
        UpstreamError: ``kek_unavailable`` when an HSM or KMS cannot be reached at start-up.
    """
    if isinstance(ref, LocalFileRef):
        return await asyncio.to_thread(_local_kek, ref.path, may_create=may_create)
    # An HSM or KMS client loads only where one is configured (each costs start-up time).
    if isinstance(ref, Pkcs11Ref):
        from broker.keys.kek.pkcs11 import Pkcs11Kek, parse_pkcs11_uri  # noqa: PLC0415

        hsm = Pkcs11Kek(await asyncio.to_thread(parse_pkcs11_uri, ref.uri))
        await hsm.open()
        return hsm
    if isinstance(ref, CloudKmsRef):
        from broker.keys.kek.cloudkms import CloudKmsKek, parse_cloudkms_uri  # noqa: PLC0415

        kms = CloudKmsKek(
            parse_cloudkms_uri(ref.uri),
            endpoint=settings.kms_endpoint,
            credentials_file=settings.kms_credentials,
            timeout_seconds=settings.upstream_timeout_seconds,
        )
        await kms.open()
        return kms
    assert_never(ref)


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


@asynccontextmanager
async def open_kek_ring(settings: KeySettings) -> AsyncIterator[KekRing]:
    """The configured KEK (primary) and ``kek_previous``, without the key store (the sealed
    broker's own keys, ``api/sealed_keys.py``); closed on exit.

    Raises:
        ConfigError, UpstreamError: as ``open_key_service``.
    """
    async with AsyncExitStack() as stack:
        providers: list[KekProvider] = []
        for ref in dict.fromkeys(settings.kek_refs):
            provider = await _open(ref, settings, may_create=False)
            stack.push_async_callback(provider.close)
            providers.append(provider)
        yield KekRing(providers[0], providers[1:])
