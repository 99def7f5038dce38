"""Fetch the broker's attestation with the certificate of the connection it came on, and pin.

``fetch_attestation`` opens one new TLS connection (the usual CA and host name checks), reads
``GET /.well-known/broker-attestation`` and keeps the DER certificate the server presented on
that connection, so that ``broker_identity.verify_broker_attestation`` can compare its key with
the attested TLS key. ``pin`` then gives the ``aiohttp.Fingerprint`` every later request of the
client uses: a connection to any other certificate fails before a byte is sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from datetime import datetime

import aiohttp

from broker.client.broker_identity import (
    MAX_ATTESTATION_BYTES,
    BrokerIdentity,
    BrokerNotAttested,
    VerifiedBrokerIdentity,
    verify_broker_attestation,
)

ATTESTATION_PATH = "/.well-known/broker-attestation"


class _CertificateCapture(aiohttp.Fingerprint):
    """Given to the connector as its ``ssl`` pin, it compares nothing: aiohttp calls ``check``
    with the transport of each new connection (after the request's own context verified the
    chain and host name), and it keeps the certificate the server presented there (and the
    transport, which ``fetch_attestation`` closes itself: the one-shot connection must not
    wait out a TLS shutdown in an event loop that may end next, as the CLI's does)."""

    def __init__(self) -> None:
        super().__init__(bytes(32))
        self.certificates: list[bytes] = []
        self.transports: list[asyncio.Transport] = []

    def check(self, transport: asyncio.Transport) -> None:
        self.transports.append(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.certificates.append(ssl_object.getpeercert(binary_form=True))


async def fetch_attestation(
    base_url: str,
    ssl_context: ssl.SSLContext | bool,
    *,
    timeout_seconds: float,
    tls_trust: str = "ca",
) -> tuple[bytes, bytes]:
    """The endpoint's answer and the server certificate (DER) of the connection it came on.

    ``tls_trust="attestation"``: the certificate is not checked against a CA or the host name
    here (a sealed broker's is self-signed); the caller must then accept it only if the
    attestation binds its key (``verify_broker_attestation`` check 10), and pin it.

    Raises:
        BrokerNotAttested: ``response`` (not HTTP 200, not TLS).
        aiohttp.ClientError, ssl.SSLError, TimeoutError: the broker was not reached.
    """
    url = base_url.rstrip("/") + ATTESTATION_PATH
    if tls_trust == "attestation":  # the key is checked against the token instead
        ssl_context = ssl.create_default_context()
        ssl_context.check_hostname = False
        ssl_context.verify_mode = ssl.CERT_NONE
    elif not isinstance(ssl_context, ssl.SSLContext):  # the usual checks, never none at all
        ssl_context = ssl.create_default_context()
    capture = _CertificateCapture()
    connector = aiohttp.TCPConnector(ssl=capture, force_close=True)  # one connection, ours
    async with (
        aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_seconds)
        ) as session,
        session.get(url, ssl=ssl_context, allow_redirects=False) as response,
    ):
        body = await response.content.read(MAX_ATTESTATION_BYTES + 1)
        status = response.status
    for transport in capture.transports:
        transport.abort()
    await asyncio.sleep(0)  # one turn of the loop: the aborted socket closes
    if len(capture.certificates) != 1 or not capture.certificates[0]:
        raise BrokerNotAttested("response", "the broker's attestation did not come over TLS")
    if status != 200:
        raise BrokerNotAttested("response", f"GET {ATTESTATION_PATH}: HTTP {status}")
    return body, capture.certificates[0]


async def attest_broker(
    base_url: str,
    identity: BrokerIdentity,
    ssl_context: ssl.SSLContext | bool,
    *,
    now: datetime,
    timeout_seconds: float,
) -> tuple[VerifiedBrokerIdentity, aiohttp.Fingerprint]:
    """Fetch and verify the broker's attestation; the verdict and the certificate pin.

    Raises:
        BrokerNotAttested: a failed check (``broker_identity`` checklist).
        aiohttp.ClientError, ssl.SSLError, TimeoutError: the broker was not reached.
    """
    body, cert = await fetch_attestation(
        base_url, ssl_context, timeout_seconds=timeout_seconds, tls_trust=identity.tls_trust
    )
    verified = verify_broker_attestation(body, cert, identity, now=now)
    return verified, aiohttp.Fingerprint(hashlib.sha256(cert).digest())
