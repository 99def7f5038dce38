"""``broker serve --workers 2``: two processes on one port (SO_REUSEPORT) under a supervisor.

Checked for real, with the processes the command starts: both workers take connections on the
one port; a nonce is used exactly once across them (the SQLite nonce store is the default with
workers > 1); a killed worker is restarted while the other keeps serving; SIGTERM stops every
process with exit code 0; the shared decision log stays one intact chain.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from broker.config import load_settings
from broker.core.errors import ConfigError
from tests.integration.conftest import write_config
from tests.support.cli import run
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    ROOT,
    create_key_with_cli,
    free_port,
    release_body,
    wait_ready,
)

pytestmark = pytest.mark.timeout(240)


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def wait_for(predicate: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    pytest.fail("condition not reached in time")


def test_workers_need_a_shared_nonce_store(tmp_path: Path) -> None:
    config = write_config(tmp_path / "b", dev_issuer())
    settings = load_settings(config, {"BROKER_SERVER_WORKERS": "2"})
    assert settings.nonces.store == f"sqlite://{tmp_path / 'b' / 'nonces.db'}"
    with pytest.raises(ConfigError, match=r"nonces\.store"):
        load_settings(config, {"BROKER_SERVER_WORKERS": "2", "BROKER_NONCES_STORE": "memory"})
    with pytest.raises(ConfigError, match=r"server\.workers"):
        load_settings(config, {"BROKER_SERVER_WORKERS": "0"})


async def test_two_workers_share_a_port_restart_and_stop_cleanly(tmp_path: Path) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    await asyncio.to_thread(create_key_with_cli, config)
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    port = free_port()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config), "--workers", "2"],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        await wait_for(lambda: len(children(supervisor.pid)) == 2)
        workers = children(supervisor.pid)
        before = {pid: cpu_ticks(pid) for pid in workers}

        connector = aiohttp.TCPConnector(limit=64, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            body = await release_body(session, url, tls, issuer)

            async def attempt() -> tuple[int, str]:
                async with session.post(url + "/v1/release", json=body, ssl=tls) as response:
                    payload = await response.json()
                    return response.status, payload.get("error", {}).get("code", "ok")

            results = await asyncio.gather(*(attempt() for _ in range(200)))
            assert [status for status, _ in results].count(200) == 1
            assert {code for status, code in results if status != 200} == {"nonce_reused"}
            assert all(cpu_ticks(pid) > before[pid] for pid in workers)  # both took requests

            # A worker dies: the other keeps serving, the supervisor starts a new one.
            os.kill(workers[0], signal.SIGKILL)
            # Connections already queued on the dead worker's socket are reset (clients retry);
            # once it is gone, and before its replacement starts (1 s back-off), one serves all.
            await wait_for(lambda: workers[0] not in children(supervisor.pid))
            assert len(children(supervisor.pid)) == 1
            body = await release_body(session, url, tls, issuer)
            async with session.post(url + "/v1/release", json=body, ssl=tls) as response:
                assert response.status == 200, await response.text()
            await wait_for(
                lambda: (
                    len(children(supervisor.pid)) == 2
                    and workers[0] not in children(supervisor.pid)
                )
            )
            await asyncio.to_thread(wait_ready, port, tls)
            bodies = [await release_body(session, url, tls, issuer) for _ in range(20)]

            async def release(one: dict[str, object]) -> int:
                async with session.post(url + "/v1/release", json=one, ssl=tls) as response:
                    return response.status

            assert set(await asyncio.gather(*(release(b) for b in bodies))) == {200}
        final = children(supervisor.pid)
    finally:
        supervisor.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(supervisor.communicate, timeout=60)
    assert supervisor.returncode == 0, stderr[-3000:]
    assert "worker 0 exited" in stderr or "exited (-9)" in stderr
    assert not any(Path(f"/proc/{pid}").exists() for pid in final)  # no worker outlives it

    log = tmp_path / "b" / "decisions.log"
    verify = await asyncio.to_thread(
        run,
        *("audit", "verify", str(log)),
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    releases = [r for r in records if r.get("type") == "release"]
    assert sum(r["result"] == "allow" for r in releases) == 22
    assert len(releases) == 221  # every decision of both workers, in one chain
    # Three workers started (two, then a replacement) with one policy: one start-up record,
    # decided under the log's lock.
    changes = [r for r in records if r.get("type") == "policy_change"]
    assert [(c["trigger"], c["old_digest"]) for c in changes] == [("startup", None)]


async def test_supervisor_says_serving_only_when_every_worker_accepts(tmp_path: Path) -> None:
    """It used to print "N workers serving" 10-15 s before any worker took a connection."""
    config = await asyncio.to_thread(write_config, tmp_path / "b", dev_issuer())
    await asyncio.to_thread(create_key_with_cli, config)
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    port = free_port()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config), "--workers", "2"],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert supervisor.stderr is not None
        while "workers serving" not in (
            line := await asyncio.to_thread(supervisor.stderr.readline)
        ):
            assert line, "the supervisor ended without saying it serves"
        workers = set()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for _ in range(20):  # at once, and from every worker
                async with s.get(f"https://127.0.0.1:{port}/healthz", ssl=tls) as response:
                    workers.add((await response.json())["worker"])
        assert workers == {0, 1}
    finally:
        supervisor.send_signal(signal.SIGTERM)
        await asyncio.to_thread(supervisor.communicate, timeout=60)
    assert supervisor.returncode == 0


async def test_a_worker_that_cannot_start_is_named_with_its_error(tmp_path: Path) -> None:
    config = await asyncio.to_thread(write_config, tmp_path / "b", dev_issuer())
    await asyncio.to_thread(create_key_with_cli, config)
    (tmp_path / "b" / "policies" / "broker" / "release.rego").write_text(
        "package broker.release\nallow if {\n"
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config), "--workers", "2"],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{free_port()}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        assert supervisor.stderr is not None
        while "before serving" not in (line := await asyncio.to_thread(supervisor.stderr.readline)):
            assert line, "".join(lines)
            lines.append(line)
    finally:
        supervisor.send_signal(signal.SIGTERM)
        await asyncio.to_thread(supervisor.communicate, timeout=60)
    assert "exited with 2 before serving" in line
    assert any("rego_parse_error" in earlier for earlier in lines)  # the worker's own error
    assert not any("workers serving" in earlier for earlier in lines)
