"""Issue 31 item 3: the SDK's several-files and start-up-keys paths use the cheap path. A runner
with N files whose headers name K distinct keys attests once and sends ceil(K/16) releases on the
result (``BrokerClient.release_many_for``); its start-up keys go in one request
(``BrokerClient.release_many``); a broker with attestation results off (404) gets one
full-evidence release per distinct key. Counted in the real broker's decision log."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClientError, ReleasedDek
from broker.client.weights import open_encrypted
from broker.crypto.weights import WeightsFormatError
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from tests.integration.attested import DENIED_KEY
from tests.integration.conftest import RunningBroker
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.support.constants import ALLOWED, GPU_KEY, KEY
from tests.support.weights import sealed_before_a_rotation, sealed_with

SHARDS = tuple(f"models/shard-{i:02d}" for i in range(17))  # one more than a request holds


def kinds(broker: RunningBroker, kind: str) -> list[dict[str, Any]]:
    return [r for r in broker.records() if r["type"] == kind]


def asked(record: dict[str, Any]) -> list[tuple[str, int]]:
    return [(k["key"], k["version"]) for k in record["keys"]]


def read_plaintext(path: Path, released: ReleasedDek) -> bytes:
    with open_encrypted(path, released.dek, f"{released.key}#{released.version}") as reader:
        return reader.read()


async def create_keys(broker: RunningBroker, names: tuple[str, ...]) -> None:
    async with open_key_service(broker.settings.keys) as keys:
        for name in names:
            await keys.create(name, Purpose.MODEL_WEIGHTS, now=datetime.now(UTC))


async def attest_broker_allowing(
    start_broker: Callable[..., Any], names: tuple[str, ...]
) -> RunningBroker:
    """A broker with ``[attest]`` on whose policy allows the test image ``names`` too (created
    here), and ``DENIED_KEY``, which no image may have."""

    def setup(workdir: Path) -> None:
        with_result_key(workdir)
        data_file = workdir / "policies" / "broker" / "data.json"
        data = json.loads(data_file.read_text())
        data["images"].update({name: [ALLOWED] for name in names})
        data_file.write_text(json.dumps(data))

    broker: RunningBroker = await start_broker(extra_toml=ATTEST_TOML, workdir_setup=setup)
    await create_keys(broker, (*names, DENIED_KEY))
    return broker


async def test_files_of_seventeen_keys_take_one_attestation_and_two_requests(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker_allowing(start_broker, SHARDS)
    sealed = [await sealed_with(broker.workdir, f"s{i}", name) for i, name in enumerate(SHARDS)]
    sealed += [await sealed_with(broker.workdir, f"again{i}", SHARDS[i]) for i in (0, 16)]
    files = [path for path, _ in sealed]  # 19 files, 17 distinct keys
    broker = broker.from_now_on()
    async with broker.client() as client:
        results = await client.release_many_for(files, broker.token_source())
        assert len(kinds(broker, "attestation")) == 1
        releases = kinds(broker, "attested_release")
        assert [len(r["keys"]) for r in releases] == [16, 1]  # ceil(17 / 16) requests
        assert {k for r in releases for k in asked(r)} == {(name, 1) for name in SHARDS}
        assert all(r["result"] == "allow" for r in releases)
        assert not kinds(broker, "release")  # no full-evidence release
        for (path, plain), released in zip(sealed, results, strict=True):
            assert isinstance(released, ReleasedDek)
            assert await asyncio.to_thread(read_plaintext, path, released) == plain
        broker = broker.from_now_on()
        sixteen = await client.release_many_for(files[:16], broker.token_source())
    assert all(isinstance(r, ReleasedDek) for r in sixteen)
    assert len(kinds(broker, "attestation")) == 1
    assert [len(r["keys"]) for r in kinds(broker, "attested_release")] == [16]  # not split


async def test_start_up_keys_go_in_one_request_and_a_denied_one_is_its_own_answer(
    start_broker: Callable[..., Any],
) -> None:
    broker = (await attest_broker_allowing(start_broker, ())).from_now_on()
    async with broker.client() as client:
        keys = await client.release_many([KEY, GPU_KEY, DENIED_KEY, KEY], broker.token_source())
    assert len(kinds(broker, "attestation")) == 1
    (record,) = kinds(broker, "attested_release")  # one request, each key asked once
    assert [name for name, _ in asked(record)] == [KEY, GPU_KEY, DENIED_KEY]
    assert record["result"] == "partial"
    released = keys[KEY]
    assert isinstance(released, ReleasedDek)
    assert len(released.dek) == 32
    assert isinstance(keys[GPU_KEY], ReleasedDek)
    denied = keys[DENIED_KEY]
    assert isinstance(denied, BrokerClientError)
    assert denied.code == "policy_denied"


async def test_without_attestation_results_each_distinct_key_gets_one_full_release(
    start_broker: Callable[..., Any],
) -> None:
    """``[attest]`` off: ``POST /v1/attest`` is 404 and the SDK falls back, per distinct key."""
    broker: RunningBroker = await start_broker()
    old, old_plain = await sealed_before_a_rotation(broker.workdir, "old", 20_000)
    new, new_plain = await sealed_with(broker.workdir, "new", KEY)
    await create_keys(broker, (DENIED_KEY,))
    broker = broker.from_now_on()
    async with broker.client() as client:
        results = await client.release_many_for([old, new, old], broker.token_source())
        assert not kinds(broker, "attestation")
        assert [(r["key"], r["version"]) for r in kinds(broker, "release")] == [(KEY, 1), (KEY, 2)]
        broker = broker.from_now_on()
        keys = await client.release_many([KEY, DENIED_KEY], broker.token_source())
    for (path, plain), released in zip(
        ((old, old_plain), (new, new_plain), (old, old_plain)), results, strict=True
    ):
        assert isinstance(released, ReleasedDek)
        assert await asyncio.to_thread(read_plaintext, path, released) == plain
    assert isinstance(keys[KEY], ReleasedDek)
    denied = keys[DENIED_KEY]
    assert isinstance(denied, BrokerClientError)
    assert (denied.status, denied.code) == (403, "policy_denied")
    assert [r["key"] for r in kinds(broker, "release")] == [KEY, DENIED_KEY]


async def test_attest_false_and_files_for_another_key_are_honoured(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    broker = await attest_broker_allowing(start_broker, ())
    weights, _ = await sealed_with(broker.workdir, "w", KEY)
    gpu, _ = await sealed_with(broker.workdir, "g", GPU_KEY)
    plain = tmp_path / "config.json"
    await asyncio.to_thread(plain.write_text, "{}")
    broker = broker.from_now_on()
    async with broker.client() as client:
        full = await client.release_many_for([weights, gpu], broker.token_source(), attest=False)
        assert all(isinstance(r, ReleasedDek) for r in full)
        assert not kinds(broker, "attestation")
        assert len(kinds(broker, "release")) == 2
        broker = broker.from_now_on()
        with pytest.raises(WeightsFormatError, match="not 'models/llama'"):
            await client.release_many_for([weights, gpu], broker.token_source(), expected_key=KEY)
        with pytest.raises(WeightsFormatError):
            await client.release_many_for([weights, plain], broker.token_source())
    assert not broker.records()  # headers first: nothing attested, nothing asked
