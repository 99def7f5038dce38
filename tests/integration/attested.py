"""What the tests of releases on attestation results share (issue 19): a broker with
``[attest]`` on and a key no image may have, the admin call, and ``Runner`` — a runner's
attestation made by hand (raw HTTP, PyJWT proofs) so that hostile tests can change one thing.
Hostile EARs are minted with PyJWT (another JOSE library than the broker's), some with the
broker's own result key read from its workspace."""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client.unwrap import new_runner_key
from broker.core.binding import attestation_thumbprint
from broker.crypto.jwk import public_jwk, thumbprint
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from tests.integration.conftest import (
    RunningBroker,
)
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.support.constants import KEY

ADMIN = "attested-admin-token-5f0e1d"
DENIED_KEY = "models/not-for-this-image"  # created here; no image is allowed for it


async def attest_broker(start_broker: Callable[..., Any], **kwargs: Any) -> RunningBroker:
    environ = {
        "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN.encode()).hexdigest(),
        **kwargs.pop("environ", {}),
    }
    extra_toml = ATTEST_TOML + kwargs.pop("extra_toml", "")
    setup = kwargs.pop("workdir_setup", None)

    def set_up(workdir: Path) -> None:
        with_result_key(workdir)
        if setup is not None:
            setup(workdir)

    broker: RunningBroker = await start_broker(
        extra_toml=extra_toml, workdir_setup=set_up, environ=environ, **kwargs
    )
    async with open_key_service(broker.settings.keys) as keys:
        await keys.create(DENIED_KEY, Purpose.MODEL_WEIGHTS, now=datetime.now(UTC))
    return broker


async def admin_post(broker: RunningBroker, path: str, body: Any = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            broker.url + path,
            json=body,
            headers={"Authorization": f"Bearer {ADMIN}"},
            ssl=broker.client_tls,
        ) as response,
    ):
        return response.status, await response.json()


class Runner:
    """A runner's attestation made by hand: the EAR and both private keys."""

    def __init__(self, broker: RunningBroker) -> None:
        self.broker = broker
        self.url = broker.url + "/v1/release"
        self.pop = ec.generate_private_key(ec.SECP256R1())
        self.encryption, self.encryption_jwk = new_runner_key("EC-P256")
        self.token = ""
        self.nonce: str | None = None

    async def attest(self, session: aiohttp.ClientSession) -> None:
        broker = self.broker
        async with session.post(broker.url + "/v1/challenge", json={}, ssl=broker.client_tls) as r:
            challenge = await r.json()
        pop_jwk = public_jwk(self.pop.public_key())
        binding = attestation_thumbprint(thumbprint(self.encryption_jwk), thumbprint(pop_jwk))
        evidence = await broker.token_source().token(
            challenge["audience"], [challenge["nonce"], binding]
        )
        body = {
            "nonce": challenge["nonce"],
            "evidence": {"gca": evidence},
            "runner_key": self.encryption_jwk,
            "pop_key": pop_jwk,
        }
        async with session.post(broker.url + "/v1/attest", json=body, ssl=broker.client_tls) as r:
            assert r.status == 201, await r.text()
            self.token = await r.text()
            self.nonce = r.headers["DPoP-Nonce"]

    def proof(
        self,
        *,
        key: ec.EllipticCurvePrivateKey | None = None,
        token: str | None = None,
        **claims: Any,
    ) -> str:
        key = key or self.pop
        values: dict[str, Any] = {
            "jti": str(uuid.uuid4()),
            "htm": "POST",
            "htu": self.url,
            "iat": int(time.time()),
            "ath": ath(token or self.token),
            "nonce": self.nonce,
        }
        values.update(claims)
        values = {k: v for k, v in values.items() if v is not None}
        header = {"typ": "dpop+jwt", "jwk": public_jwk(key.public_key())}
        return jwt.encode(values, key, algorithm="ES256", headers=header)

    async def release(
        self,
        session: aiohttp.ClientSession,
        *,
        authorization: str | None = None,
        proof: str | None = None,
        keys: tuple[str, ...] = (KEY,),
        host: str | None = None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        headers = {"Authorization": authorization or f"DPoP {self.token}"}
        if proof is not None:
            headers["DPoP"] = proof
        if host is not None:  # what a client may put in Host: never a URL the broker trusts
            headers["Host"] = host
        async with session.post(
            self.url, json={"keys": list(keys)}, headers=headers, ssl=self.broker.client_tls
        ) as response:
            return response.status, await response.json(), dict(response.headers)


def ath(token: str) -> str:
    digest = hashlib.sha256(token.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def result_key(broker: RunningBroker) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(
        (broker.workdir / "ear-signing.pem").read_bytes(), password=None
    )
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def mint(
    runner: Runner,
    *,
    key: ec.EllipticCurvePrivateKey | None = None,
    algorithm: str = "ES256",
    secret: Any = None,
    **changes: Any,
) -> str:
    """The runner's EAR with ``changes``, re-signed (by the broker's key unless ``key``)."""
    claims = jwt.decode(runner.token, options={"verify_signature": False})
    claims.update(changes)
    signer = key or result_key(runner.broker)
    kid = thumbprint(public_jwk(signer.public_key()))
    return jwt.encode(
        claims,
        secret if secret is not None else signer,
        algorithm=algorithm,
        headers={"kid": kid, "typ": "eat+jwt"},
    )
