"""One supervisor per broker, and no worker without its supervisor (issue 28, item 2).

Run as an operator runs it: ``broker serve --workers 2`` subprocesses. A second supervisor on the
same log or the same port is refused while the first keeps serving; after ``kill -9`` of the
supervisor its workers stop (nothing serves the port any more: an orphan would serve a policy no
reload reaches); ``--worker`` (one letter from ``--workers``) is a usage error, not a hidden mode;
the worker variables set by hand do not turn a process into a worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import write_config
from tests.support.cli import run
from tests.support.issuers import dev_issuer
from tests.support.processes import ROOT, create_key_with_cli, free_port

pytestmark = pytest.mark.timeout(240)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie no longer serves


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


async def _until(predicate: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"{what} did not happen in {timeout:.0f} s")


def _supervisor(config: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config), "--workers", "2"],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def _until_serving(process: subprocess.Popen[str]) -> None:
    assert process.stderr is not None
    while "workers serving" not in (line := await asyncio.to_thread(process.stderr.readline)):
        assert line, "the supervisor ended without saying it serves"


async def test_killed_supervisor_leaves_no_orphan_worker_serving(tmp_path: Path) -> None:
    config = await asyncio.to_thread(write_config, tmp_path / "b", dev_issuer())
    await asyncio.to_thread(create_key_with_cli, config)
    port = free_port()
    supervisor = _supervisor(config, port)
    try:
        await _until_serving(supervisor)
        workers = _children(supervisor.pid)
        assert len(workers) == 2
        assert _accepts(port)
        supervisor.kill()  # SIGKILL: no chance to stop its workers itself
        await asyncio.to_thread(supervisor.wait, 30)
        await _until(lambda: not any(_alive(pid) for pid in workers), "the workers' exit")
        assert not _accepts(port)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        await asyncio.to_thread(supervisor.communicate, timeout=60)


async def test_second_supervisor_on_the_same_log_or_port_is_refused(tmp_path: Path) -> None:
    config = await asyncio.to_thread(write_config, tmp_path / "b", dev_issuer())
    other = await asyncio.to_thread(write_config, tmp_path / "c", dev_issuer())
    await asyncio.to_thread(create_key_with_cli, config)
    port = free_port()
    first = _supervisor(config, port)
    try:
        await _until_serving(first)
        same_log = _supervisor(config, free_port())
        _, same_log_err = await asyncio.to_thread(same_log.communicate, timeout=60)
        assert same_log.returncode == 2
        assert f"another broker supervisor (pid {first.pid})" in same_log_err
        same_port = _supervisor(other, port)
        _, same_port_err = await asyncio.to_thread(same_port.communicate, timeout=60)
        assert same_port.returncode == 2
        assert f"127.0.0.1:{port} is already served" in same_port_err
        assert "Traceback" not in same_log_err + same_port_err
        assert first.poll() is None
        assert len(_children(first.pid)) == 2
    finally:
        first.send_signal(signal.SIGTERM)
        await asyncio.to_thread(first.communicate, timeout=60)
    assert first.returncode == 0


def test_worker_flag_typo_is_a_usage_error(tmp_path: Path) -> None:
    config = write_config(tmp_path / "b", dev_issuer())
    result = run("serve", "--config", str(config), "--worker")
    assert result.returncode == 2
    assert "expected one argument" in result.stderr


def test_worker_variables_set_by_hand_are_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path / "b", dev_issuer())
    result = subprocess.run(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config)],
        cwd=ROOT,
        env={**os.environ, "BROKER_SUPERVISOR_FD": "0", "BROKER_SUPERVISOR_PID": "1"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "BROKER_SUPERVISOR_FD: is set only by `broker serve --workers N`" in result.stderr


async def test_sighup_while_workers_start_kills_no_worker(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process: a reload (or a certificate rotation) sent while a
    worker was still starting killed it ("worker 0 exited with -1"); now it is held until the
    worker serves, then delivered."""
    config = await asyncio.to_thread(write_config, tmp_path / "b", dev_issuer())
    await asyncio.to_thread(create_key_with_cli, config)
    supervisor = _supervisor(config, free_port())
    assert supervisor.stderr is not None
    try:
        await _until(lambda: len(_children(supervisor.pid)) == 2, "the workers' start")
        started = set(_children(supervisor.pid))
        reader = asyncio.create_task(_until_serving(supervisor))
        while not reader.done():  # SIGHUPs all through the workers' start-up
            supervisor.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.05)
        await reader
        assert set(_children(supervisor.pid)) == started  # none died and was replaced
    finally:
        supervisor.send_signal(signal.SIGTERM)
        _, rest = await asyncio.to_thread(supervisor.communicate, timeout=60)
    assert supervisor.returncode == 0
    assert "exited with" not in rest
