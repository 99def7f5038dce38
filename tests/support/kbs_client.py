"""A Confidential Containers guest's HTTP side as guest-components' ``kbs_protocol`` client
(0.4.0) behaves, for the KBS facade's tests and bench: its three calls with its own cookie
handling (so that a test can present another session's cookie), the sample attester's evidence
over the report data the guest computes, and its key. The guest's cryptography (``tee-pubkey``,
report data, decrypting an answer with the header re-serialised for the AAD) is
``tests/support/kbs_guest.py``'s oracle; ``tests/kbs_conformance`` is the guest's own crates.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from broker.kbs.wire import ERROR_TYPE_PREFIX, KBS_PREFIX, SESSION_COOKIE
from tests.support import kbs_guest
from tests.support.kbs_guest import GuestPrivateKey

PREFIX = KBS_PREFIX
COOKIE = SESSION_COOKIE
ERROR_TYPE = ERROR_TYPE_PREFIX
KEY_KINDS = {"P-256": ec.SECP256R1(), "P-521": ec.SECP521R1()}  # the curves the guest makes


def tee_key(kind: str = "P-256") -> tuple[GuestPrivateKey, dict[str, str]]:
    """A key pair as ``TeeKeyPair`` makes it (P-256, P-521 or RSA 2048), and its public half as
    the guest sends it (``kbs_guest.tee_pubkey``)."""
    private: GuestPrivateKey = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if kind == "RSA"
        else ec.generate_private_key(KEY_KINDS[kind])
    )
    return private, kbs_guest.tee_pubkey(private)


def report_data(tee_pubkey: dict[str, str], nonce: str, additional: str = "") -> bytes:
    """What the guest asks its attester to sign, SHA-384 (``kbs_guest.report_data``)."""
    return kbs_guest.report_data(tee_pubkey, nonce, additional, "sha384")


def sample_evidence(data: bytes) -> dict[str, str]:
    """The sample attester's quote over ``data`` (``attester/src/sample``)."""
    return {"svn": "1", "report_data": base64.b64encode(data).decode()}


open_as_guest = kbs_guest.open_as_guest  # the guest's decryption, rebuilt in Python


@dataclass
class Guest:
    """One guest against a broker at ``url``: its key, and the session cookie it was given."""

    url: str
    ssl: Any = None  # the client TLS context (or False)
    kind: str = "P-256"
    private: GuestPrivateKey = field(init=False)
    tee_pubkey: dict[str, str] = field(init=False)
    cookie: str | None = None
    nonce: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        self.private, self.tee_pubkey = tee_key(self.kind)

    async def call(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        body: Any = None,
        *,
        cookie: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, Mapping[str, str]]:
        """One request with this guest's cookie (or ``cookie``); the status, the parsed JSON
        body (or the text) and the headers."""
        sent = dict(headers or {})
        chosen = self.cookie if cookie is None else cookie
        if chosen:
            sent["Cookie"] = f"{COOKIE}={chosen}"
        data = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
        if data is not None:
            sent.setdefault("Content-Type", "application/json")
        async with session.request(
            method, self.url + PREFIX + path, data=data, headers=sent, ssl=self.ssl
        ) as response:
            text = await response.text()
            given = response.cookies.get(COOKIE)
            if given is not None and cookie is None:
                self.cookie = given.value
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return response.status, parsed, response.headers

    async def auth(
        self, session: aiohttp.ClientSession, *, tee: str = "sample", version: str = "0.4.0"
    ) -> tuple[int, Any]:
        request = {
            "version": version,
            "tee": tee,
            "extra-params": {"supported-hash-algorithms": ["sha256", "sha384", "sha512", "sm3"]},
        }
        status, body, _ = await self.call(session, "POST", "/auth", request)
        if status == 200:
            self.nonce = body["nonce"]
        return status, body

    def attestation(
        self, *, nonce: str | None = None, data: bytes | None = None, additional: str = ""
    ) -> dict[str, Any]:
        """kbs-types ``Attestation`` with sample evidence over the guest's own report data
        (``data``: over these bytes instead)."""
        nonce = nonce or self.nonce or ""
        signed = data if data is not None else report_data(self.tee_pubkey, nonce, additional)
        return {
            "init-data": None,
            "runtime-data": {"nonce": nonce, "tee-pubkey": self.tee_pubkey},
            "tee-evidence": {
                "primary_evidence": sample_evidence(signed),
                "additional_evidence": additional,
            },
        }

    async def attest(
        self, session: aiohttp.ClientSession, body: Any = None, *, cookie: str | None = None
    ) -> tuple[int, Any]:
        status, answer, _ = await self.call(
            session, "POST", "/attest", self.attestation() if body is None else body, cookie=cookie
        )
        if status == 200:
            self.token = answer["token"]
        return status, answer

    async def handshake(self, session: aiohttp.ClientSession) -> None:
        """auth then attest, both answered 200."""
        status, body = await self.auth(session)
        assert status == 200, body
        status, body = await self.attest(session)
        assert status == 200, body

    async def resource(
        self,
        session: aiohttp.ClientSession,
        path: str,
        *,
        cookie: str | None = None,
        bearer: str | None = None,
    ) -> tuple[int, Any, Mapping[str, str]]:
        headers = {} if bearer is None else {"Authorization": f"Bearer {bearer}"}
        return await self.call(session, "GET", "/resource/" + path, cookie=cookie, headers=headers)
