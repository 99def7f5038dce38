"""A sealed broker makes its own keys inside the TEE (issue 29, item 2; ``api/sealed_keys.py``).

A real ``broker serve --workers 2`` with ``[sealed] launcher_socket`` on ``broker dev launcher``
and no key file from the operator: it makes a TLS key (self-signed certificate) each start and
the statement, checkpoint and result keys once, sealed by the KEK in ``sealed-keys.json``. What
the tests show:

* the SDK trusts the self-signed certificate only through the attestation
  (``tls_trust="attestation"``) and releases a key over it; a CA-trusting client cannot connect;
* after a restart the TLS key is new, the sealed keys are the same (the log keeps its key), and
  the private directory of the previous run is gone;
* the sealed file holds no key in the clear, and a file the KEK does not open stops start-up;
* operator key files are refused while ``make_keys`` is on; two replicas making the file at once
  end with one set of keys.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from broker.api.sealed_keys import make_sealed_keys, sealed_key_file
from broker.client import BrokerClient, BrokerClientError, BrokerIdentity
from broker.config import Settings, load_settings
from broker.core.errors import ConfigError
from broker.dev.issuer import ISSUER_FILE, DevIssuer, DevTokenSource, Workload
from broker.keys.kek.local import create_kek_file
from tests.integration.conftest import create_test_keys, write_config
from tests.integration.test_broker_attestation import socket_dir, start_launcher
from tests.support.cli import run
from tests.support.constants import ALLOWED, AUDIENCE, KEY
from tests.support.issuers import dev_issuer
from tests.support.processes import ROOT, free_port, wait_ready

__all__ = ["socket_dir"]  # the fixture this module uses
pytestmark = pytest.mark.timeout(240)
OPERATOR_KEYS = ('tls_cert = "tls/server.pem"', 'tls_key = "tls/server.key"', "signing_key = ")


@dataclass
class Made:
    config: Path
    issuer: DevIssuer
    socket: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def identity(self, tls_trust: str = "attestation") -> BrokerIdentity:
        return BrokerIdentity(
            image_digests=frozenset({ALLOWED}),
            jwks=json.dumps(self.issuer.jwks()),
            audience=AUDIENCE,
            issuer=self.issuer.issuer,
            tls_trust=tls_trust,
        )

    def token_source(self) -> DevTokenSource:
        return DevTokenSource(
            self.issuer, Workload(image_digest=ALLOWED), lambda: datetime.now(UTC)
        )


def unverified() -> ssl.SSLContext:
    """Only to wait for ``/readyz``: the certificate is self-signed, trusted by attestation."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def sealed_config(workdir: Path, issuer: DevIssuer, socket_path: Path) -> Path:
    """A development workspace without the operator's TLS and checkpoint key files, sealed."""
    config = write_config(workdir, issuer)
    issuer.save(workdir / ISSUER_FILE)
    asyncio.run(create_test_keys(load_settings(config, {})))
    lines = [
        line
        for line in config.read_text().splitlines()
        if not line.strip().startswith(OPERATOR_KEYS)
    ]
    lines += [
        "",
        "[attest]",
        "enabled = true",
        "",
        "[sealed]",
        f'launcher_socket = "{socket_path}"',
    ]
    config.write_text("\n".join(lines) + "\n")
    return config


def serve(made: Made, *, workers: int = 2, port: int | None = None) -> subprocess.Popen[bytes]:
    made.port = port or free_port()
    environ = {
        **os.environ,
        "BROKER_SERVER_WORKERS": str(workers),
        "BROKER_SERVER_LISTEN": f"127.0.0.1:{made.port}",
        "BROKER_SERVER_PUBLIC_URLS": f"{AUDIENCE},{made.url}",
    }
    command = [sys.executable, "-m", "broker.cli", "serve", "--config", str(made.config)]
    made.process = subprocess.Popen(
        command, env=environ, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_ready(made.port, unverified())
    except BaseException:
        made.process.kill()
        made.process.wait(30)
        raise
    return made.process


def stop(made: Made) -> None:
    assert made.process is not None
    made.process.send_signal(signal.SIGTERM)
    made.process.wait(60)


def private_directories() -> set[Path]:
    return set(Path("/dev/shm").glob("broker-sealed-*"))


@pytest.fixture
def made(tmp_path: Path, socket_dir: Path) -> Iterator[Made]:
    issuer = dev_issuer()
    workdir = tmp_path / "broker"
    socket_path = socket_dir / "launcher.sock"
    made = Made(sealed_config(workdir, issuer, socket_path), issuer, socket_path)
    launcher = start_launcher(workdir, socket_path, 3600)
    try:
        yield made
    finally:
        if made.process is not None and made.process.poll() is None:
            stop(made)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)


async def attested_keys(made: Made) -> dict[str, bytes]:
    async with BrokerClient(made.url, broker_identity=made.identity()) as client:
        verified = await client.verify_broker()
        released = await client.release(KEY, made.token_source())
    assert len(released.dek) == 32
    return dict(verified.keys)


def test_made_keys_are_attested_and_survive_a_restart_except_tls(made: Made) -> None:
    before = private_directories()
    supervisor = serve(made).pid
    first = asyncio.run(attested_keys(made))
    assert set(first) == {"tls", "statement", "checkpoint", "result"}
    # this broker's only (another suite on the machine may run sealed brokers meanwhile)
    ours = f"broker-sealed-{supervisor}-"
    running = {d for d in private_directories() - before if d.name.startswith(ours)}
    assert len(running) == 1  # one directory for the supervisor and both workers
    (directory,) = running
    assert directory.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in directory.iterdir())
    stop(made)
    assert not directory.exists()  # removed when the broker stopped
    assert not {d for d in private_directories() if d.name.startswith(ours)}

    sealed = sealed_key_file(load_settings(made.config, {}))
    text = sealed.read_text()
    assert "PRIVATE KEY" not in text
    assert set(json.loads(text)["keys"]) == {
        "statement",
        "checkpoint",
        "result",
    }

    serve(made)
    second = asyncio.run(attested_keys(made))
    assert second["tls"] != first["tls"]  # a new TLS key each start
    for role in ("statement", "checkpoint", "result"):
        assert second[role] == first[role], role  # unsealed, not remade


def test_a_client_follows_its_broker_through_a_restart_by_attesting_again(made: Made) -> None:
    """A restart makes a new TLS key: a long-lived client's pin no longer matches; it attests
    again (once, before re-sending: the mismatch is found in the handshake) and carries on."""

    async def across_a_restart() -> tuple[bytes, bytes]:
        async with BrokerClient(made.url, broker_identity=made.identity()) as client:
            before = (await client.verify_broker()).keys["tls"]
            await client.challenge()
            await asyncio.to_thread(stop, made)
            await asyncio.to_thread(serve, made, workers=1, port=made.port)
            await client.challenge()  # a new certificate: attested again, then sent
            after = (await client.verify_broker()).keys["tls"]
        return before, after

    serve(made, workers=1)
    before, after = asyncio.run(across_a_restart())
    assert before != after


def test_owners_and_auditors_check_the_self_signed_broker_by_attestation(
    made: Made, tmp_path: Path
) -> None:
    """``broker verify broker`` and ``broker audit monitor`` with ``--tls-trust attestation``
    pass (the monitor's log key is the attested checkpoint key); without it they refuse."""
    serve(made, workers=1)
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(made.issuer.jwks()))
    anchors = ["--jwks", str(jwks), "--audience", AUDIENCE, "--issuer", made.issuer.issuer]
    verify = ["verify", "broker", made.url, "--image", ALLOWED, *anchors]
    ran = run(*verify, "--tls-trust", "attestation")
    assert ran.returncode == 0, ran.stderr
    assert set(json.loads(ran.stdout)["keys"]) == {"tls", "statement", "checkpoint", "result"}
    assert run(*verify).returncode != 0  # a CA check: the certificate is the TEE's own
    pins = [f"--broker-{flag[2:]}" if flag.startswith("--") else flag for flag in anchors]
    monitor = ["audit", "monitor", made.url, "--state", str(tmp_path / "monitor.json")]
    monitor += ["--broker-image", ALLOWED, *pins, "--broker-tls-trust", "attestation"]
    ran = run(*monitor)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[-1])["broker"]["log_key"] == "attested"


def test_a_client_trusting_a_ca_cannot_reach_the_self_signed_broker(made: Made) -> None:
    serve(made, workers=1)
    ca = ssl.create_default_context(cafile=str(made.config.parent / "tls" / "ca.pem"))

    async def through_ca() -> None:
        async with BrokerClient(
            made.url, ssl_context=ca, broker_identity=made.identity("ca")
        ) as client:
            await client.challenge()

    with pytest.raises(BrokerClientError):
        asyncio.run(through_ca())


def test_a_sealed_file_the_kek_does_not_open_stops_start_up(made: Made) -> None:
    settings = load_settings(made.config, {})
    asyncio.run(make_sealed_keys(settings, now=datetime.now(UTC))).discard()  # makes the file
    sealed = sealed_key_file(settings)  # the operator puts a key of their own in, wrapped
    document = json.loads(sealed.read_text())  # under the right KEK name (they cannot wrap)
    document["keys"]["checkpoint"]["wrapped"] = base64.b64encode(os.urandom(80)).decode()
    sealed.write_text(json.dumps(document))
    ran = subprocess.run(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(made.config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 2, ran.stderr
    assert "sealed.key_file" in ran.stderr
    assert "did not open" in ran.stderr
    assert "Traceback" not in ran.stderr


def test_operator_key_files_are_refused_while_the_broker_makes_its_keys(made: Made) -> None:
    identity = {
        "BROKER_IDENTITY_ENABLED": "true",
        "BROKER_IDENTITY_TRUST_DOMAIN": "runners.it.invalid",
        "BROKER_IDENTITY_CA_CERTIFICATES": "identity/ca-chain.pem",
    }
    for name, value, more in (
        ("BROKER_SERVER_TLS_CERT", "tls/server.pem", {}),
        ("BROKER_AUDIT_SIGNING_KEY", "log-ed25519.pem", {}),
        ("BROKER_IDENTITY_CA_KEY", "identity/ca.key", identity),  # mints any SPIFFE ID
    ):
        with pytest.raises(ConfigError) as caught:
            load_settings(made.config, {name: value, **more})
        assert "makes its own keys" in caught.value.message
        assert caught.value.key == name.removeprefix("BROKER_").lower().replace("_", ".", 1)


def test_two_replicas_making_the_file_at_once_share_one_set_of_keys(made: Made) -> None:
    """Two processes' worth of start-ups on one file (threads, each its own event loop): the
    file is completed under a lock, so both get the same keys."""
    settings = load_settings(made.config, {})

    def start_up() -> bytes:
        result = asyncio.run(make_sealed_keys(settings, now=datetime.now(UTC)))
        try:
            assert result.settings.keys.signing_key is not None
            key = serialization.load_pem_private_key(
                result.settings.keys.signing_key.read_bytes(), None
            )
            return key.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        finally:
            result.discard()

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: start_up(), range(2))
    assert first == second


def made_public(settings: Settings, role: str) -> bytes:
    """The public key (SPKI DER) of ``role`` as a start-up makes or unseals it."""
    result = asyncio.run(make_sealed_keys(settings, now=datetime.now(UTC)))
    try:
        path = {
            "statement": result.settings.keys.signing_key,
            "checkpoint": result.settings.audit.signing_key,
            "result": result.settings.attest.signing_key,
        }[role]
        assert path is not None
        key = serialization.load_pem_private_key(Path(path).read_bytes(), None)
        return key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    finally:
        result.discard()


def test_a_role_turned_on_later_is_added_and_the_others_kept(made: Made) -> None:
    """[attest] off at the first start, on at the next: the result key is made and sealed in,
    the checkpoint key stays the same (the log keeps its key)."""
    without = load_settings(made.config, {"BROKER_ATTEST_ENABLED": "false"})
    checkpoint = made_public(without, "checkpoint")
    assert set(json.loads(sealed_key_file(without).read_text())["keys"]) == {
        "statement",
        "checkpoint",
    }
    with_attest = load_settings(made.config, {})
    assert made_public(with_attest, "checkpoint") == checkpoint
    result = made_public(with_attest, "result")
    assert made_public(with_attest, "result") == result
    assert "result" in json.loads(sealed_key_file(with_attest).read_text())["keys"]


def test_keys_sealed_under_a_previous_kek_are_refused(made: Made, tmp_path: Path) -> None:
    """A ``kek_previous`` may be one the operator can use (an old file or KMS key): a file
    sealed under it would hand the broker keys the operator made. Only [keys] kek opens it."""
    settings = load_settings(made.config, {})
    asyncio.run(make_sealed_keys(settings, now=datetime.now(UTC))).discard()  # under kek A
    new = tmp_path / "new-kek.key"
    create_kek_file(new)
    rotated = load_settings(
        made.config,
        {"BROKER_KEYS_KEK": f"local:{new}", "BROKER_KEYS_KEK_PREVIOUS": settings.keys.kek},
    )
    with pytest.raises(ConfigError) as caught:
        asyncio.run(make_sealed_keys(rotated, now=datetime.now(UTC)))
    assert "not [keys] kek" in caught.value.message
