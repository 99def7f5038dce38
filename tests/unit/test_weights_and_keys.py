"""Segmented weights encryption, the local KEK, and the key service over SQLite."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from broker.core.errors import ConfigError, Conflict, ErrorCode, InputError, NotFound, UpstreamError
from broker.crypto.weights import WeightsFormatError, decrypt_stream, encrypt_stream
from broker.keys.kek.base import dek_aad
from broker.keys.kek.local import LocalKek, create_kek_file
from broker.keys.kek.pkcs11 import parse_pkcs11_uri
from broker.keys.kek.ring import KekRing
from broker.keys.service import KeyService, validate_key_name
from broker.keys.store.base import Purpose
from broker.keys.store.sqlite import SqliteKeyStore
from tests.vectors.tokens import NOW

DEK = bytes(range(32))
KID = "models/a#1"


def seal(data: bytes, segment: int = 64) -> bytes:
    out = io.BytesIO()
    encrypt_stream(DEK, KID, io.BytesIO(data), out, segment_size=segment)
    return out.getvalue()


def unseal(blob: bytes, kid: str = KID, dek: bytes = DEK) -> bytes:
    out = io.BytesIO()
    decrypt_stream(dek, kid, io.BytesIO(blob), out)
    return out.getvalue()


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 640, 1000])
def test_weights_roundtrip(size: int) -> None:
    data = os.urandom(size)
    assert unseal(seal(data)) == data


def test_weights_truncated_at_segment_boundary_detected() -> None:
    blob = seal(os.urandom(640))
    header_len = len(blob) - 10 * (64 + 16)
    with pytest.raises(WeightsFormatError):
        unseal(blob[: header_len + 5 * (64 + 16)])


def test_weights_reordered_segments_detected() -> None:
    blob = seal(os.urandom(640))
    header_len = len(blob) - 10 * 80
    segments = [blob[header_len + i * 80 : header_len + (i + 1) * 80] for i in range(10)]
    segments[1], segments[2] = segments[2], segments[1]
    with pytest.raises(WeightsFormatError):
        unseal(blob[:header_len] + b"".join(segments))


def test_weights_flipped_byte_detected() -> None:
    blob = bytearray(seal(os.urandom(300)))
    blob[-40] ^= 1
    with pytest.raises(WeightsFormatError):
        unseal(bytes(blob))


def test_weights_for_another_key_refused() -> None:
    with pytest.raises(WeightsFormatError):
        unseal(seal(b"x" * 10), kid="models/b#1")


def test_weights_with_wrong_dek_refused() -> None:
    with pytest.raises(WeightsFormatError):
        unseal(seal(b"x" * 10), dek=bytes(32))


async def test_local_kek_binds_name_and_version(tmp_path: Path) -> None:
    create_kek_file(tmp_path / "kek")
    kek = LocalKek(tmp_path / "kek")
    wrapped = await kek.wrap(DEK, dek_aad("models/a", 1))
    assert await kek.unwrap(wrapped, dek_aad("models/a", 1)) == DEK
    with pytest.raises(UpstreamError) as caught:
        await kek.unwrap(wrapped, dek_aad("models/b", 1))
    assert caught.value.code is ErrorCode.KEK_UNAVAILABLE


def test_world_readable_kek_refused(tmp_path: Path) -> None:
    create_kek_file(tmp_path / "kek")
    (tmp_path / "kek").chmod(0o644)
    with pytest.raises(Exception, match="0600"):
        LocalKek(tmp_path / "kek")


async def test_key_service_stores_only_wrapped_deks(tmp_path: Path) -> None:
    create_kek_file(tmp_path / "kek")
    store = SqliteKeyStore(tmp_path / "keys.db")
    await store.open()
    service = KeyService(store, KekRing(LocalKek(tmp_path / "kek")))
    record = await service.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
    dek = await service.unwrap(await service.resolve("models/a", None))
    assert len(dek) == 32
    assert dek not in (tmp_path / "keys.db").read_bytes()
    assert dek not in record.wrapped_dek
    with pytest.raises(Conflict):
        await service.create("models/a", Purpose.MODEL_WEIGHTS, now=NOW)
    assert (tmp_path / "keys.db").stat().st_mode & 0o077 == 0
    with pytest.raises(NotFound) as caught:
        await service.resolve("models/missing", None)
    assert caught.value.code is ErrorCode.KEY_UNKNOWN
    with pytest.raises(NotFound):
        await service.resolve("models/a", 2)
    await store.close()
    reopened = SqliteKeyStore(tmp_path / "keys.db")
    await reopened.open()
    assert [r.name for r in await reopened.list_versions()] == ["models/a"]
    await reopened.close()


@pytest.mark.parametrize("name", ["", "Models/A", "../etc", "a//b", "a/", "x" * 200, "a b"])
def test_bad_key_names_refused(name: str) -> None:
    with pytest.raises(InputError):
        validate_key_name(name)


def test_pkcs11_pin_never_in_repr_or_reference() -> None:
    uri = parse_pkcs11_uri(
        "pkcs11:token=t;object=o?module-path=/lib/x.so&pin-value=super-secret-pin"
    )
    assert uri.pin == "super-secret-pin"
    assert "super-secret-pin" not in repr(uri)
    assert "super-secret-pin" not in uri.reference


@pytest.mark.parametrize(
    "uri",
    [
        "pkcs11:object=o?module-path=/x.so&pin-value=1",
        "pkcs11:token=t?module-path=/x.so&pin-value=1",
        "pkcs11:token=t;object=o?pin-value=1",
        "pkcs11:token=t;object=o?module-path=/x.so",
        "pkcs11:token=t;object=o?module-path=/x.so&pin-source=http://x",
    ],
)
def test_incomplete_pkcs11_uris_refused(uri: str) -> None:
    with pytest.raises(ConfigError):
        parse_pkcs11_uri(uri)
