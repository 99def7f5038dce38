"""Issue 29 item 4: ``broker audit monitor`` and ``broker keys create --url`` pin the broker's
attested identity (``--broker-image`` & co., ``broker/cli/broker_pin.py``), and the log key served
at ``GET /v1/log/key`` is the checkpoint key the attestation binds.

A real sealed ``broker serve`` on ``broker dev launcher`` (one per module, with an admin token)
answers the real CLI. What each test shows:

* ``test_log_key_served_is_the_attested_checkpoint_key``: the server's side of the promise;
* the commands pass with the right image, and with another image stop after the attestation:
  the broker's own request counters (``/metrics``) show no ``/v1/…`` request, so no admin token
  and no log request reached it (the counters show the attestation request, so they count);
* a loopback HTTPS stand-in with the broker's TLS key, serving the broker's real attestation but
  a log key of its own, is refused by the attested monitor (and trusted without the flags);
* an attestation binding no checkpoint key is refused unless ``--accept-unbound-log-key``;
* a pinned connection to another certificate sends nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
import signal
import ssl
import tempfile
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.cli.broker_pin import BrokerConnection
from broker.client.broker_identity import BrokerNotAttested
from broker.config import load_settings
from broker.core.encoding import b64url_decode
from broker.crypto.checkpoint import Checkpoint, NoteSigner, NoteVerifier
from broker.dev.issuer import ISSUER_FILE, DevIssuer
from tests.integration.conftest import create_test_keys, serve_workers, write_config
from tests.integration.test_broker_attestation import sealed_environ, start_launcher
from tests.support.broker_attestation import AUDIENCE as MINTED_AUDIENCE
from tests.support.broker_attestation import answer, mint, spki
from tests.support.cli import run
from tests.support.constants import ALLOWED, AUDIENCE, DENIED
from tests.support.issuers import dev_issuer
from tests.support.processes import free_port

pytestmark = pytest.mark.timeout(240)
TOKEN = "pin-test-admin-token"
ATTESTATION = "/.well-known/broker-attestation"
COUNTER = re.compile(r'^broker_http_requests_total\{route="([^"]*)",status="[^"]*"\} (\S+)$')


@dataclass
class Live:
    url: str
    workdir: Path
    issuer: DevIssuer
    files: Path  # the JWKS and the token file the commands read
    client_tls: ssl.SSLContext

    @property
    def ca(self) -> str:
        return str(self.workdir / "tls" / "ca.pem")

    def flags(self, image: str = ALLOWED, audience: str = AUDIENCE) -> list[str]:
        return [
            "--broker-image", image, "--broker-jwks", str(self.files / "jwks.json"),
            "--broker-audience", audience, "--broker-issuer", self.issuer.issuer,
        ]  # fmt: skip

    def get(self, path: str, *, token: bool = False) -> Any:
        headers = {"Authorization": f"Bearer {TOKEN}"} if token else {}
        request = urllib.request.Request(self.url + path, headers=headers)
        with urllib.request.urlopen(request, context=self.client_tls, timeout=10) as reply:
            body = reply.read()
        return body.decode() if path == "/metrics" else json.loads(body)

    def requests(self) -> Counter[str]:
        """Requests the broker answered, by route (its ``broker_http_requests_total``)."""
        counts: Counter[str] = Counter()
        for line in self.get("/metrics").splitlines():
            if match := COUNTER.match(line):
                counts[match.group(1)] += int(float(match.group(2)))
        return counts


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A sealed broker (the operator's keys, every one bound) with an admin token."""
    workdir = tmp_path_factory.mktemp("pin") / "broker"
    sockets = Path(tempfile.mkdtemp(prefix="s-"))  # a socket path has at most 107 bytes
    issuer = dev_issuer()
    config = write_config(workdir, issuer)
    issuer.save(workdir / ISSUER_FILE)
    asyncio.run(create_test_keys(load_settings(config, {})))
    files = workdir.parent
    (files / "jwks.json").write_text(json.dumps(issuer.jwks()))
    (files / "token").write_text(TOKEN)
    launcher = start_launcher(workdir, sockets / "launcher.sock", 3600)
    client_tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    try:
        environ = sealed_environ(workdir, sockets / "launcher.sock", 1)
        environ["BROKER_ADMIN_TOKEN_SHA256"] = hashlib.sha256(TOKEN.encode()).hexdigest()
        process, port = serve_workers(config, environ, client_tls)
        try:
            yield Live(f"https://127.0.0.1:{port}", workdir, issuer, files, client_tls)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)
        shutil.rmtree(sockets, ignore_errors=True)


def raw(key: ed25519.Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def test_log_key_served_is_the_attested_checkpoint_key(live: Live) -> None:
    document = live.get(ATTESTATION)
    bound = b64url_decode(document["keys"]["checkpoint"])
    claims = jwt.decode(
        document["token"],
        jwt.PyJWK(live.issuer.jwks()["keys"][0]),
        algorithms=["RS256"],
        audience=AUDIENCE,
        issuer=live.issuer.issuer,
    )
    assert hashlib.sha256(bound).hexdigest() in claims["eat_nonce"]
    served = NoteVerifier.parse(live.get("/v1/log/key")["verifier_key"])
    attested = serialization.load_der_public_key(bound)
    assert isinstance(attested, ed25519.Ed25519PublicKey)
    assert raw(attested) == raw(served.public)
    signer = NoteSigner.from_pem(served.name, live.workdir / "log-ed25519.pem")
    assert signer.public_raw == raw(served.public)  # the key the broker signs with


def monitor(live: Live, state: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    ran = run("audit", "monitor", live.url, "--state", str(state), "--ca", live.ca, *extra)
    return ran.returncode, json.loads(ran.stdout.splitlines()[-1]), ran.stderr


def test_monitor_pins_the_attested_broker_and_its_log_key(live: Live, tmp_path: Path) -> None:
    state = tmp_path / "monitor.json"
    code, report, stderr = monitor(live, state, *live.flags())  # no --key: the attested one
    assert code == 0, stderr
    assert report["broker"] == {"image_digest": ALLOWED, "log_key": "attested"}
    pinned = json.loads(state.read_text())["logs"][report["origin"]]["verifier_key"]
    assert pinned == live.get("/v1/log/key")["verifier_key"]
    code, report, stderr = monitor(live, state, *live.flags())
    assert (code, report["previous_size"] is not None) == (0, True), stderr


def test_monitor_expecting_another_image_asks_no_log_request(live: Live, tmp_path: Path) -> None:
    state = tmp_path / "monitor.json"
    before = live.requests()
    code, report, stderr = monitor(live, state, *live.flags(DENIED))
    after = live.requests()
    assert (code, report["code"], report["check"]) == (1, "broker_not_attested", "image")
    assert "broker_not_attested: image" in stderr
    assert not state.exists()
    assert after[ATTESTATION] > before[ATTESTATION]  # the counters count this command's requests
    assert {r: n for r, n in after.items() if r.startswith("/v1/")} == {
        r: n for r, n in before.items() if r.startswith("/v1/")
    }


def keys_create(live: Live, name: str, *flags: str) -> tuple[int, str, str]:
    ran = run(
        "keys", "create", name, "--purpose", "model-weights", "--url", live.url,
        "--token-file", str(live.files / "token"), "--ca", live.ca, *flags,
    )  # fmt: skip
    return ran.returncode, ran.stdout, ran.stderr


def test_keys_create_through_the_attested_broker(live: Live) -> None:
    code, stdout, stderr = keys_create(live, "models/pinned-ok", *live.flags())
    assert code == 0, stderr
    assert json.loads(stdout)["name"] == "models/pinned-ok"
    versions = live.get("/v1/admin/keys?name=models/pinned-ok", token=True)["keys"]
    assert [v["version"] for v in versions] == [1]


def test_keys_create_expecting_another_image_sends_no_token(live: Live) -> None:
    before = live.requests()
    code, _, stderr = keys_create(live, "models/pinned-refused", *live.flags(DENIED))
    after = live.requests()
    assert code == 1
    assert "broker_not_attested: image" in stderr
    assert after[ATTESTATION] > before[ATTESTATION]
    assert after["/v1/admin/keys"] == before["/v1/admin/keys"]  # the token was never sent
    assert live.get("/v1/admin/keys?name=models/pinned-refused", token=True)["keys"] == []


def test_keys_create_pin_flags_without_url_are_refused(live: Live, tmp_path: Path) -> None:
    ran = run(
        "keys", "create", "models/x", "--purpose", "model-weights",
        "--config", str(live.workdir / "broker.toml"), *live.flags(),
    )  # fmt: skip
    assert ran.returncode == 2
    assert "--broker-image" in ran.stderr
    assert "--url" in ran.stderr


@dataclass
class StandIn:
    """A loopback HTTPS server with the live broker's TLS key: what it serves is set per test."""

    url: str = ""
    attestation: bytes = b""
    signer: NoteSigner = field(
        default_factory=lambda: NoteSigner("standin", ed25519.Ed25519PrivateKey.generate())
    )
    asked: list[str] = field(default_factory=list)


@pytest.fixture
async def stand_in(live: Live) -> AsyncIterator[StandIn]:
    served = StandIn()

    async def answer_for(request: web.Request) -> web.Response:
        served.asked.append(request.path)
        if request.path == ATTESTATION:
            return web.Response(body=served.attestation, content_type="application/json")
        if request.path == "/v1/log/key":
            key = served.signer.verifier_key()
            return web.json_response({"name": served.signer.name, "verifier_key": key})
        body = Checkpoint(served.signer.name, 0, hashlib.sha256(b"").digest()).body()
        return web.Response(text=served.signer.sign(body), content_type="text/plain")

    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(live.workdir / "tls" / "server.pem", live.workdir / "tls" / "server.key")
    app = web.Application()
    for path in (ATTESTATION, "/v1/log/key", "/v1/log/checkpoint"):
        app.router.add_get(path, answer_for)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    served.url = f"https://127.0.0.1:{port}"
    try:
        yield served
    finally:
        await runner.cleanup()


async def monitor_stand_in(
    live: Live, stand_in: StandIn, state: Path, *extra: str
) -> tuple[int, dict[str, Any]]:
    args = ["audit", "monitor", stand_in.url, "--state", str(state), "--ca", live.ca, *extra]
    ran = await asyncio.to_thread(run, *args)
    return ran.returncode, json.loads(ran.stdout.splitlines()[-1])


async def test_monitor_refuses_a_log_key_that_is_not_the_attested_one(
    live: Live, stand_in: StandIn, tmp_path: Path
) -> None:
    real = await asyncio.to_thread(live.get, ATTESTATION)
    stand_in.attestation = json.dumps(real).encode()  # the broker's genuine attestation
    own_key = ("--key", stand_in.signer.verifier_key())
    code, report = await monitor_stand_in(live, stand_in, tmp_path / "plain.json", *own_key)
    assert code == 0, report  # without the flags, a pinned key is all the monitor checks
    stand_in.asked.clear()
    state = tmp_path / "attested.json"
    code, report = await monitor_stand_in(live, stand_in, state, *own_key, *live.flags())
    assert (code, report["check"]) == (1, "checkpoint"), report
    assert "not the checkpoint key" in report["problem"]
    assert stand_in.asked == [ATTESTATION, "/v1/log/key"]  # no checkpoint was read
    assert not state.exists()


async def test_monitor_refuses_an_unbound_log_key_unless_accepted(
    live: Live, stand_in: StandIn, tmp_path: Path
) -> None:
    cert = x509.load_pem_x509_certificate((live.workdir / "tls" / "server.pem").read_bytes())
    bound = {"tls": spki(cert.public_key())}  # like a broker whose checkpoint key is in KMS
    token = mint(live.issuer, bound, image=ALLOWED, now=datetime.now(UTC))
    stand_in.attestation = answer(token, bound)
    flags = (*live.flags(audience=MINTED_AUDIENCE), "--key", stand_in.signer.verifier_key())
    code, report = await monitor_stand_in(live, stand_in, tmp_path / "refused.json", *flags)
    assert (code, report["check"]) == (1, "checkpoint"), report
    assert "binds no checkpoint key" in report["problem"]
    accepted = (*flags, "--accept-unbound-log-key")
    code, report = await monitor_stand_in(live, stand_in, tmp_path / "accepted.json", *accepted)
    assert code == 0, report
    assert report["broker"]["log_key"].startswith("not bound")


async def test_pinned_request_to_another_certificate_sends_nothing(
    live: Live, stand_in: StandIn
) -> None:
    der = x509.load_pem_x509_certificate(
        (live.workdir / "tls" / "server.pem").read_bytes()
    ).public_bytes(serialization.Encoding.DER)
    context = ssl.create_default_context(cafile=live.ca)

    def get(pin: bytes) -> bytes:
        with BrokerConnection(stand_in.url, 10, context, pin=pin).open("/v1/log/key") as reply:
            return bytes(reply.read())

    with pytest.raises(BrokerNotAttested) as caught:
        await asyncio.to_thread(get, hashlib.sha256(b"another certificate").digest())
    assert caught.value.check == "tls"
    assert stand_in.asked == []
    assert b"verifier_key" in await asyncio.to_thread(get, hashlib.sha256(der).digest())
    assert stand_in.asked == ["/v1/log/key"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["decisions.log", "--broker-image", ALLOWED, "--broker-jwks", "j"], "--broker-image"),
        (["https://127.0.0.1:9", "--broker-image", ALLOWED], "--broker-jwks"),
        (["https://127.0.0.1:9", "--accept-unbound-log-key"], "--accept-unbound-log-key"),
        (["https://127.0.0.1:9", "--broker-jwks", "j"], "--broker-image"),
        (["https://127.0.0.1:9", "--broker-tls-trust", "attestation"], "--broker-image"),
    ],
    ids=["log-file", "no-anchor", "unbound-alone", "anchor-alone", "tls-trust-alone"],
)
def test_monitor_pin_flags_that_would_check_nothing_are_usage_errors(
    flags: list[str], named: str, tmp_path: Path
) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text('{"keys": []}')
    given = [str(jwks) if flag == "j" else flag for flag in flags]
    ran = run("audit", "monitor", "--state", str(tmp_path / "state.json"), *given)
    assert ran.returncode == 2
    assert f"argument {named}" in ran.stderr
