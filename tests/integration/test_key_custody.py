"""Key custody through the real paths: SoftHSM2 over PKCS#11, the google-cloud-kms and
google-cloud-secret-manager clients over gRPC to local servers, SQLite on disk."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pkcs11
import pytest

from broker.client import BrokerClientError
from broker.config import KeySettings
from broker.core.errors import ErrorCode, KeyUnavailable, UpstreamError
from broker.keys.factory import open_key_service
from broker.keys.kek.pkcs11 import parse_pkcs11_uri
from broker.keys.store.base import Purpose, VersionState
from tests.fakes.google_kms import FakeKms
from tests.fakes.google_secretmanager import FakeSecretManager
from tests.integration.conftest import KMS_KEY, RunningBroker
from tests.support.constants import KEY

NOW = datetime(2026, 11, 30, tzinfo=UTC)
COMBINATIONS = [
    ("sqlite", "local"),
    ("sqlite", "pkcs11"),
    ("sqlite", "cloudkms"),
    ("secretmanager", "cloudkms"),
    ("secretmanager", "pkcs11"),
]


def key_settings(
    tmp_path: Path,
    store: str,
    kek: str,
    *,
    softhsm: str,
    kms: FakeKms,
    sm: FakeSecretManager,
    **extra: Any,
) -> KeySettings:
    stores = {
        "sqlite": f"sqlite:///{tmp_path / 'keys.db'}",
        "secretmanager": "secretmanager:projects/broker-test",
    }
    keks = {
        "local": f"local:{tmp_path / 'kek.key'}",
        "pkcs11": softhsm,
        "cloudkms": f"cloudkms:{KMS_KEY}",
    }
    return KeySettings(
        store=stores[store],
        kek=keks[kek],
        kms_endpoint=kms.endpoint,
        secretmanager_endpoint=sm.endpoint,
        **{"upstream_timeout_seconds": 2, **extra},
    )


@pytest.mark.parametrize(("store", "kek"), COMBINATIONS)
async def test_lifecycle_on_every_store_and_kek(
    tmp_path: Path,
    store: str,
    kek: str,
    softhsm: str,
    fake_kms: FakeKms,
    fake_secretmanager: FakeSecretManager,
) -> None:
    settings = key_settings(
        tmp_path, store, kek, softhsm=softhsm, kms=fake_kms, sm=fake_secretmanager
    )
    async with open_key_service(settings, create_missing_kek=True) as keys:
        v1 = await keys.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
        dek1 = await keys.unwrap(await keys.resolve("models/a", None))
        v2 = await keys.rotate("models/a", now=NOW)
        assert (await keys.resolve("models/a", None)).version == 2
        dek2 = await keys.unwrap(v2)
        assert dek1 != dek2
        assert await keys.unwrap(await keys.resolve("models/a", 1)) == dek1  # old stays usable
        await keys.set_enabled("models/a", 2, False, now=NOW)
        assert (await keys.resolve("models/a", None)).version == 1  # newest enabled
        with pytest.raises(KeyUnavailable):
            await keys.resolve("models/a", 2)
        await keys.set_enabled("models/a", 2, True, now=NOW)
        destroyed = await keys.destroy("models/a", 1, now=NOW)
        assert destroyed.state is VersionState.DESTROYED
        with pytest.raises(KeyUnavailable):
            await keys.resolve("models/a", 1)
        listed = await keys.list_versions("models/a")
        assert [(r.version, r.state.value, bool(r.wrapped_dek)) for r in listed] == [
            (1, "destroyed", False),
            (2, "enabled", True),
        ]
        assert v1.kek_ref == keys.kek.reference
    # Plaintext never reached the store; destroyed material is gone from it.
    if store == "sqlite":
        data = (tmp_path / "keys.db").read_bytes() + b"".join(
            p.read_bytes() for p in tmp_path.glob("keys.db-*")
        )
        assert dek1 not in data
        assert dek2 not in data
        with sqlite3.connect(tmp_path / "keys.db") as db:
            (wrapped,) = db.execute(
                "SELECT wrapped_dek FROM key_versions WHERE version = 1"
            ).fetchone()
        assert wrapped == b""
    else:
        payloads = [v for s in fake_secretmanager.secrets.values() for v in s.versions if v]
        assert all(dek1 not in p and dek2 not in p for p in payloads)
        (v1_secret,) = [s for n, s in fake_secretmanager.secrets.items() if n.endswith("-v1")]
        assert v1_secret.versions[:-1]
        assert all(v is None for v in v1_secret.versions[:-1])
    if kek == "cloudkms":
        assert "Encrypt" in fake_kms.calls
        assert "Decrypt" in fake_kms.calls


def test_pkcs11_kek_cannot_be_extracted(softhsm: str) -> None:
    uri = parse_pkcs11_uri(softhsm)
    session = (
        pkcs11.lib(str(uri.module_path)).get_token(token_label=uri.token).open(user_pin=uri.pin)
    )
    try:
        key = session.get_key(label=uri.object)
        assert key[pkcs11.Attribute.EXTRACTABLE] is False
        with pytest.raises(pkcs11.exceptions.AttributeSensitive):
            _ = key[pkcs11.Attribute.VALUE]
    finally:
        session.close()


async def test_pkcs11_wrong_pin_is_kek_unavailable(tmp_path: Path, softhsm: str) -> None:
    wrong = softhsm.split("&pin-source=", maxsplit=1)[0] + "&pin-value=not-the-pin"
    settings = KeySettings(store=f"sqlite:///{tmp_path / 'k.db'}", kek=wrong)
    with pytest.raises(UpstreamError) as caught:
        async with open_key_service(settings):
            pass
    assert caught.value.code is ErrorCode.KEK_UNAVAILABLE


async def test_kms_checksum_corruption_fails_closed(
    tmp_path: Path, softhsm: str, fake_kms: FakeKms, fake_secretmanager: FakeSecretManager
) -> None:
    settings = key_settings(
        tmp_path, "sqlite", "cloudkms", softhsm=softhsm, kms=fake_kms, sm=fake_secretmanager
    )
    async with open_key_service(settings) as keys:
        fake_kms.corrupt_ciphertext = True
        with pytest.raises(UpstreamError) as caught:
            await keys.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
        assert caught.value.code is ErrorCode.KEK_UNAVAILABLE
        fake_kms.corrupt_ciphertext = False
        fake_kms.skip_verification = True  # the service did not confirm our checksums
        with pytest.raises(UpstreamError):
            await keys.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
        assert await keys.list_versions() == []


async def test_dek_cache_saves_kms_round_trips_and_is_invalidated(
    tmp_path: Path, softhsm: str, fake_kms: FakeKms, fake_secretmanager: FakeSecretManager
) -> None:
    settings = key_settings(
        tmp_path,
        "sqlite",
        "cloudkms",
        softhsm=softhsm,
        kms=fake_kms,
        sm=fake_secretmanager,
        dek_cache_seconds=60,
        dek_cache_max=8,
    )
    async with open_key_service(settings) as keys:
        await keys.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
        for _ in range(5):
            await keys.unwrap(await keys.resolve("models/a", None))
        assert fake_kms.calls.count("Decrypt") == 1
        await keys.set_enabled("models/a", 1, False, now=NOW)
        assert len(keys.cache) == 0
        with pytest.raises(KeyUnavailable):
            await keys.resolve("models/a", None)  # refused at once, cached bytes or not
        await keys.set_enabled("models/a", 1, True, now=NOW)
        await keys.unwrap(await keys.resolve("models/a", None))
        assert fake_kms.calls.count("Decrypt") == 2


async def cloud_broker(
    start_broker: Any, fake_kms: FakeKms, fake_sm: FakeSecretManager, **environ: str
) -> RunningBroker:
    return await start_broker(  # type: ignore[no-any-return]
        environ={
            "BROKER_KEYS_STORE": "secretmanager:projects/broker-test",
            "BROKER_KEYS_KEK": f"cloudkms:{KMS_KEY}",
            "BROKER_KEYS_KMS_ENDPOINT": fake_kms.endpoint,
            "BROKER_KEYS_SECRETMANAGER_ENDPOINT": fake_sm.endpoint,
            "BROKER_KEYS_UPSTREAM_TIMEOUT_SECONDS": "2",
            **environ,
        }
    )


async def test_release_through_cloud_kms_and_secret_manager(
    start_broker: Any, fake_kms: FakeKms, fake_secretmanager: FakeSecretManager
) -> None:
    broker = await cloud_broker(start_broker, fake_kms, fake_secretmanager)
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
    assert len(released.dek) == 32
    assert "AccessSecretVersion" in fake_secretmanager.calls


async def test_kms_outage_is_503_and_nothing_released(
    start_broker: Any, fake_kms: FakeKms, fake_secretmanager: FakeSecretManager
) -> None:
    broker = await cloud_broker(
        start_broker, fake_kms, fake_secretmanager, BROKER_KEYS_DEK_CACHE_SECONDS="0"
    )
    fake_kms.unavailable = True
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source())
    assert (caught.value.status, caught.value.code) == (503, "kek_unavailable")
    assert broker.records()[-1]["result"] == "error"


async def test_secret_manager_outage_is_503(
    start_broker: Any, fake_kms: FakeKms, fake_secretmanager: FakeSecretManager
) -> None:
    broker = await cloud_broker(start_broker, fake_kms, fake_secretmanager)
    fake_secretmanager.unavailable = True
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source())
    assert (caught.value.status, caught.value.code) == (503, "key_store_unavailable")


async def test_cached_dek_survives_a_kms_outage_within_its_lifetime(
    start_broker: Any, fake_kms: FakeKms, fake_secretmanager: FakeSecretManager
) -> None:
    broker = await cloud_broker(
        start_broker, fake_kms, fake_secretmanager, BROKER_KEYS_DEK_CACHE_SECONDS="300"
    )
    async with broker.client() as client:
        first = await client.release(KEY, broker.token_source())
        fake_kms.unavailable = True
        second = await client.release(KEY, broker.token_source())
    assert first.dek == second.dek


async def test_release_with_pkcs11_kek(start_broker: Any, softhsm: str) -> None:
    broker: RunningBroker = await start_broker(environ={"BROKER_KEYS_KEK": softhsm})
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
    assert len(released.dek) == 32
    assert broker.records()[-1]["result"] == "allow"


async def test_store_with_many_keys_pages(
    tmp_path: Path, softhsm: str, fake_kms: FakeKms, fake_secretmanager: FakeSecretManager
) -> None:
    settings = key_settings(
        tmp_path,
        "secretmanager",
        "pkcs11",
        softhsm=softhsm,
        kms=fake_kms,
        sm=fake_secretmanager,
        upstream_timeout_seconds=20,  # 260 creates at once, then several pages: not a timeout test
    )
    async with open_key_service(settings) as keys:
        await asyncio.gather(
            *(keys.create(f"models/m{i:03d}", Purpose.GENERIC, now=NOW) for i in range(260))
        )
        assert len(await keys.list_versions()) == 260  # more than one ListSecrets page
