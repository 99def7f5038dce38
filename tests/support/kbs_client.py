"""A Confidential Containers guest as guest-components' ``kbs_protocol`` client (0.4.0) behaves,
for the KBS facade's tests and bench: its ``tee-pubkey`` (kbs-types ``TeePubKey``), the sample
attester's evidence over the report data it computes (SHA-384 of the JCS of ``tee-pubkey``,
``nonce``, ``additional-evidence``), its three HTTP calls (its own cookie handling, so that a
test can present another session's cookie), and the answer decrypted **as the guest does**: the
AAD is the guest's re-serialisation of the parsed protected header (``alg``, ``enc``, then the
other members sorted, nested members sorted, no whitespace), never the bytes received, and the
JWE's ``aad`` member is ignored. The decryption itself is jwcrypto's (an independent JOSE
library), fed that re-serialised header: a header the broker wrote in another order fails here
as it fails in the guest.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwcrypto import jwe, jwk

from broker.core.encoding import b64url_decode, b64url_encode

PREFIX = "/kbs/v0"
COOKIE = "kbs-session-id"
ERROR_TYPE = "https://github.com/confidential-containers/kbs/errors/"
CURVES = {"P-256": ec.SECP256R1(), "P-384": ec.SECP384R1(), "P-521": ec.SECP521R1()}
GuestKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def tee_key(kind: str = "P-256") -> tuple[GuestKey, dict[str, str]]:
    """A key pair as ``TeeKeyPair`` makes it, and its public half as the guest sends it."""
    if kind == "RSA":
        private_rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        numbers = private_rsa.public_key().public_numbers()
        return private_rsa, {
            "kty": "RSA",
            "alg": "RSA-OAEP-256",
            "n": b64url_encode(numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")),
            "e": b64url_encode(numbers.e.to_bytes(3, "big")),
        }
    private = ec.generate_private_key(CURVES[kind])
    point = private.public_key().public_numbers()
    size = (private.curve.key_size + 7) // 8
    return private, {
        "kty": "EC",
        "crv": kind,
        "alg": "ECDH-ES+A256KW",
        "x": b64url_encode(point.x.to_bytes(size, "big")),
        "y": b64url_encode(point.y.to_bytes(size, "big")),
    }


def jcs(value: Any) -> bytes:
    """RFC 8785 for the guest's runtime data (ASCII strings and objects only)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def report_data(tee_pubkey: dict[str, str], nonce: str, additional: str = "") -> bytes:
    """What the guest asks its attester to sign (``rcar_client.get_composite_evidence``)."""
    runtime = {"tee-pubkey": tee_pubkey, "nonce": nonce, "additional-evidence": additional}
    return hashlib.sha384(jcs(runtime)).digest()


def sample_evidence(data: bytes) -> dict[str, str]:
    """The sample attester's quote over ``data`` (``attester/src/sample``)."""
    return {"svn": "1", "report_data": base64.b64encode(data).decode()}


def guest_header(protected: str) -> str:
    """The protected header as the guest re-serialises it (kbs-types ``ProtectedHeader``:
    ``alg``, ``enc``, then the other members in serde_json's sorted map order), base64url."""
    header = json.loads(b64url_decode(protected))
    rest = {k: v for k, v in header.items() if k not in ("alg", "enc")}
    text = json.dumps({"alg": header["alg"], "enc": header["enc"]}, separators=(",", ":"))
    if rest:
        text = text[:-1] + "," + json.dumps(rest, sort_keys=True, separators=(",", ":"))[1:]
    return b64url_encode(text.encode())


def open_as_guest(answer: dict[str, Any], private: GuestKey) -> bytes:
    """The plaintext of a resource answer, decrypted as the guest does (module docstring).

    Raises:
        jwcrypto's errors: the answer does not decrypt as the guest decrypts it.
    """
    if set(answer) - {"protected", "encrypted_key", "iv", "ciphertext", "tag", "aad"}:
        raise ValueError("not a flattened JWE")
    flattened = {
        "protected": guest_header(answer["protected"]),
        **{k: answer[k] for k in ("encrypted_key", "iv", "ciphertext", "tag")},
    }
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    token = jwe.JWE()
    token.deserialize(json.dumps(flattened), key=jwk.JWK.from_pem(pem))
    return bytes(token.payload)


@dataclass
class Guest:
    """One guest against a broker at ``url``: its key, and the session cookie it was given."""

    url: str
    ssl: Any = None  # the client TLS context (or False)
    kind: str = "P-256"
    private: GuestKey = field(init=False)
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
