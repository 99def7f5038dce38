"""KEK rotation: `broker keys rewrap` of hundreds of DEKs, killed midway, re-run, then every key
released through a broker that knows only the new KEK (a PKCS#11 key on SoftHSM2)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from broker.config import load_settings
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from tests.integration.conftest import RunningBroker, write_config
from tests.support.cli import run
from tests.support.constants import ALLOWED
from tests.support.issuers import dev_issuer
from tests.support.key_changes import unanswered

ROOT = Path(__file__).parents[2]
COUNT = 300  # enough to kill it midway (progress is printed every 100); a few hundred at most
NAMES = [f"models/r{i:04d}" for i in range(COUNT)]


def rewrap_command(config: Path, target: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "broker.cli",
        "keys",
        "rewrap",
        "--to",
        target,
        "--config",
        str(config),
    ]


def allow_all_names(workdir: Path) -> None:
    data_path = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_path.read_text())
    data["images"] = {name: [ALLOWED] for name in NAMES}
    data_path.write_text(json.dumps(data))


async def originals(config: Path) -> dict[str, bytes]:
    settings = await asyncio.to_thread(load_settings, config, {})
    deks: dict[str, bytes] = {}
    async with open_key_service(settings.keys, create_missing_kek=True) as keys:
        now = datetime.now(UTC)
        for name in NAMES:
            record = await keys.create(name, Purpose.MODEL_WEIGHTS, now=now)
            deks[name] = await keys.unwrap(record)
    return deks


def key_records(log: Path) -> list[dict[str, Any]]:
    """The ``key_admin`` records in the decision log after the keys were made."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if r["type"] == "key_admin" and r["action"] != "create"]


def kill_midway(config: Path, target: str) -> None:
    """Start the rewrap, wait until it has moved at least 100 DEKs, SIGKILL it."""
    process = subprocess.Popen(
        rewrap_command(config, target),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=os.environ.copy(),
    )
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("rewrapped 100"):
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    process.stderr.close()
    assert process.returncode == -signal.SIGKILL


@pytest.mark.timeout(600)
async def test_rewrap_killed_midway_then_finished_then_every_key_released(
    tmp_path: Path, softhsm: str, start_broker: Any
) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    await asyncio.to_thread(allow_all_names, tmp_path / "b")
    deks = await originals(config)

    await asyncio.to_thread(kill_midway, config, softhsm)
    # Every DEK is still decryptable, each under the KEK its record names.
    settings = await asyncio.to_thread(load_settings, config, {})
    async with open_key_service(settings.keys, kek_uri=softhsm) as keys:
        records = await keys.list_versions()
        moved = sum(1 for r in records if r.kek_ref.startswith("pkcs11:"))
        assert 100 <= moved < COUNT
        for record in records:
            assert await keys.unwrap(record) == deks[record.name]
    # the moves the kill cut short were recorded before the first one; no outcome: unknown,
    # the store says (every DEK under the KEK its record names)
    killed = await asyncio.to_thread(key_records, settings.audit.log)
    assert [(r["action"], r.get("result")) for r in killed] == [("rewrap-start", None)]

    finished = await asyncio.to_thread(run, *rewrap_command(config, softhsm)[3:])
    assert finished.returncode == 0, finished.stderr
    report = json.loads(finished.stdout)
    assert report["rewrapped"] == COUNT - moved
    assert report["already_current"] == moved
    logged = await asyncio.to_thread(key_records, settings.audit.log)
    assert [r["action"] for r in logged] == ["rewrap-start", "rewrap-start", "rewrap"]
    assert unanswered(logged) == logged[:1]  # the killed run's intent stands alone
    closing = logged[2]
    assert (closing["result"], closing["intent"]) == ("ok", logged[1]["index"])
    assert (closing["rewrapped"], closing["lost"]) == (COUNT - moved, 0)

    # A broker that knows only the HSM KEK releases every key, unchanged.
    broker: RunningBroker = await start_broker(
        environ={"BROKER_KEYS_KEK": softhsm, "BROKER_KEYS_DEK_CACHE_SECONDS": "0"},
        reuse=(config, issuer),
    )
    released: dict[str, bytes] = {}
    async with broker.client() as client:
        queue = list(NAMES)

        async def worker() -> None:
            while queue:
                name = queue.pop()
                released[name] = (
                    await client.release(name, broker.token_source(), key_type="X25519")
                ).dek

        await asyncio.gather(*(worker() for _ in range(16)))
    assert released == deks
