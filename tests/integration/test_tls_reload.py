"""SIGHUP reloads the TLS certificate (issue 28, item 5), in one process and with two workers.

The operator replaces ``tls/server.pem`` and ``server.key`` (cert-manager, a renewed Let's
Encrypt pair) and sends SIGHUP: new connections get the new certificate, whichever worker answers.
A pair whose key does not match its certificate is refused and the old certificate keeps serving.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography import x509

from broker.dev.tls import make_dev_tls
from tests.integration.conftest import write_config
from tests.support.issuers import dev_issuer
from tests.support.processes import ROOT, create_key_with_cli, free_port, wait_ready

pytestmark = pytest.mark.timeout(240)


def _served_serial(port: int) -> int:
    """The serial of the certificate a new connection gets (no verification: we compare)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _serial_of(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def _until_all_serve(port: int, serial: int) -> None:
    """Every connection, over several (two workers: both), gets ``serial``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = {_served_serial(port) for _ in range(12)}
        if seen == {serial}:
            return
        time.sleep(0.2)
    pytest.fail(f"certificate {serial} was not served by every connection")


def _replace(source: Path, target: Path) -> None:
    staged = target.with_suffix(".new")
    shutil.copyfile(source, staged)
    os.chmod(staged, 0o600)
    os.replace(staged, target)


@pytest.mark.parametrize("workers", [1, 2], ids=["process", "workers"])
def test_sighup_reloads_the_tls_certificate(tmp_path: Path, workers: int) -> None:
    config = write_config(tmp_path / "b", dev_issuer())
    create_key_with_cli(config)
    tls_dir = tmp_path / "b" / "tls"
    port = free_port()
    broker = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config)],
        cwd=ROOT,
        env={
            **os.environ,
            "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
            "BROKER_SERVER_WORKERS": str(workers),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
        wait_ready(port, client)
        old = _serial_of(tls_dir / "server.pem")
        _until_all_serve(port, old)

        renewed = make_dev_tls(tmp_path / "renewed", now=datetime.now(UTC))
        mismatched = make_dev_tls(tmp_path / "mismatched", now=datetime.now(UTC))
        # A certificate whose key is another pair's: refused, the old pair keeps serving.
        _replace(renewed.server_cert, tls_dir / "server.pem")
        _replace(mismatched.server_key, tls_dir / "server.key")
        broker.send_signal(signal.SIGHUP)
        time.sleep(2)
        _until_all_serve(port, old)

        _replace(renewed.server_key, tls_dir / "server.key")
        broker.send_signal(signal.SIGHUP)
        _until_all_serve(port, _serial_of(renewed.server_cert))
    finally:
        broker.send_signal(signal.SIGTERM)
        _, err = broker.communicate(timeout=60)
    assert broker.returncode == 0
    assert "not reloaded (the old one keeps serving)" in err
    assert "Traceback" not in err
