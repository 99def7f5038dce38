"""Helpers for tests that run the broker as operators do: ``broker`` subprocesses (serve, keys
create), waiting for them, free loopback ports, and well-formed release requests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.client.unwrap import new_ephemeral_key
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY

ROOT = Path(__file__).parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(ready: Callable[[], bool], *, what: str, tries: int = 200) -> None:
    """Poll ``ready`` every 50 ms (False or an OSError: not yet) until it holds, or fail the
    test saying that ``what`` did not start."""
    for _ in range(tries):
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.05)
    pytest.fail(f"{what} did not start")


def wait_ready(port: int, tls: ssl.SSLContext) -> None:
    """Until ``/readyz`` on ``port`` answers 200 (a broker started in another process)."""
    for _ in range(300):
        try:
            with urllib.request.urlopen(
                f"https://127.0.0.1:{port}/readyz", context=tls, timeout=2
            ) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"the broker on port {port} did not become ready")


async def release_body(
    session: aiohttp.ClientSession, url: str, tls: ssl.SSLContext, issuer: DevIssuer
) -> dict[str, Any]:
    """A well-formed release request whose token binds a nonce ``url`` issued."""
    async with session.post(url + "/v1/challenge", json={}, ssl=tls) as response:
        assert response.status == 200
        challenge = await response.json()
    jwk = public_jwk(new_ephemeral_key().public_key())
    source = DevTokenSource(issuer, Workload(image_digest=ALLOWED), lambda: datetime.now(UTC))
    token = await source.token(challenge["audience"], [challenge["nonce"], thumbprint(jwk)])
    return {"key": KEY, "nonce": challenge["nonce"], "evidence": {"gca": token}, "runner_key": jwk}


def create_key_with_cli(config: Path, environ: dict[str, str] | None = None) -> None:
    """``broker keys create KEY`` as an operator runs it (in process: ``tests/support/cli.py``)."""
    created = run(
        "keys", "create", KEY, "--purpose", "model-weights", "--config", str(config), env=environ
    )
    assert created.returncode == 0, created.stderr


def serve(
    config: Path, port: int, log: Path, store: str, extra: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
        "BROKER_AUDIT_LOG": str(log),
        "BROKER_NONCES_STORE": store,
        **(extra or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def stop_replicas(replicas: list[subprocess.Popen[str]]) -> None:
    """SIGTERM to every replica, then each must exit cleanly (its stderr shown if not)."""
    for process in replicas:
        process.send_signal(signal.SIGTERM)
    for process in replicas:
        _, stderr = await asyncio.to_thread(process.communicate, timeout=30)
        assert process.returncode == 0, stderr[-2000:]


FAKE_GCS = ROOT / ".venv" / "bin" / "fake-gcs-server"


@contextlib.contextmanager
def fake_gcs_server(seed: Path) -> Iterator[int]:
    """fake-gcs-server on 127.0.0.1 serving ``seed`` (a directory per bucket); its port."""
    if not FAKE_GCS.exists():
        pytest.fail("fake-gcs-server is missing: `make test` builds it")
    port = free_port()
    process = subprocess.Popen(
        [
            *(str(FAKE_GCS), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)),
            *("-backend", "memory", "-data", str(seed), "-log-level", "error"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def accepts() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True

    try:
        wait_until(accepts, what="fake-gcs-server")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
