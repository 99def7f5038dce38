"""Issue 29 item 4 against a live sealed broker: ``broker serve`` with ``[sealed]
launcher_socket`` on ``broker dev launcher`` (tests/integration/test_broker_attestation.py
starts both), checked by the real SDK and the real ``broker verify broker``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from broker.client import BrokerClient, BrokerClientError, BrokerIdentity
from tests.integration.test_broker_attestation import Sealed, sealed_broker, socket_dir
from tests.support.broker_attestation import OTHER_IMAGE
from tests.support.cli import run
from tests.support.constants import ALLOWED, AUDIENCE

__all__ = ["sealed_broker", "socket_dir"]  # the fixtures this module uses
pytestmark = pytest.mark.timeout(240)


def identity(broker: Sealed, image: str) -> BrokerIdentity:
    return BrokerIdentity(
        image_digests=frozenset({image}),
        jwks=json.dumps(broker.issuer.jwks()),
        audience=AUDIENCE,
        issuer=broker.issuer.issuer,
    )


async def test_sdk_verifies_the_live_sealed_broker_then_talks_to_it(sealed_broker: Sealed) -> None:
    async with BrokerClient(
        sealed_broker.url,
        ssl_context=sealed_broker.client_tls,
        broker_identity=identity(sealed_broker, ALLOWED),
    ) as client:
        verified = await client.verify_broker()
        await client.challenge()  # over a connection pinned to the attested certificate
    assert verified.image_digest == ALLOWED
    assert set(verified.keys) >= {"tls", "statement"}


async def test_sdk_expecting_another_image_refuses_the_live_broker(sealed_broker: Sealed) -> None:
    async with BrokerClient(
        sealed_broker.url,
        ssl_context=sealed_broker.client_tls,
        broker_identity=identity(sealed_broker, OTHER_IMAGE),
    ) as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.challenge()
    assert (caught.value.code, caught.value.details["check"]) == ("broker_not_attested", "image")


async def test_cli_verifies_the_live_sealed_broker(sealed_broker: Sealed, tmp_path: Path) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(sealed_broker.issuer.jwks()))
    args = [
        "verify", "broker", sealed_broker.url, "--image", ALLOWED, "--jwks", str(jwks),
        "--ca", str(sealed_broker.workdir / "tls" / "ca.pem"), "--audience", AUDIENCE,
        "--issuer", sealed_broker.issuer.issuer,
    ]  # fmt: skip
    ran = await asyncio.to_thread(run, *args)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["image_digest"] == ALLOWED
