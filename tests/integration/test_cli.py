"""The ``broker`` command as a user runs it: real subprocesses, real files, real ports."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from broker.dev.issuer import DevIssuer
from tests.integration.conftest import write_config
from tests.unit.test_audit_log import write_log

ROOT = Path(__file__).parents[2]
BROKER = [sys.executable, "-m", "broker.cli"]


@pytest.fixture(autouse=True)
def blockbuster() -> None:
    """These tests are synchronous: they drive subprocesses, not the event loop."""


def run(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BROKER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def configured(tmp_path: Path) -> Path:
    return write_config(tmp_path / "b", DevIssuer(dev_mode=True))


def test_keys_create_and_list(tmp_path: Path) -> None:
    config = configured(tmp_path)
    created = run(
        "keys", "create", "models/a", "--purpose", "model-weights", "--config", str(config)
    )
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["version"] == 1
    again = run("keys", "create", "models/a", "--purpose", "model-weights", "--config", str(config))
    assert again.returncode == 1
    assert "key_exists" in again.stderr
    listed = run("keys", "list", "--config", str(config))
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["state"]) for r in rows] == [("models/a", "enabled")]
    assert "wrapped" not in listed.stdout


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = configured(tmp_path)
    config.write_text(
        config.read_text().replace(
            'listen = "127.0.0.1:0"', 'listen = "0.0.0.0:1"\ninsecure_http = true'
        )
    )
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "server.insecure_http" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_runs_tls_until_sigterm(tmp_path: Path) -> None:
    config = configured(tmp_path)
    port = free_port()
    assert (
        run(
            "keys", "create", "models/a", "--purpose", "generic", "--config", str(config)
        ).returncode
        == 0
    )
    process = subprocess.Popen(
        [*BROKER, "serve", "--config", str(config)],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    context = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    try:
        body = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(
                    f"https://127.0.0.1:{port}/readyz", context=context, timeout=2
                ) as r:
                    body = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.1)
        assert body is not None
        assert body["status"] == "ready"
        with pytest.raises(OSError, match=r"Connection reset|Remote end closed|EOF"):  # TLS only
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=15)
    assert process.returncode == 0


def test_audit_verify_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    asyncio.run(write_log(path, 3))
    ok = run("audit", "verify", str(path))
    assert ok.returncode == 0
    assert json.loads(ok.stdout)["records"] == 3
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[2])
    bad = run("audit", "verify", str(path))
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["first_bad_record"] == 2
    assert run("audit", "verify", str(tmp_path / "missing.log")).returncode == 2


def test_policy_test_passes_on_shipped_policy_and_fails_on_a_broken_one(tmp_path: Path) -> None:
    assert run("policy", "test", "policies").returncode == 0
    broken = tmp_path / "p"
    broken.mkdir()
    (broken / "x.rego").write_text("package x\nimport rego.v1\nallow if input.ok\n")
    (broken / "x_test.rego").write_text(
        "package x_test\nimport rego.v1\ntest_allows if data.x.allow with input as {}\n"
    )
    result = run("policy", "test", str(broken))
    assert result.returncode == 1
    assert "FAIL" in result.stdout


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    result = run("demo", "--workdir", str(tmp_path / "demo"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "denied 403 policy_denied" in result.stdout
    assert "decision log verified: 2 records (allow, deny)" in result.stdout
