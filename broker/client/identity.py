"""A runner's workload identity (issue 32): an X.509-SVID on its attestation result.

``await attestation.identity()`` makes a P-256 key in this process (never the PoP key), sends a
CSR for it to ``POST /v1/identity`` under the attestation's DPoP proof, and checks that the leaf
answered certifies that key; the trust bundle comes from ``GET /v1/identity/bundle`` over the
client's own (attested, pinned) broker connection. The private key has no attribute, accessor
or repr: it leaves the object only into the ``ssl.SSLContext`` objects it builds.

**How the key gets into OpenSSL.** ``SSLContext.load_cert_chain`` reads files only (no
in-memory PEM). On a worker thread, in one function: the key is encrypted (PKCS#8, AES-256, a
random 32-byte password that exists only in memory) and written with the chain to a file made
0600 in a fresh 0700 directory, loaded with that password, and the directory removed in a
``finally``, whatever failed (a write error, a cancelled caller: the thread still finishes and
cleans up). The plaintext key never reaches a disk; the encrypted file lives for one load.

**Renewal.** ``fresh()`` (called when a context is built, and by ``keep_renewed``) asks for a new
certificate, with a new key, once two thirds of the current one's lifetime have passed, fetches
the trust bundle again, and gives every context already built a ``current`` successor holding
both (``mtls.SpiffeContext``): new handshakes present the new certificate and trust the new
bundle, a rotated root included. A revoked attestation gets no certificate: the broker's
``BrokerClientError`` (``attestation_revoked``) is raised and the current certificate is kept
until it expires on its own. ``keep_renewed`` retries any other failure (a 503, a 429, the
broker unreachable) with backoff until the certificate expires.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import ssl
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client.mtls import (
    LIVE_CACHE_SECONDS,
    Allowed,
    LiveCache,
    LiveCheck,
    SpiffeContext,
    new_context,
)
from broker.client.sdk import BrokerClientError

RENEW_AT = 2 / 3  # of a certificate's lifetime
# The broker's refusals that another attempt cannot change: ``keep_renewed`` raises them at once.
FINAL_CODES = frozenset({"attestation_revoked", "identity_denied", "identity_not_allowed"})
FIRST_RETRY_SECONDS = 1.0  # ``keep_renewed``'s first wait after a failed renewal, then doubled
MAX_RETRY_SECONDS = 30.0
Issue = Callable[[str], Awaitable[dict[str, Any]]]  # CSR PEM → the 201 answer
Bundle = Callable[[], Awaitable[str]]  # → the bundle's PEM


@dataclass(frozen=True)
class Svid:
    """One certificate this identity holds (public parts only)."""

    spiffe_id: str
    chain_pem: str  # the leaf, then the intermediates
    not_before: float  # unix seconds
    not_after: float
    serial: str
    attestation: str  # the jti of the attestation it was issued on
    received_at: float = 0.0  # unix seconds, when the broker answered it

    @property
    def renew_after(self) -> float:
        """Two thirds into its life, counted from when it came (the broker backdates
        ``not_before`` for peers whose clocks lag: counting from there would renew early)."""
        start = max(self.not_before, self.received_at)
        return start + (self.not_after - start) * RENEW_AT


class Identity:
    """An SVID and its private key; builds mTLS contexts (``broker.client.mtls``)."""

    def __init__(self, issue: Issue, bundle: Bundle, peer_check: LiveCheck | None = None) -> None:
        self._issue = issue
        self._bundle = bundle
        self._peer_check = peer_check
        self.__key: ec.EllipticCurvePrivateKey | None = None
        self._svid: Svid | None = None
        self._bundle_pem = ""
        self._contexts: weakref.WeakSet[SpiffeContext] = weakref.WeakSet()
        self._renewing = asyncio.Lock()
        self.renewals = 0

    def __repr__(self) -> str:
        svid = self._svid
        return "Identity(none)" if svid is None else f"Identity({svid.spiffe_id!r}, {svid.serial})"

    @property
    def svid(self) -> Svid:
        if self._svid is None:
            raise RuntimeError("no certificate yet: await attestation.identity()")
        return self._svid

    @property
    def spiffe_id(self) -> str:
        return self.svid.spiffe_id

    @property
    def bundle_pem(self) -> str:
        return self._bundle_pem

    async def renew(self) -> None:
        """A new key and certificate now, and the bundle again: every context built so far
        gets a successor holding both, which its next handshakes use.

        Raises:
            BrokerClientError: the broker refused (``attestation_revoked``, ``identity_denied``,
                …): nothing changes, the current certificate stays until it expires.
        """
        async with self._renewing:
            await self._renew()

    async def _renew(self) -> None:
        """Under ``self._renewing``."""
        key = ec.generate_private_key(ec.SECP256R1())
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .sign(key, hashes.SHA256())
            .public_bytes(serialization.Encoding.PEM)
            .decode("ascii")
        )
        answer = await self._issue(csr)
        svid = _svid_of(answer, key, time.time())
        bundle_pem = await self._bundle()
        successors = []
        for context in list(self._contexts):  # loaded before any is used: all or none change
            successor = context.successor(bundle_pem)
            await _load(successor, svid.chain_pem, key)
            successors.append((context, successor))
        self.__key, self._svid, self._bundle_pem = key, svid, bundle_pem
        for context, successor in successors:
            context.current = successor
        self.renewals += 1

    async def fresh(self) -> Svid:
        """The current certificate, renewed first if two thirds of its life have passed.

        Raises:
            BrokerClientError: as ``renew``.
        """
        if self._due():
            async with self._renewing:
                if self._due():  # not renewed meanwhile by a concurrent caller
                    await self._renew()
        return self.svid

    def _due(self) -> bool:
        return self._svid is None or time.time() >= self._svid.renew_after

    async def keep_renewed(
        self,
        *,
        first_retry_seconds: float = FIRST_RETRY_SECONDS,
        max_retry_seconds: float = MAX_RETRY_SECONDS,
    ) -> None:
        """Renew at two thirds of each certificate's life, forever (run it as a task). A failed
        renewal is tried again after ``first_retry_seconds``, doubling up to
        ``max_retry_seconds`` (with jitter), until the current certificate expires.

        Raises:
            BrokerClientError: at once for ``FINAL_CODES`` (``attestation_revoked``,
                ``identity_denied``, ``identity_not_allowed``); any other error once the
                current certificate has expired without a renewal.
        """
        delay = first_retry_seconds
        while True:
            await asyncio.sleep(max(0.0, self.svid.renew_after - time.time()))
            try:
                await self.fresh()
            except BrokerClientError as exc:
                left = self.svid.not_after - time.time()
                if exc.code in FINAL_CODES or left <= 0:
                    raise
                jitter = 0.5 + secrets.randbelow(501) / 1000  # 0.5 to 1.0 of the delay
                await asyncio.sleep(min(delay * jitter, left))
                delay = min(delay * 2, max_retry_seconds)
                continue
            delay = first_retry_seconds

    async def server_context(
        self,
        *,
        allowed: Allowed,
        require_live_attestation: bool = False,
        live_cache_seconds: float = LIVE_CACHE_SECONDS,
    ) -> SpiffeContext:
        """A server context: this SVID, client certificates required, ``allowed`` checked in
        every handshake (``mtls``); with ``require_live_attestation``, then the peer's
        attestation (``BrokerClient.peer_attestation``, an ``active`` answer kept
        ``live_cache_seconds``) by ``mtls.serve``/``mtls.guarded`` before any read."""
        return await self._context(
            ssl.Purpose.CLIENT_AUTH, allowed, require_live_attestation, live_cache_seconds
        )

    async def client_context(
        self,
        *,
        allowed: Allowed,
        require_live_attestation: bool = False,
        live_cache_seconds: float = LIVE_CACHE_SECONDS,
    ) -> SpiffeContext:
        """A client context: this SVID, the server's chain verified against the bundle and
        ``allowed`` checked in every handshake; with ``require_live_attestation``, the peer's
        attestation by ``mtls.connect``/``mtls.SpiffeConnector`` before any write."""
        return await self._context(
            ssl.Purpose.SERVER_AUTH, allowed, require_live_attestation, live_cache_seconds
        )

    async def _context(
        self, purpose: ssl.Purpose, allowed: Allowed, live: bool, live_cache_seconds: float
    ) -> SpiffeContext:
        if live and self._peer_check is None:
            raise ValueError("require_live_attestation needs an identity made by a broker client")
        await self.fresh()
        async with self._renewing:  # the key and chain loaded are the ones now held
            context = new_context(purpose, self._bundle_pem, allowed)
            if live and self._peer_check is not None:
                context.live = LiveCache(self._peer_check, seconds=live_cache_seconds)
            key = self.__key
            if key is None:
                raise RuntimeError("no key")
            await _load(context, self.svid.chain_pem, key)
            self._contexts.add(context)
        return context


async def _load(context: ssl.SSLContext, chain_pem: str, key: ec.EllipticCurvePrivateKey) -> None:
    """``key`` and ``chain_pem`` into ``context`` (``_load_in_thread``, on a worker thread)."""
    await asyncio.to_thread(_load_in_thread, context, chain_pem.encode("ascii"), key)


def _load_in_thread(context: ssl.SSLContext, chain: bytes, key: ec.EllipticCurvePrivateKey) -> None:
    """Encrypt, write (a new 0700 directory, ``svid.pem`` 0600), load, and remove whatever
    happens: one function, so that a cancelled caller cannot leave the directory behind."""
    password = secrets.token_bytes(32)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password),
    )
    folder = Path(tempfile.mkdtemp(prefix="svid-"))
    try:
        path = folder / "svid.pem"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(chain + encrypted)
        context.load_cert_chain(path, password=password)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _svid_of(answer: dict[str, Any], key: ec.EllipticCurvePrivateKey, received_at: float) -> Svid:
    """The answer's chain, its leaf checked to certify ``key`` and name the SPIFFE ID given.

    Raises:
        BrokerClientError: ``bad_response``.
    """
    try:
        chain = x509.load_pem_x509_certificates(str(answer["certificates"]).encode())
        leaf = chain[0]
        public = leaf.public_key()
        uris = leaf.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value.get_values_for_type(x509.UniformResourceIdentifier)
    except (KeyError, IndexError, ValueError, x509.ExtensionNotFound) as exc:
        raise BrokerClientError(201, "bad_response", "no certificate chain", {}) from exc
    mine = key.public_key().public_numbers()
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.public_numbers() != mine:
        raise BrokerClientError(201, "bad_response", "the leaf does not certify our key", {})
    if uris != [answer.get("spiffe_id")]:
        raise BrokerClientError(201, "bad_response", "the leaf names another SPIFFE ID", {})
    return Svid(
        spiffe_id=uris[0],
        chain_pem="".join(
            c.public_bytes(serialization.Encoding.PEM).decode("ascii") for c in chain
        ),
        not_before=leaf.not_valid_before_utc.timestamp(),
        not_after=leaf.not_valid_after_utc.timestamp(),
        serial=str(answer.get("serial", format(leaf.serial_number, "x"))),
        attestation=str(answer.get("attestation", "")),
        received_at=received_at,
    )
