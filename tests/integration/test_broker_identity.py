"""Issue 29 item 4: clients verify the broker's self-attestation before they trust it.

A loopback HTTPS server answers ``GET /.well-known/broker-attestation`` in the agreed format
with tokens of the development issuer bound to its real TLS key (the broker's own endpoint and
development launcher are built separately; see tests/support/broker_attestation.py). The real
SDK (``BrokerClient(broker_identity=...)``) and the real CLI (``broker verify broker``) talk to
it over real TLS; the man-in-the-middle is a real relay (tests/support/proxy.py) with its own
certificate from a CA the client trusts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client import BrokerClient, BrokerClientError, BrokerIdentity
from broker.dev.issuer import DEV_ISSUER, DevIssuer
from broker.dev.tls import make_dev_tls
from tests.support.broker_attestation import (
    AUDIENCE,
    IMAGE,
    OTHER_IMAGE,
    answer,
    key_hash,
    mint,
    pki_token,
    spki,
)
from tests.support.cli import run
from tests.support.issuers import dev_issuer
from tests.support.processes import free_port
from tests.support.proxy import round_robin_proxy

ATTESTATION = "/.well-known/broker-attestation"


@dataclass
class Tls:
    relay_dir: Path  # a relay's own certificate, from CA 2
    bundle: Path  # the client trusts both CAs
    client: ssl.SSLContext
    server: ssl.SSLContext
    keys: dict[str, bytes]  # what the broker binds: its TLS key and a statement key


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    now = datetime.now(UTC)
    broker, relay = (
        make_dev_tls(tmp_path / "broker", now=now),
        make_dev_tls(tmp_path / "relay", now=now),
    )
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(broker.ca_cert.read_bytes() + relay.ca_cert.read_bytes())
    relay.ca_cert.write_bytes(bundle.read_bytes())  # the relay itself reaches the broker
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(broker.server_cert, broker.server_key)
    cert = x509.load_pem_x509_certificate(broker.server_cert.read_bytes())
    keys = {
        "tls": spki(cert.public_key()),
        "statement": spki(ec.generate_private_key(ec.SECP256R1())),
    }
    client = ssl.create_default_context(cafile=str(bundle))
    return Tls(tmp_path / "relay", bundle, client, server, keys)


@dataclass
class FakeBroker:
    """The broker's attestation endpoint and a challenge route; every path asked is kept."""

    url: str
    tls: Tls
    issuer: DevIssuer
    answer: bytes = b""
    asked: list[str] = field(default_factory=list)

    def attest(self, make: Callable[..., str] = mint, **claims: Any) -> None:
        self.answer = answer(
            make(self.issuer, self.tls.keys, now=datetime.now(UTC), **claims), self.tls.keys
        )

    def identity(self, **overrides: Any) -> BrokerIdentity:
        fields: dict[str, Any] = {
            "image_digests": frozenset({IMAGE}),
            "jwks": json.dumps(self.issuer.jwks()),
            "audience": AUDIENCE,
            "issuer": DEV_ISSUER,
        }
        return BrokerIdentity(**{**fields, **overrides})

    def client(self, url: str | None = None, **overrides: Any) -> BrokerClient:
        return BrokerClient(
            url or self.url, ssl_context=self.tls.client, broker_identity=self.identity(**overrides)
        )


@pytest.fixture
async def fake_broker(tls: Tls) -> AsyncIterator[FakeBroker]:
    broker = FakeBroker(url="", tls=tls, issuer=dev_issuer())
    broker.attest()

    async def attestation(request: web.Request) -> web.Response:
        broker.asked.append(request.path)
        return web.Response(body=broker.answer, content_type="application/json")

    async def challenge(request: web.Request) -> web.Response:
        broker.asked.append(request.path)
        expires = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
        return web.json_response({"nonce": "n" * 43, "expires_at": expires, "audience": AUDIENCE})

    app = web.Application()
    app.router.add_get(ATTESTATION, attestation)
    app.router.add_post("/v1/challenge", challenge)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls.server).start()
    broker.url = f"https://127.0.0.1:{port}"
    try:
        yield broker
    finally:
        await runner.cleanup()


async def refused(client: BrokerClient, check: str) -> BrokerClientError:
    async with client:
        with pytest.raises(BrokerClientError) as caught:
            await client.challenge()
    assert caught.value.code == "broker_not_attested", caught.value
    assert caught.value.details["check"] == check, caught.value
    return caught.value


async def test_client_verifies_the_expected_broker_before_its_first_request(
    fake_broker: FakeBroker,
) -> None:
    async with fake_broker.client() as client:
        await client.challenge()
        verified = await client.verify_broker()
    assert verified.image_digest == IMAGE
    assert fake_broker.asked == [ATTESTATION, "/v1/challenge"]


@pytest.mark.parametrize(
    ("claims", "check"),
    [
        ({"image": OTHER_IMAGE}, "image"),
        ({"debug": True}, "debug"),
        ({"lifetime": timedelta(seconds=-120)}, "times"),
    ],
    ids=["another_image", "debug_image", "expired_token"],
)
async def test_client_refuses_broker_before_sending_anything(
    fake_broker: FakeBroker, claims: dict[str, Any], check: str
) -> None:
    fake_broker.attest(**claims)
    await refused(fake_broker.client(), check)
    assert fake_broker.asked == [ATTESTATION]  # no challenge, no evidence, no key


async def test_client_refuses_token_whose_nonces_omit_a_bound_key(fake_broker: FakeBroker) -> None:
    fake_broker.attest(nonces=[key_hash(fake_broker.tls.keys["tls"])])
    await refused(fake_broker.client(), "nonce")
    assert fake_broker.asked == [ATTESTATION]


async def test_client_expecting_another_image_refuses_this_broker(fake_broker: FakeBroker) -> None:
    await refused(fake_broker.client(image_digests=frozenset({OTHER_IMAGE})), "image")


@pytest.mark.parametrize("tls_trust", ["ca", "attestation"])
async def test_man_in_the_middle_relaying_the_real_attestation_refused(
    fake_broker: FakeBroker, tls_trust: str
) -> None:
    """``attestation``: the mode of a sealed broker's self-signed certificate, where no CA
    check stands in front of the key comparison."""
    port = free_port()
    async with round_robin_proxy([fake_broker.url], tls_dir=fake_broker.tls.relay_dir, port=port):
        client = fake_broker.client(f"https://127.0.0.1:{port}", tls_trust=tls_trust)
        error = await refused(client, "tls")
    assert "not the attested one" in error.message
    assert fake_broker.asked == [ATTESTATION]  # the relay fetched the real one; nothing else


async def test_certificate_changed_after_verification_refused_by_the_pin(
    fake_broker: FakeBroker,
) -> None:
    async with fake_broker.client() as client:
        await client.verify_broker()
        relay = fake_broker.tls.relay_dir  # another certificate the client's CAs accept
        fake_broker.tls.server.load_cert_chain(relay / "server.pem", relay / "server.key")
        with pytest.raises(BrokerClientError) as caught:
            await client.challenge()
    assert (caught.value.code, caught.value.details["check"]) == ("broker_not_attested", "tls")
    # the changed certificate made the client attest again (a restarted sealed broker has a new
    # key): the attestation does not bind this certificate, and the challenge was never sent
    assert fake_broker.asked == [ATTESTATION, ATTESTATION]


async def test_client_verifies_again_when_the_attestation_expires(fake_broker: FakeBroker) -> None:
    async with fake_broker.client() as client:
        verified = await client.verify_broker()
        fake_broker.attest(image=OTHER_IMAGE)  # the broker was replaced by another image
        # the verdict's expiry is reached (instead of waiting an hour for it):
        client._verified = dataclasses.replace(verified, expires=datetime.now(UTC))
        with pytest.raises(BrokerClientError) as caught:
            await client.challenge()
    assert caught.value.details["check"] == "image"
    assert fake_broker.asked == [ATTESTATION, ATTESTATION]


async def test_pki_form_attestation_verified(fake_broker: FakeBroker) -> None:
    token, root_pem = pki_token(fake_broker.tls.keys, now=datetime.now(UTC))
    fake_broker.answer = answer(token, fake_broker.tls.keys, token_type="PKI")
    async with fake_broker.client(jwks=None, root_pem=root_pem) as client:
        verified = await client.verify_broker()
    assert (verified.token_type, verified.image_digest) == ("PKI", IMAGE)


def cli_args(broker: FakeBroker, jwks: Path, *extra: str) -> list[str]:
    jwks.write_text(json.dumps(broker.issuer.jwks()))
    return [
        "verify", "broker", broker.url, "--jwks", str(jwks), "--ca", str(broker.tls.bundle),
        "--audience", AUDIENCE, "--issuer", DEV_ISSUER, *extra,
    ]  # fmt: skip


async def test_cli_prints_the_bound_keys_of_the_expected_broker(
    fake_broker: FakeBroker, tmp_path: Path
) -> None:
    args = cli_args(fake_broker, tmp_path / "jwks.json", "--image", IMAGE)
    ran = await asyncio.to_thread(run, *args)
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["image_digest"] == IMAGE
    assert report["key_sha256"] == {n: key_hash(d) for n, d in fake_broker.tls.keys.items()}


async def test_cli_refuses_a_broker_of_another_image(
    fake_broker: FakeBroker, tmp_path: Path
) -> None:
    args = cli_args(fake_broker, tmp_path / "jwks.json", "--image", OTHER_IMAGE)
    ran = await asyncio.to_thread(run, *args)
    assert ran.returncode == 1
    assert json.loads(ran.stdout)["check"] == "image"
    assert "broker_not_attested: image" in ran.stderr


async def test_cli_without_image_is_a_usage_error(fake_broker: FakeBroker, tmp_path: Path) -> None:
    ran = await asyncio.to_thread(run, *cli_args(fake_broker, tmp_path / "jwks.json"))
    assert ran.returncode == 2
    assert "--image" in ran.stderr
    assert fake_broker.asked == []
