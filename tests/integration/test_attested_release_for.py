"""Issue 28 item 8: on an attestation result too, the runner's key for a file comes from the
file's header (``Attestation.release_for``), so files made before a key rotation keep opening;
several files go in one attested request; a file for another key asks the broker nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClientError
from broker.client.weights import open_encrypted
from broker.crypto.weights import WeightsFormatError
from tests.integration.attested import attest_broker
from tests.support.cli import run
from tests.support.constants import KEY
from tests.support.weights import sealed_before_a_rotation


def read_plaintext(path: Path, dek: bytes, kid: str) -> bytes:
    with open_encrypted(path, dek, kid) as reader:
        return reader.read()


async def sealed_with_newest(workdir: Path, name: str) -> tuple[Path, bytes]:
    plain = name.encode() * 1000
    source, sealed = workdir / name, workdir / f"{name}.brkw"
    await asyncio.to_thread(source.write_bytes, plain)
    config = str(workdir / "broker.toml")
    made = await asyncio.to_thread(
        run, "weights", "encrypt", str(source), str(sealed), "--key", KEY, "--config", config
    )
    assert made.returncode == 0, made.stderr
    return sealed, plain


async def test_an_attested_runner_opens_files_made_before_a_rotation(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker)
    old, old_plain = await sealed_before_a_rotation(broker.workdir, "old.safetensors", 50_000)
    new, new_plain = await sealed_with_newest(broker.workdir, "new.safetensors")
    broker = broker.from_now_on()
    async with broker.client() as client:
        attestation = await client.attest(broker.token_source())
        newest = await attestation.release(KEY)
        with pytest.raises(WeightsFormatError, match="models/llama#1"):  # the README's old way
            await asyncio.to_thread(read_plaintext, old, newest.dek, f"{KEY}#2")
        single = await attestation.release_for(old, expected_key=KEY)
        both = await attestation.release_many_for([old, new, old])
    assert (single.key, single.version) == (KEY, 1)
    assert [(r.key, r.version) for r in both if not isinstance(r, BrokerClientError)] == [
        (KEY, 1),
        (KEY, 2),
        (KEY, 1),
    ]
    expected = ((old, old_plain), (new, new_plain), (old, old_plain))
    for released, (path, plain) in zip(both, expected, strict=True):
        assert not isinstance(released, BrokerClientError)
        kid = f"{released.key}#{released.version}"
        assert await asyncio.to_thread(read_plaintext, path, released.dek, kid) == plain
    releases = [r for r in broker.records() if r["type"] == "attested_release"]
    assert len(releases) == 3  # release, release_for, and one request for the three files
    assert [(k["key"], k["version"]) for k in releases[2]["keys"]] == [(KEY, 1), (KEY, 2)]


async def test_a_file_for_another_key_asks_the_attested_broker_nothing(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker)
    old, _ = await sealed_before_a_rotation(broker.workdir, "old.safetensors", 10_000)
    plain = broker.workdir / "config.json"
    await asyncio.to_thread(plain.write_text, "{}")
    broker = broker.from_now_on()
    async with broker.client() as client:
        attestation = await client.attest(broker.token_source())
        with pytest.raises(WeightsFormatError, match="not 'models/other'"):
            await attestation.release_for(old, expected_key="models/other")
        with pytest.raises(WeightsFormatError):  # one bad file: none of them is asked for
            await attestation.release_many_for([old, plain])
    assert not [r for r in broker.records() if r["type"] == "attested_release"]
