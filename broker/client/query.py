"""Encrypted queries and answers between clients and attested runners.

A client fetches a query key's public half from the broker, checks the broker's signed
statement against the statement key it pinned, and seals its query with HPKE to that key. Only a
runner the policy allowed holds the private half (released by the broker), opens the query and
seals the answer so that only that client can read it:

    client = QueryClient("https://broker.example", statement_key=pinned, ssl_context=ctx)
    public = await client.public_key("queries/chat")
    message, response_context = seal_query(public, b"what is in this contract?", aad=b"session-7")
    ...                                             # message travels to the runner
    query, reply = open_query(QueryPrivateKey.from_release(released), message, aad=b"session-7")
    answer = reply.seal_response(b"...")            # answer travels back
    response_context.open_response(answer)

Messages: ``query = enc || ct`` with ``ct`` from an HPKE base-mode context whose ``info`` names
the key and version (``"broker query request" 0x00 {key, kem, version}``) and whose AAD is the
caller's ``aad``. Answers follow RFC 9458 §4.4: ``secret = Export("broker query response",
max(Nn, Nk))``, ``response_nonce`` random of that length, ``prk = Extract(enc ||
response_nonce, secret)``, ``key = Expand(prk, "key", Nk)``, ``nonce = Expand(prk, "nonce",
Nn)``, ``answer = response_nonce || AES-256-GCM(key, nonce, answer, aad = "")``. Only the client
that sealed the query knows ``secret``, and ``enc`` in the salt ties an answer to its query, so an
answer cannot be read by others nor replayed onto another query.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from broker.client.sdk import reaching
from broker.core.protocol import Algorithm
from broker.crypto import hpke
from broker.crypto.hpke import HpkeError
from broker.crypto.hpke_context import (
    ENC_BYTES,
    NK,
    NN,
    hkdf_expand,
    hkdf_extract,
    setup_recipient,
    setup_sender,
)
from broker.crypto.query import KEM_OF_ALGORITHM, QueryPublicKey, StatementError, verify_statement

REQUEST_LABEL = b"broker query request"
RESPONSE_LABEL = b"broker query response"
RESPONSE_SECRET_BYTES = max(NN, NK)
RESPONSE_NONCE_BYTES = max(NN, NK)


class QueryError(ValueError):
    """A query or answer does not open (wrong key, changed, or meant for another exchange)."""


def request_info(key: str, version: int, kem: str) -> bytes:
    return REQUEST_LABEL + b"\0" + hpke.context_info({"key": key, "kem": kem, "version": version})


@dataclass(frozen=True)
class QueryPrivateKey:
    """A released query key: its name, version, KEM and the secret as the broker stores it."""

    key: str
    version: int
    kem: str
    secret: bytes = field(repr=False)

    @classmethod
    def from_release(cls, released: Any) -> QueryPrivateKey:
        """From ``BrokerClient.release(…)``'s answer for a query key."""
        kem = KEM_OF_ALGORITHM[Algorithm(released.algorithm)]
        return cls(key=released.key, version=released.version, kem=kem, secret=released.dek)


@dataclass
class ResponseContext:
    """What one side keeps from a query to handle its answer (RFC 9458 §4.4)."""

    secret: bytes = field(repr=False)
    enc: bytes

    def _keys(self, response_nonce: bytes) -> tuple[AESGCM, bytes]:
        prk = hkdf_extract(self.enc + response_nonce, self.secret)
        return AESGCM(hkdf_expand(prk, b"key", NK)), hkdf_expand(prk, b"nonce", NN)

    def seal_response(self, plaintext: bytes) -> bytes:
        """The runner seals the answer to the client that sent the query."""
        response_nonce = os.urandom(RESPONSE_NONCE_BYTES)
        aead, nonce = self._keys(response_nonce)
        return response_nonce + aead.encrypt(nonce, plaintext, b"")

    def open_response(self, message: bytes) -> bytes:
        """The client opens the answer to its query.

        Raises:
            QueryError: for an answer to another query, a changed one, or garbage.
        """
        if len(message) < RESPONSE_NONCE_BYTES + 16:
            raise QueryError("the answer is too short")
        aead, nonce = self._keys(message[:RESPONSE_NONCE_BYTES])
        try:
            return aead.decrypt(nonce, message[RESPONSE_NONCE_BYTES:], b"")
        except InvalidTag as exc:
            raise QueryError("the answer does not open: changed, or not for this query") from exc


def seal_query(
    public: QueryPublicKey, plaintext: bytes, aad: bytes = b""
) -> tuple[bytes, ResponseContext]:
    """Seal a query to a verified query key; keep the context to open the answer."""
    if not public.public_raw:
        raise QueryError("the public key has no raw encoding (use verify_statement)")
    try:
        context = setup_sender(
            public.kem, public.public_raw, request_info(public.key, public.version, public.kem)
        )
    except HpkeError as exc:
        raise QueryError(str(exc)) from exc
    ciphertext = context.seal(aad, plaintext)
    secret = context.export(RESPONSE_LABEL, RESPONSE_SECRET_BYTES)
    return context.enc + ciphertext, ResponseContext(secret=secret, enc=context.enc)


def open_query(
    private: QueryPrivateKey, message: bytes, aad: bytes = b""
) -> tuple[bytes, ResponseContext]:
    """Open a query with a released query key; the context seals the answer.

    Raises:
        QueryError: for a query to another key or version, a changed one, or another ``aad``.
    """
    size = ENC_BYTES[private.kem]
    if len(message) < size + 16:
        raise QueryError("the query is too short")
    enc, ciphertext = message[:size], message[size:]
    try:
        context = setup_recipient(
            private.kem,
            private.secret,
            enc,
            request_info(private.key, private.version, private.kem),
        )
        plaintext = context.open(aad, ciphertext)
    except HpkeError as exc:
        raise QueryError("the query does not open with this key") from exc
    secret = context.export(RESPONSE_LABEL, RESPONSE_SECRET_BYTES)
    return plaintext, ResponseContext(secret=secret, enc=enc)


class QueryClient:
    """Fetches query keys from a broker and verifies them against a pinned statement key."""

    def __init__(
        self,
        base_url: str,
        *,
        statement_key: ec.EllipticCurvePublicKey,
        ssl_context: ssl.SSLContext | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._statement_key = statement_key
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def public_key(self, name: str, version: int | None = None) -> QueryPublicKey:
        """``GET /v1/keys/{name}/public``, its statement verified.

        Raises:
            StatementError: when the statement does not verify or names another key/version.
            QueryError: when the broker does not answer with a statement.
            BrokerClientError: when the broker is not reached (``TRANSPORT_CODES``).
        """
        url = f"{self._base_url}/v1/keys/{name}/public"
        params = {} if version is None else {"version": str(version)}
        with reaching(url):
            async with (
                aiohttp.ClientSession(timeout=self._timeout) as session,
                session.get(url, params=params, ssl=self._ssl) as response,
            ):
                body = await response.json(content_type=None)
            if response.status != 200 or not isinstance(body, dict):
                code = body.get("error", {}).get("code") if isinstance(body, dict) else None
                raise QueryError(f"no query key {name!r}: {response.status} {code}")
        public = verify_statement(
            str(body.get("statement", "")), self._statement_key, now=datetime.now(UTC)
        )
        if public.key != name or (version is not None and public.version != version):
            raise StatementError("the statement is for another key or version")
        return public


__all__ = [
    "QueryClient",
    "QueryError",
    "QueryPrivateKey",
    "ResponseContext",
    "open_query",
    "seal_query",
]
