"""The runner's key for a file: ``client.release_for(source)`` reads the encrypted file's header
and releases the key version it was made with, so a file made before a rotation still opens
(``release`` of the newest version cannot open it: the README's old pattern)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker.client.weights import open_encrypted
from broker.crypto.weights import WeightsFormatError
from tests.integration.conftest import RunningBroker
from tests.support.constants import KEY
from tests.support.weights import sealed_before_a_rotation


def read_plaintext(path: Path, dek: bytes, kid: str) -> bytes:
    with open_encrypted(path, dek, kid) as reader:
        return reader.read()


async def test_release_for_opens_a_file_made_before_a_rotation(broker: RunningBroker) -> None:
    sealed, plain = await sealed_before_a_rotation(broker.workdir, "w.safetensors", 200_000)
    async with broker.client() as client:
        newest = await client.release(KEY, broker.token_source())
        assert newest.version == 2
        with pytest.raises(WeightsFormatError, match="models/llama#1"):
            await asyncio.to_thread(read_plaintext, sealed, newest.dek, f"{KEY}#2")
        released = await client.release_for(sealed, broker.token_source())
    assert (released.key, released.version) == (KEY, 1)
    kid = f"{released.key}#{released.version}"
    assert await asyncio.to_thread(read_plaintext, sealed, released.dek, kid) == plain


async def test_release_for_refuses_a_file_for_another_key(broker: RunningBroker) -> None:
    sealed, _ = await sealed_before_a_rotation(broker.workdir, "w.safetensors", 10_000)
    async with broker.client() as client:
        with pytest.raises(WeightsFormatError, match="not 'models/other'"):
            await client.release_for(sealed, broker.token_source(), expected_key="models/other")
        released = await client.release_for(sealed, broker.token_source(), expected_key=KEY)
    assert (released.key, released.version) == (KEY, 1)
    releases = [r for r in broker.records() if r.get("type") == "release"]
    assert len(releases) == 1  # the refused file asked the broker for nothing


async def test_release_for_refuses_a_file_that_is_not_encrypted(broker: RunningBroker) -> None:
    plain = broker.workdir / "config.json"
    await asyncio.to_thread(plain.write_text, "{}")
    async with broker.client() as client:
        with pytest.raises(WeightsFormatError):
            await client.release_for(plain, broker.token_source())
    assert not [r for r in broker.records() if r.get("type") == "release"]  # nothing was asked
