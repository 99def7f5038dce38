"""Nobody can lock the runners out: an unauthenticated flood of challenges (and of garbage
releases) from other addresses while a legitimate runner keeps releasing.

Before, outstanding challenges were stored: ~830 challenges/s kept the 100k cap full and every
runner got ``503 nonce_store_full``. Now a challenge is stateless (a MAC) and stores nothing,
and the per-address limits answer the flooders ``429`` before any work is done.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from tests.integration.conftest import write_config
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    ROOT,
    create_key_with_cli,
    free_port,
    release_body,
    wait_ready,
)

pytestmark = pytest.mark.timeout(180)
FLOOD_SECONDS = 6.0
RUNNER_RELEASES = 30


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_challenge_flood_locks_no_runner_out(tmp_path: Path, workers: int) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(
        write_config,
        tmp_path / "b",
        issuer,
        rate_limit_per_ip=50,
        rate_limit_burst=50,
        max_outstanding_nonces=1000,
    )
    await asyncio.to_thread(create_key_with_cli, config)
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    port = free_port()
    broker = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config),
         "--workers", str(workers)],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    flood: Counter[int] = Counter()
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        deadline = time.monotonic() + FLOOD_SECONDS

        async def flooder(address: str, path: str, body: object) -> None:
            connector = aiohttp.TCPConnector(local_addr=(address, 0), limit=16)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one() -> None:
                    while time.monotonic() < deadline:
                        async with session.post(url + path, json=body, ssl=tls) as response:
                            flood[response.status] += 1
                            await response.read()

                await asyncio.gather(*(one() for _ in range(16)))

        garbage = {"key": "models/x", "nonce": "A" * 43, "evidence": {"gca": "x.y.z"},
                   "runner_key": {"kty": "EC"}}  # fmt: skip
        flooders = asyncio.gather(
            flooder("127.0.0.2", "/v1/challenge", {}),
            flooder("127.0.0.3", "/v1/challenge", {}),
            flooder("127.0.0.4", "/v1/release", garbage),
        )
        outcomes: Counter[int] = Counter()
        async with aiohttp.ClientSession() as runner:  # the legitimate runner, from 127.0.0.1
            await asyncio.sleep(0.5)  # the flood is on
            for _ in range(RUNNER_RELEASES):
                body = await release_body(runner, url, tls, issuer)
                async with runner.post(url + "/v1/release", json=body, ssl=tls) as response:
                    outcomes[response.status] += 1
                    await response.read()
        await flooders
    finally:
        broker.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(broker.communicate, timeout=60)
    assert broker.returncode == 0, stderr[-2000:]
    assert outcomes == Counter({200: RUNNER_RELEASES}), outcomes  # 100 % success
    assert flood[429] > flood[200], flood  # the flooders were refused, cheaply
    assert set(flood) <= {200, 401, 400, 429}, flood  # never a 5xx, never "store full"
    print(f"\nflood ({workers} worker(s)): {dict(flood)}; runner: {dict(outcomes)}")
