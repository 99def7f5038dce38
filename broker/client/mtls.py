"""mTLS between sealed runners on their X.509-SVIDs (issue 32): the peer's SPIFFE ID checked
against an allow-list (or a predicate) before any application byte.

Python's ``ssl`` module has no custom verify callback, so the check is split in two:

1. **In the handshake**, OpenSSL verifies the peer's chain (``CERT_REQUIRED``) against the trust
   bundle's roots only (``load_verify_locations(cadata=…)``; no system CAs), with the validity
   dates; ``check_hostname`` is off (an SVID names a SPIFFE ID, not a host). A peer with no
   certificate, an expired one, or one from another trust domain's CA fails the handshake.
2. **Right after the handshake**, before this side reads or writes any application byte, the
   peer's leaf (``getpeercert(binary_form=True)``) must carry exactly one ``spiffe://`` URI SAN
   that ``SpiffeContext.accept`` allows; otherwise the connection is aborted (``PeerRefused``).
   On a server this happens in the protocol's ``connection_made`` (``guarded``/``serve``), which
   asyncio calls only once the handshake is done and before any ``data_received``; on a client,
   in ``connect`` / ``SpiffeConnector`` before the request is written. A client may already
   have sent its first bytes (TLS 1.3 sends them after its own Finished): the server never reads
   them. With TLS 1.3, a client refused by the server's handshake (no or a bad certificate)
   learns it on its first read, as a TLS alert, not while connecting.
3. **Optionally** (``require_live_attestation=True`` on the ``Identity`` context), right after
   the SPIFFE ID check and still before any application byte, the attestation the peer's leaf
   was issued on (its ``ATTESTATION_OID`` extension) must be ``active`` at the broker
   (``BrokerClient.peer_attestation``): a server pauses reading until the broker answers.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import aiohttp
from aiohttp import web
from cryptography import x509

from broker.crypto.svid import attestation_of

SPIFFE_SCHEME = "spiffe://"
Allowed = Collection[str] | Callable[[str], bool]
Peer = bytes | x509.Certificate | ssl.SSLObject | ssl.SSLSocket | None
LiveCheck = Callable[
    [Peer], Awaitable[object]
]  # raises PeerRefused unless the peer's result is live


class PeerRefused(Exception):
    """The peer's certificate chained to the bundle, but its SPIFFE ID is not allowed (``code``
    ``peer_not_allowed``), it carries no single SPIFFE ID (``peer_no_spiffe_id``), or the
    attestation it was issued on is revoked (``peer_attestation_revoked``) or unknown to the
    broker: no extension, expired (``peer_attestation_unknown``)."""

    def __init__(self, code: str, message: str, spiffe_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.spiffe_id = spiffe_id


def acceptor(allowed: Allowed) -> Callable[[str], bool]:
    """A predicate from an allow-list of SPIFFE IDs (exact match), or the predicate given."""
    if callable(allowed):
        return allowed
    if isinstance(allowed, str):
        raise TypeError("allowed is a collection of SPIFFE IDs, not one string")
    ids = frozenset(allowed)
    for spiffe_id in ids:
        if not spiffe_id.startswith(SPIFFE_SCHEME):
            raise ValueError(f"not a SPIFFE ID: {spiffe_id!r}")
    return ids.__contains__


class SpiffeContext(ssl.SSLContext):
    """An ``ssl.SSLContext`` for mTLS on an SVID, with the SPIFFE ID check to run after the
    handshake (``accept``); made by ``Identity.server_context`` / ``client_context``."""

    accept: Callable[[str], bool]
    live: LiveCheck | None = None  # ``require_live_attestation``: run after ``accept``


def new_context(purpose: ssl.Purpose, bundle_pem: str, allowed: Allowed) -> SpiffeContext:
    """TLS 1.2+, the bundle's roots as the only trust anchors, a peer certificate required."""
    side = (
        ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    )
    context = SpiffeContext(side)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=bundle_pem)
    context.accept = acceptor(allowed)
    return context


def peer_spiffe_id(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str:
    """The one ``spiffe://`` URI SAN of the verified peer's leaf.

    Raises:
        PeerRefused: ``peer_no_spiffe_id`` (no TLS, no certificate, none or several URIs).
    """
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise PeerRefused("peer_no_spiffe_id", "the peer presented no certificate")
    try:
        san = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise PeerRefused("peer_no_spiffe_id", "the peer's certificate names no URI") from exc
    uris = san.value.get_values_for_type(x509.UniformResourceIdentifier)
    if len(uris) != 1 or not uris[0].startswith(SPIFFE_SCHEME):
        raise PeerRefused("peer_no_spiffe_id", "an SVID carries exactly one spiffe:// URI")
    return uris[0]


def peer_attestation_jti(peer: Peer) -> str:
    """The ``jti`` in the attestation extension of the peer's leaf (DER, a certificate, or a
    connection's SSL object).

    Raises:
        PeerRefused: ``peer_no_spiffe_id`` (no certificate), ``peer_attestation_unknown``.
    """
    if isinstance(peer, ssl.SSLObject | ssl.SSLSocket):
        peer = peer.getpeercert(binary_form=True)
    if not peer:
        raise PeerRefused("peer_no_spiffe_id", "the peer presented no certificate")
    try:
        certificate = (
            peer if isinstance(peer, x509.Certificate) else x509.load_der_x509_certificate(peer)
        )
        value = attestation_of(certificate)
        jti = json.loads(value)["jti"] if value is not None else None
    except (ValueError, TypeError, KeyError) as exc:
        raise PeerRefused("peer_attestation_unknown", "unreadable attestation extension") from exc
    if not isinstance(jti, str) or not jti:
        raise PeerRefused("peer_attestation_unknown", "the certificate names no attestation")
    return jti


def check_peer(transport: asyncio.BaseTransport, context: SpiffeContext) -> str:
    """The peer's SPIFFE ID if ``context`` allows it; else the transport is aborted.

    Raises:
        PeerRefused: as ``peer_spiffe_id``, or ``peer_not_allowed``.
    """
    try:
        spiffe_id = peer_spiffe_id(transport.get_extra_info("ssl_object"))
    except PeerRefused:
        _abort(transport)
        raise
    if not context.accept(spiffe_id):
        _abort(transport)
        raise PeerRefused("peer_not_allowed", f"{spiffe_id} is not allowed", spiffe_id)
    return spiffe_id


def _abort(transport: asyncio.BaseTransport) -> None:
    if isinstance(transport, asyncio.Transport):
        transport.abort()  # no close_notify, nothing flushed
    else:
        transport.close()


class _Guard(asyncio.Protocol):
    """Wraps a server protocol: the peer is checked before the wrapped one sees the transport."""

    def __init__(self, inner: asyncio.Protocol, context: SpiffeContext) -> None:
        self._inner = inner
        self._context = context
        self._open = False
        self.refused: PeerRefused | None = None
        self._checking: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        try:
            check_peer(transport, self._context)
        except PeerRefused as exc:
            self.refused = exc
            return
        live = self._context.live
        if live is None:
            self._open = True
            self._inner.connection_made(transport)
            return
        if isinstance(transport, asyncio.ReadTransport):
            transport.pause_reading()  # nothing reaches the application until the broker answers
        self._checking = asyncio.ensure_future(self._check_live(live, transport))

    async def _check_live(self, live: LiveCheck, transport: asyncio.BaseTransport) -> None:
        try:
            await live(transport.get_extra_info("ssl_object"))
        except (PeerRefused, RuntimeError) as exc:  # or BrokerClientError: fail closed
            self.refused = (
                exc
                if isinstance(exc, PeerRefused)
                else PeerRefused("peer_attestation_unknown", str(exc))
            )
            _abort(transport)
            return
        if transport.is_closing():
            return
        self._open = True
        self._inner.connection_made(transport)
        if isinstance(transport, asyncio.ReadTransport):
            transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._open:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._open else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._checking is not None:
            self._checking.cancel()  # gone while the broker was asked: nothing to hand over
        if self._open:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._open:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._open:
            self._inner.resume_writing()


def guarded(
    factory: Callable[[], asyncio.Protocol], context: SpiffeContext
) -> Callable[[], asyncio.Protocol]:
    """A protocol factory for ``loop.create_server(…, ssl=context)`` that checks each peer."""
    return lambda: _Guard(factory(), context)


async def serve(
    runner: web.BaseRunner, host: str, port: int, context: SpiffeContext
) -> asyncio.Server:
    """Serve an aiohttp ``AppRunner`` (set up) over mTLS, each peer checked (``guarded``)."""
    server = runner.server
    if server is None:
        raise RuntimeError("call runner.setup() first")
    loop = asyncio.get_running_loop()
    return await loop.create_server(guarded(server, context), host, port, ssl=context)


async def connect(
    host: str, port: int, context: SpiffeContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """A stream to a runner over mTLS: the reader, the writer and the peer's SPIFFE ID,
    checked before this returns (nothing has been written).

    Raises:
        PeerRefused: the server's SPIFFE ID is not allowed (or its attestation not live).
        BrokerClientError: ``require_live_attestation`` and the broker did not answer.
        ssl.SSLError: the server's chain does not verify against the bundle.
    """
    reader, writer = await asyncio.open_connection(host, port, ssl=context, server_hostname="")
    try:
        spiffe_id = await _checked(writer.transport, context)
    except Exception:
        writer.close()
        raise
    return reader, writer, spiffe_id


async def _checked(transport: asyncio.BaseTransport, context: SpiffeContext) -> str:
    """``check_peer``, then ``context.live`` (if set); the transport is aborted on a refusal."""
    spiffe_id = check_peer(transport, context)
    if context.live is not None:
        try:
            await context.live(transport.get_extra_info("ssl_object"))
        except Exception:
            _abort(transport)
            raise
    return spiffe_id


class SpiffeConnector(aiohttp.TCPConnector):
    """An aiohttp connector whose every new connection is checked (``check_peer``) before the
    request is written. Overrides aiohttp's ``_create_connection`` (tested with aiohttp 3.14)."""

    def __init__(self, context: SpiffeContext, **kwargs: Any) -> None:
        super().__init__(ssl=context, **kwargs)
        self._spiffe = context

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109
        protocol = await super()._create_connection(req, traces, timeout)
        transport = protocol.transport
        if transport is None:
            raise PeerRefused("peer_no_spiffe_id", "the connection closed in the handshake")
        await _checked(transport, self._spiffe)
        return protocol
