"""Issue 29 item 4: a model owner encrypts weights for a sealed broker, pinned to its attestation.

``broker weights encrypt MODEL OUT --key K --url URL --token-file F --broker-image …`` makes the
DEK on the owner's machine, imports it into the broker (``POST /v1/admin/keys/import``) over the
attested, pinned connection, and encrypts with the version the broker numbered. A real sealed
``broker serve`` on ``broker dev launcher`` (with an admin token, its output captured with
``-v``) answers the real CLI, in both shapes a sealed broker is deployed in: keys it made itself
(its TLS certificate self-signed, trusted only through the attestation: ``--broker-tls-trust
attestation``, the TLS session ends in the broker's process) and the operator's keys (a CA, and
the attested key pinned). What each test shows:

* the right image: a runner releases the new version through the SDK and decrypts every file
  to the owner's bytes; the broker logged a ``key_admin`` ``import`` record (the token's name, no
  material); the DEK is in neither the broker's output nor its decision log;
* another image: exit 1, no file, no new version, no record, and the broker's own request
  counters (``/metrics``) show no ``/v1/…`` request: only the attestation was asked for;
* a wrong token: exit 1, no file, no new version;
* the import route's strict input (32 bytes of canonical base64url, a purpose that fits), its
  stable codes, and that no refusal repeats the material sent;
* plain HTTP is refused (``tls_required``) unless the broker is a loopback development broker;
* flags that do not go together are usage errors (exit 2) before any DEK is made.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import ssl
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from broker.api.server import BrokerRunner
from broker.app import create_app
from broker.client import BrokerClient, BrokerIdentity
from broker.client.unwrap import ReleasedDek
from broker.client.weights import decrypt_to
from broker.config import load_settings
from broker.core.encoding import b64url_encode
from broker.dev.issuer import ISSUER_FILE, DevTokenSource, Workload
from tests.integration.conftest import (
    create_test_keys,
    serve_workers,
    with_public_url,
    write_config,
)
from tests.integration.test_broker_attestation import sealed_environ, start_launcher
from tests.integration.test_cli_broker_pin import ATTESTATION, TOKEN, Live
from tests.integration.test_sealed_keys import sealed_config, unverified
from tests.support.cli import Ran, run
from tests.support.constants import ALLOWED, AUDIENCE, DENIED, KEY
from tests.support.issuers import dev_issuer
from tests.support.processes import free_port

pytestmark = pytest.mark.timeout(240)
IMPORT = "/v1/admin/keys/import"
WHO = "token:" + hashlib.sha256(TOKEN.encode()).hexdigest()[:12]
MODEL = {
    "model-00001-of-00002.safetensors": os.urandom(200_003),
    "model-00002-of-00002.safetensors": os.urandom(1),
    "nested/adapter.gguf": os.urandom(70_000),
    "config.json": b'{"architectures": ["Tiny"]}',
}


@dataclasses.dataclass(frozen=True)
class Remote:
    live: Live
    decisions: Path  # the broker's decision log
    output: Path  # what ``broker -v serve`` wrote (stdout and stderr)
    tls_trust: str  # "attestation": the broker made its TLS key; "ca": the operator's

    def flags(self, image: str = ALLOWED) -> list[str]:
        """How the owner names the broker they expect, and how its certificate is trusted."""
        trust = ["--ca", self.live.ca] if self.tls_trust == "ca" else []
        return [*self.live.flags(image), "--broker-tls-trust", self.tls_trust, *trust]

    def identity(self) -> BrokerIdentity:
        """How a runner expects the same broker (the SDK's check)."""
        return BrokerIdentity(
            image_digests=frozenset({ALLOWED}),
            jwks=json.dumps(self.live.issuer.jwks()),
            audience=AUDIENCE,
            issuer=self.live.issuer.issuer,
            tls_trust=self.tls_trust,
        )

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.decisions.read_text().splitlines()]

    def versions(self, name: str = KEY) -> list[int]:
        keys = self.live.get(f"/v1/admin/keys?name={name}", token=True)["keys"]
        return sorted(int(v["version"]) for v in keys)

    def post(self, body: dict[str, Any], url: str | None = None) -> tuple[int, dict[str, Any]]:
        """``POST /v1/admin/keys/import`` with the admin token: (status, answer)."""
        request = urllib.request.Request(
            (url or self.live.url) + IMPORT,
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, context=self.live.client_tls, timeout=10) as got:
                return got.status, json.loads(got.read())
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module", params=["attestation", "ca"], ids=["made-keys", "operator-keys"])
def remote(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Remote]:
    """A sealed broker (one worker) with an admin token, its output (``-v``: INFO and up)
    written to a file: with keys it made (``attestation``), or the operator's, every one bound."""
    tls_trust = str(request.param)
    workdir = tmp_path_factory.mktemp("remote") / "broker"
    sockets = Path(tempfile.mkdtemp(prefix="s-"))  # a socket path has at most 107 bytes
    issuer = dev_issuer()
    if tls_trust == "attestation":
        config = sealed_config(workdir, issuer, sockets / "launcher.sock")
        environ, client_tls = {"BROKER_SERVER_WORKERS": "1"}, unverified()  # the test's reads
    else:
        config = write_config(workdir, issuer)
        issuer.save(workdir / ISSUER_FILE)
        asyncio.run(create_test_keys(load_settings(config, {})))
        environ = sealed_environ(workdir, sockets / "launcher.sock", 1)
        client_tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    environ["BROKER_ADMIN_TOKEN_SHA256"] = hashlib.sha256(TOKEN.encode()).hexdigest()
    files = workdir.parent
    (files / "jwks.json").write_text(json.dumps(issuer.jwks()))
    (files / "token").write_text(TOKEN)
    launcher = start_launcher(workdir, sockets / "launcher.sock", 3600)
    try:
        output = files / "broker-output.log"
        process, port = serve_workers(config, environ, client_tls, log=output)
        try:
            live = Live(f"https://127.0.0.1:{port}", workdir, issuer, files, client_tls)
            decisions = load_settings(config, environ).audit.log
            yield Remote(live, decisions, output, tls_trust)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)
        shutil.rmtree(sockets, ignore_errors=True)


def small_model(directory: Path) -> Path:
    for name, data in MODEL.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def encrypt(remote: Remote, model: Path, out: Path, *flags: str, token: str = "token") -> Ran:
    return run(
        "weights", "encrypt", str(model), str(out), "--key", KEY, "--url", remote.live.url,
        "--token-file", str(remote.live.files / token), "--segment-size", "65536", *flags,
    )  # fmt: skip


async def release(remote: Remote, version: int) -> ReleasedDek:
    """The key as a runner of the allowed image gets it: attested, through the SDK, which
    checks the broker's attestation first as the owner did."""
    source = DevTokenSource(
        remote.live.issuer, Workload(image_digest=ALLOWED), lambda: datetime.now(UTC)
    )
    context = remote.live.client_tls if remote.tls_trust == "ca" else None
    async with BrokerClient(
        remote.live.url, ssl_context=context, broker_identity=remote.identity()
    ) as client:
        return await client.release(KEY, source, version=version)


async def decrypt_all(manifest: dict[str, Any], sealed: Path, out: Path, dek: bytes) -> None:
    for entry in manifest["files"]:
        target = out / entry["path"]
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        await decrypt_to(sealed / entry["encrypted"], target, dek, manifest["kid"])


def spellings(secret: bytes) -> list[str]:
    """How a DEK could appear in text: hex, base64url, base64."""
    return [secret.hex(), b64url_encode(secret), base64.b64encode(secret).decode()]


def test_owner_encrypts_for_the_attested_broker_and_a_runner_decrypts(
    remote: Remote, tmp_path: Path
) -> None:
    model, sealed = small_model(tmp_path / "model"), tmp_path / "sealed"
    before, records = remote.versions(), len(remote.records())
    ran = encrypt(remote, model, sealed, *remote.flags())
    assert ran.returncode == 0, ran.stderr
    assert "warning" not in ran.stderr
    version = max(before) + 1
    assert remote.versions() == [*before, version]  # a new version, numbered by the broker
    manifest = json.loads((sealed / "manifest.json").read_text())
    assert manifest["kid"] == f"{KEY}#{version}"
    assert json.loads(ran.stdout)["kid"] == manifest["kid"]
    assert (sealed / "config.json").read_bytes() == MODEL["config.json"]
    new = remote.records()[records:]
    assert [(r["type"], r["action"], r["key"], r["version"], r["who"]) for r in new] == [
        ("key_admin", "import", KEY, version, WHO),  # the intent
        ("key_admin", "import", KEY, version, WHO),  # its outcome
    ]
    assert (new[1]["result"], new[1]["intent"]) == ("ok", new[0]["index"])
    assert all({"dek", "material"}.isdisjoint(r) for r in new)

    released = asyncio.run(release(remote, version))
    assert (released.key, released.version) == (KEY, version)
    decrypted = tmp_path / "decrypted"
    asyncio.run(decrypt_all(manifest, sealed, decrypted, released.dek))
    for name, data in MODEL.items():
        if name != "config.json":
            assert (decrypted / name).read_bytes() == data

    output, decisions = remote.output.read_text(), remote.decisions.read_text()
    assert "POST /v1/admin/keys/import" in output  # -v: the broker did log this request
    for text in spellings(released.dek):
        assert text not in output
        assert text not in decisions


def test_another_image_is_sent_nothing_and_nothing_is_imported(
    remote: Remote, tmp_path: Path
) -> None:
    model, sealed = small_model(tmp_path / "model"), tmp_path / "sealed"
    versions, records = remote.versions(), len(remote.records())
    before = remote.live.requests()
    ran = encrypt(remote, model, sealed, *remote.flags(DENIED))
    after = remote.live.requests()
    assert ran.returncode == 1
    assert "broker_not_attested: image" in ran.stderr
    assert not sealed.exists()
    assert after[ATTESTATION] > before[ATTESTATION]  # the counters count this command's requests
    assert {r: n for r, n in after.items() if r.startswith("/v1/")} == {
        r: n for r, n in before.items() if r.startswith("/v1/")
    }  # no import request, so neither the token nor the DEK was sent
    assert remote.versions() == versions
    assert len(remote.records()) == records


def test_a_wrong_token_imports_nothing_and_writes_nothing(remote: Remote, tmp_path: Path) -> None:
    (remote.live.files / "wrong-token").write_text("not-the-admin-token")
    single = small_model(tmp_path / "model") / "model-00001-of-00002.safetensors"
    sealed = tmp_path / "one.brkw"
    versions = remote.versions()
    ran = encrypt(remote, single, sealed, *remote.flags(), token="wrong-token")
    assert ran.returncode == 1
    assert "error: unauthorized" in ran.stderr
    assert not sealed.exists()
    assert not Path(f"{sealed}.partial").exists()
    assert remote.versions() == versions


GOOD = b64url_encode(bytes(range(32)))


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("dek", b64url_encode(bytes(range(31))), "key_material_invalid"),
        ("dek", b64url_encode(bytes(range(33))), "key_material_invalid"),
        ("dek", GOOD + "=", "key_material_invalid"),  # padded
        ("dek", GOOD[:-1] + "B", "key_material_invalid"),  # non-canonical last character
        ("dek", base64.b64encode(bytes([0xFB] * 32)).decode(), "key_material_invalid"),  # + /
        ("dek", bytes(range(32)).hex(), "key_material_invalid"),
        ("dek", 12345, "key_material_invalid"),
        ("purpose", "query", "bad_request"),  # query keys are made by the broker
        ("purpose", "generic", "bad_request"),  # not the existing key's purpose
        ("extra", "x", "bad_request"),
    ],
    ids=["31-bytes", "33-bytes", "padded", "non-canonical", "base64", "hex", "number",
         "query", "other-purpose", "unknown-field"],
)  # fmt: skip
def test_import_refuses_bad_material_without_repeating_it(
    remote: Remote, field: str, value: object, code: str
) -> None:
    versions = remote.versions()
    body: dict[str, Any] = {"name": KEY, "purpose": "model-weights", "dek": GOOD, field: value}
    status, answer = remote.post(body)
    assert (status, answer["error"]["code"]) == (400, code)
    assert str(body["dek"]) not in json.dumps(answer)
    assert remote.versions() == versions


def test_import_makes_version_one_of_a_new_key_then_the_next(remote: Remote) -> None:
    name = "models/imported-by-owner"
    for expected in (1, 2):
        body = {"name": name, "purpose": "model-weights", "dek": b64url_encode(os.urandom(32))}
        status, answer = remote.post(body)
        assert (status, answer["name"], answer["version"]) == (201, name, expected)
        assert body["dek"] not in json.dumps(answer)
    assert remote.versions(name) == [1, 2]


async def test_import_over_plain_http_is_refused_off_a_development_broker(
    tmp_path: Path,
) -> None:
    config = await asyncio.to_thread(write_config, tmp_path / "plain", dev_issuer())
    token = {"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest()}
    settings = await asyncio.to_thread(load_settings, config, token)
    await create_test_keys(settings)
    body = {"name": KEY, "purpose": "model-weights", "dek": GOOD}
    answers = []
    for insecure_http in (False, True):  # TLS left off either way: the request is plain HTTP
        port = free_port()
        served = with_public_url(settings, f"http://127.0.0.1:{port}")
        server = dataclasses.replace(served.server, insecure_http=insecure_http)
        runner = BrokerRunner(create_app(dataclasses.replace(served, server=server)), server)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"http://127.0.0.1:{port}{IMPORT}",
                    json=body,
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ) as response,
            ):
                answers.append((response.status, await response.json()))
        finally:
            await runner.cleanup()
    (refused, refusal), (accepted, imported) = answers
    assert (refused, refusal["error"]["code"]) == (400, "tls_required")
    assert (accepted, imported["version"]) == (201, 2)  # loopback development broker


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--url", "https://127.0.0.1:9", "--token-file", "t", "--version", "1"], "--version"),
        (["--url", "http://127.0.0.1:9", "--token-file", "t"], "--url"),
        (["--url", "https://127.0.0.1:9"], "--token-file"),
        (["--url", "https://127.0.0.1:9", "--token-file", "t", "--config", "c"], "--config"),
        (["--config", "c", "--token-file", "t"], "--token-file"),
        (["--config", "c", "--broker-image", ALLOWED, "--broker-jwks", "j"], "--broker-image"),
        ([], "--config"),
    ],
    ids=["version", "plain-http", "no-token", "config-too", "token-alone", "pin-alone", "none"],
)
def test_flags_that_do_not_go_together_are_usage_errors(
    flags: list[str], named: str, tmp_path: Path
) -> None:
    model = small_model(tmp_path / "model")
    for name in ("t", "j", "c"):
        (tmp_path / name).write_text('{"keys": []}')
    given = [str(tmp_path / f) if f in {"t", "j", "c"} else f for f in flags]
    ran = run("weights", "encrypt", str(model), str(tmp_path / "out"), "--key", KEY, *given)
    assert ran.returncode == 2, ran.stderr
    assert f"argument {named}" in ran.stderr
    assert not (tmp_path / "out").exists()
