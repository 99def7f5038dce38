"""The broker attests itself (issue 29, item 2): ``GET /.well-known/broker-attestation``.

A real ``broker serve`` (one process and ``--workers 2``) with ``[sealed] launcher_socket``
pointed at ``broker dev launcher`` (a real Unix-socket server speaking the Confidential Space
launcher's ``POST /v1/token``) publishes a token that verifies against the development issuer's
JWKS and whose ``eat_nonce`` binds the SHA-256 of the TLS key it actually serves with and of
each other key it lists. What stops a broker that is not what it says:

* ``test_served_tls_key_is_bound_by_token``: a client can tie the TLS connection to the token;
* ``test_unreachable_launcher_refuses_start``: a broker configured sealed never serves unsealed;
* ``test_token_renewed_then_expired_token_not_served``: a stale token is not passed off as fresh.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.config import load_settings
from broker.core.encoding import b64url_decode
from broker.dev.issuer import ISSUER_FILE, DevIssuer
from broker.dev.workspace import write_private_pem
from tests.integration.conftest import (
    RunningBroker,
    create_test_keys,
    serve_workers,
    write_config,
)
from tests.support.constants import ALLOWED, AUDIENCE
from tests.support.issuers import dev_issuer
from tests.support.processes import ROOT, wait_until

PATH = "/.well-known/broker-attestation"
pytestmark = pytest.mark.timeout(240)


@dataclass
class Sealed:
    url: str
    workdir: Path
    issuer: DevIssuer
    client_tls: ssl.SSLContext
    port: int
    launcher: subprocess.Popen[bytes]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (a socket path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="s-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_launcher(workdir: Path, socket_path: Path, lifetime: int) -> subprocess.Popen[bytes]:
    """``broker dev launcher`` on ``socket_path``, once it accepts connections."""
    command = [sys.executable, "-m", "broker.cli", "dev", "launcher", "--workspace", str(workdir)]
    process = subprocess.Popen(
        [*command, "--socket", str(socket_path), "--image", ALLOWED, "--lifetime", str(lifetime)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def accepts() -> bool:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(socket_path))
        return True

    wait_until(accepts, what="the development launcher", tries=600)
    return process


def sealed_environ(workdir: Path, socket_path: Path, workers: int) -> dict[str, str]:
    """Every key bound: TLS, statement, checkpoint (the workspace's) and result keys."""
    statement = write_private_pem(
        workdir / "statement.pem", ec.generate_private_key(ec.SECP256R1())
    )
    result = write_private_pem(workdir / "result.pem", ec.generate_private_key(ec.SECP256R1()))
    return {
        "BROKER_SERVER_WORKERS": str(workers),
        "BROKER_SEALED_LAUNCHER_SOCKET": str(socket_path),
        "BROKER_SEALED_MAKE_KEYS": "false",  # the operator's keys (test_sealed_keys: made ones)
        "BROKER_KEYS_SIGNING_KEY": str(statement),
        "BROKER_ATTEST_ENABLED": "true",
        "BROKER_ATTEST_SIGNING_KEY": str(result),
    }


@pytest.fixture
def sealed_broker(
    request: pytest.FixtureRequest, tmp_path: Path, socket_dir: Path
) -> Iterator[Sealed]:
    """A sealed broker and its launcher; ``request.param``: (the broker's workers, the
    lifetime of the launcher's tokens in seconds)."""
    workers, lifetime = getattr(request, "param", (1, 3600))
    issuer = dev_issuer()
    workdir = tmp_path / "broker"
    config = write_config(workdir, issuer)
    issuer.save(workdir / ISSUER_FILE)
    asyncio.run(create_test_keys(load_settings(config, {})))
    launcher = start_launcher(workdir, socket_dir / "launcher.sock", lifetime)
    client_tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    try:
        environ = sealed_environ(workdir, socket_dir / "launcher.sock", workers)
        broker, port = serve_workers(config, environ, client_tls)
        try:
            yield Sealed(f"https://127.0.0.1:{port}", workdir, issuer, client_tls, port, launcher)
        finally:
            broker.send_signal(signal.SIGTERM)
            broker.wait(60)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)


def fetch(broker: Sealed) -> dict[str, Any]:
    """The endpoint's document, on a new connection each time (each may reach another worker)."""
    with urllib.request.urlopen(broker.url + PATH, context=broker.client_tls, timeout=10) as answer:
        assert answer.status == 200
        document: dict[str, Any] = json.loads(answer.read())
        return document


def served_tls_spki(broker: Sealed) -> bytes:
    """The SPKI DER of the certificate the broker's TLS handshake presents."""
    with (
        socket.create_connection(("127.0.0.1", broker.port), timeout=10) as raw,
        broker.client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return (
        x509.load_der_x509_certificate(der)
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def verified_claims(broker: Sealed, document: dict[str, Any]) -> dict[str, Any]:
    """The token checked with PyJWT against the development issuer's JWKS, and bound to every
    key the document lists."""
    assert document["attested"] is True, document
    assert document["token_type"] == "OIDC"
    key = jwt.PyJWK(broker.issuer.jwks()["keys"][0])
    claims: dict[str, Any] = jwt.decode(
        document["token"], key, algorithms=["RS256"], audience=AUDIENCE, issuer=broker.issuer.issuer
    )
    assert claims["submods"]["container"]["image_digest"] == ALLOWED
    assert claims["dbgstat"] == "disabled-since-boot"
    nonces = claims["eat_nonce"]
    for role, spki in document["keys"].items():
        assert hashlib.sha256(b64url_decode(spki)).hexdigest() in nonces, role
    return claims


@pytest.mark.parametrize(
    "sealed_broker", [(1, 3600), (2, 3600)], indirect=True, ids=["process", "workers"]
)
def test_served_tls_key_is_bound_by_token(sealed_broker: Sealed) -> None:
    served = served_tls_spki(sealed_broker)
    workdir = sealed_broker.workdir
    expected = {
        "tls": served,
        "statement": _spki(workdir / "statement.pem"),
        "checkpoint": _spki(workdir / "log-ed25519.pem"),
        "result": _spki(workdir / "result.pem"),
    }
    for _ in range(12):  # with --workers 2, new connections reach both workers
        document = fetch(sealed_broker)
        claims = verified_claims(sealed_broker, document)
        assert {role: b64url_decode(v) for role, v in document["keys"].items()} == expected
        assert hashlib.sha256(served).hexdigest() in claims["eat_nonce"]
        assert document["expires"].endswith("Z")


def _spki(path: Path) -> bytes:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# 8 s: with 4 s, a suite under load 13 saw the first token expire before its first fetch
@pytest.mark.parametrize("sealed_broker", [(1, 8)], indirect=True, ids=["short-lived"])
def test_token_renewed_then_expired_token_not_served(sealed_broker: Sealed) -> None:
    first = fetch(sealed_broker)
    verified_claims(sealed_broker, first)
    renewed: list[dict[str, Any]] = []

    def token_changed() -> bool:
        document = fetch(sealed_broker)
        if document.get("token") not in (None, first["token"]):
            renewed.append(document)
        return bool(renewed)

    wait_until(token_changed, what="a renewed token", tries=600)
    verified_claims(sealed_broker, renewed[0])
    sealed_broker.launcher.send_signal(signal.SIGTERM)  # renewals now fail; the old token
    sealed_broker.launcher.wait(30)  # serves until its exp, and no longer

    def expired() -> bool:
        return fetch(sealed_broker)["attested"] is False

    wait_until(expired, what="the expired-token answer", tries=600)
    document = fetch(sealed_broker)
    assert set(document) == {"attested", "reason"}
    assert "expired" in document["reason"]

    def degraded() -> bool:
        url = sealed_broker.url + "/readyz"
        with urllib.request.urlopen(url, context=sealed_broker.client_tls, timeout=10) as answer:
            return bool(json.loads(answer.read())["status"] == "degraded")

    wait_until(degraded, what="/readyz degraded", tries=600)


def test_unreachable_launcher_refuses_start(tmp_path: Path, socket_dir: Path) -> None:
    config = write_config(tmp_path / "broker", dev_issuer())
    asyncio.run(create_test_keys(load_settings(config, {})))
    environ = {
        **os.environ,
        "BROKER_SEALED_LAUNCHER_SOCKET": str(socket_dir / "none.sock"),
        "BROKER_SEALED_MAKE_KEYS": "false",
    }
    started = subprocess.run(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert started.returncode == 2, started.stderr
    assert started.stderr.strip().splitlines() == [
        f"error: config sealed.launcher_socket: the launcher at {socket_dir / 'none.sock'} "
        "did not answer (No such file or directory)"
    ]


async def test_unsealed_broker_says_not_attested(broker: RunningBroker) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + PATH, ssl=broker.client_tls) as answer,
    ):
        assert answer.status == 200
        document = await answer.json()
    assert document == {
        "attested": False,
        "reason": "this broker is not running in a Confidential Space TEE",
    }
