"""mTLS between sealed runners on their X.509-SVIDs (issue 32): the peer's SPIFFE ID checked
against an allow-list (or a predicate) before any application byte, however the context is used.

Python's ``ssl`` module has no verify callback, so the checks run in two places:

1. **In the handshake, in the context itself.** OpenSSL verifies the peer's chain
   (``CERT_REQUIRED``) against the trust bundle's roots only (no system CAs), with its dates;
   ``check_hostname`` is off (an SVID names a SPIFFE ID, not a host). TLS 1.3 only, and no
   session tickets (``num_tickets = 0``, ``OP_NO_TICKET``): no session can be resumed. A
   ``SpiffeContext`` then makes every connection it wraps an SSL object of its own class
   (``sslobject_class`` for asyncio, uvloop and aiohttp; ``sslsocket_class`` for blocking
   sockets) whose ``do_handshake`` ends with ``spiffe_peer.verdict``: not a resumed session, a
   leaf valid now, one SPIFFE ID, allowed. A refusal raises ``HandshakeRefused`` (an
   ``ssl.SSLError``) from the handshake, so ``web.TCPSite(ssl_context=ctx)``,
   ``ClientSession(…, ssl=ctx)`` and ``asyncio.open_connection(…, ssl=ctx)`` enforce the
   allow-list as the helpers below do: the application never sees a refused peer.
   The same ``do_handshake`` first moves the connection to the context's ``current`` one (the
   newest certificate and trust bundle, ``Identity`` renewal): a context built before a CA
   rotation learns the new roots, and forgets retired ones, without being rebuilt.
2. **After the handshake, in the helpers only** (``serve``/``guarded``, ``connect``,
   ``SpiffeConnector``), for ``require_live_attestation``: the attestation the peer's leaf was
   issued on must be ``active`` at the broker, and the leaf one the broker issued on it
   (``BrokerClient.peer_attestation``), before any application byte. That check is a network
   call and cannot run inside the synchronous handshake: a context that requires it refuses
   every handshake it is used for directly (``peer_attestation_unchecked``), so it is never
   skipped by mistake; the helpers wrap with ``context.for_helpers()``, which lets the
   handshake through to their check. ``LiveCache`` keeps an ``active`` answer a few seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import datetime
from typing import Any

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from broker.client.spiffe_peer import (
    SPIFFE_SCHEME,
    Connection,
    HandshakeRefused,
    Peer,
    PeerRefused,
    peer_attestation_jti,
    peer_leaf,
    peer_spiffe_id,
    refusal_of,
    verdict,
)

__all__ = [
    "Allowed",
    "HandshakeRefused",
    "LiveCache",
    "LiveCheck",
    "Peer",
    "PeerRefused",
    "SpiffeConnector",
    "SpiffeContext",
    "acceptor",
    "check_peer",
    "connect",
    "guarded",
    "new_context",
    "peer_attestation_jti",
    "peer_spiffe_id",
    "serve",
]

Allowed = Collection[str] | Callable[[str], bool]
LiveCheck = Callable[[Peer], Awaitable[object]]  # raises PeerRefused unless the peer is live
Clock = Callable[[], float]
LIVE_CACHE_SECONDS = 5.0  # how long an ``active`` answer stands for new connections
LIVE_CACHE_ENTRIES = 1024  # distinct peer certificates remembered, oldest dropped first
_log = logging.getLogger(__name__)


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


def _checked_handshake(connection: Connection, handshake: Callable[[], None]) -> None:
    """``handshake()`` on the context's current certificate and bundle, then ``verdict``.

    Raises:
        HandshakeRefused: ``verdict`` refused, or a live check is required but no helper runs it.
        ssl.SSLError: OpenSSL's own failure (reported to ``on_refused`` with its code).
    """
    front = connection.__dict__.get("_spiffe_front")
    if front is None:  # the first call: nothing has been sent or read yet
        wrapping = connection.context
        if not isinstance(wrapping, SpiffeContext):
            raise HandshakeRefused(PeerRefused("peer_handshake_failed", "not a SPIFFE context"))
        front = wrapping.front
        connection.__dict__["_spiffe_front"] = front
        connection.__dict__["_spiffe_helper"] = wrapping.helper
        if front.current is not wrapping:
            connection.context = front.current
    try:
        handshake()
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        raise
    except ssl.SSLError as exc:
        front.report(refusal_of(exc))
        raise
    try:
        _judge(connection, front)
    except PeerRefused as refused:
        front.report(refused)
        raise HandshakeRefused(refused) from None


def _judge(connection: Connection, front: SpiffeContext) -> None:
    """``verdict``, and a live check left to the helpers only when they wrapped the connection.

    Raises:
        PeerRefused: as ``verdict``; ``peer_attestation_unchecked``.
    """
    verdict(connection, front.accept, front.clock())
    if front.live is not None and not connection.__dict__["_spiffe_helper"]:
        raise PeerRefused(
            "peer_attestation_unchecked",
            "require_live_attestation: serve with mtls.serve/guarded, connect with "
            "mtls.connect/SpiffeConnector",
        )


class _CheckedObject(ssl.SSLObject):
    """A TLS connection over memory BIOs (asyncio) whose handshake ends with the checks."""

    def do_handshake(self) -> None:
        _checked_handshake(self, super().do_handshake)


class _CheckedSocket(ssl.SSLSocket):
    """A blocking TLS socket whose handshake ends with the checks."""

    def do_handshake(self, block: bool = False) -> None:
        _checked_handshake(self, lambda: super(_CheckedSocket, self).do_handshake(block))


class SpiffeContext(ssl.SSLContext):
    """An ``ssl.SSLContext`` for mTLS on an SVID whose every handshake is checked (see the
    module). Made by ``Identity.server_context`` / ``client_context``; what a caller sets here
    (``accept``, ``live``, ``on_refused``) governs every connection made with it."""

    sslobject_class: type[ssl.SSLObject] = _CheckedObject
    sslsocket_class: type[ssl.SSLSocket] = _CheckedSocket
    accept: Callable[[str], bool]
    live: LiveCheck | None  # ``require_live_attestation``: run by the helpers after ``accept``
    on_refused: Callable[[PeerRefused], None] | None  # told of every refused handshake
    clock: Clock
    side: ssl.Purpose
    front: SpiffeContext  # the context the caller holds (itself, unless made by it)
    current: SpiffeContext  # the one holding the newest certificate and bundle
    helper: bool  # made by ``for_helpers``: the live check runs after the handshake
    _for_helpers: SpiffeContext | None

    def successor(self, bundle_pem: str) -> SpiffeContext:
        """A context for the next certificate (not loaded yet) and ``bundle_pem``; setting
        ``current`` to it once it is loaded makes new handshakes use it."""
        front = self.front
        return _make(front.side, bundle_pem, front.accept, front=front)

    def for_helpers(self) -> SpiffeContext:
        """The context the helpers wrap connections with: the same checks, and the live check
        left to them (for a context without ``live``, the same as this one)."""
        front = self.front
        if front._for_helpers is None:
            front._for_helpers = _make(front.side, None, front.accept, front=front, helper=True)
        return front._for_helpers

    def report(self, refused: PeerRefused) -> None:
        """Tell ``on_refused`` (a failing callback is logged, never raised into a handshake)."""
        if self.on_refused is None:
            return
        try:
            self.on_refused(refused)
        except Exception:  # noqa: BLE001 - a callback must not break a handshake
            _log.exception("on_refused failed for %s", refused.code)


def _make(
    purpose: ssl.Purpose,
    bundle_pem: str | None,
    accept: Callable[[str], bool],
    *,
    front: SpiffeContext | None = None,
    helper: bool = False,
) -> SpiffeContext:
    server = purpose is ssl.Purpose.CLIENT_AUTH
    context = SpiffeContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.options |= ssl.OP_NO_TICKET
    if server:
        context.num_tickets = 0  # no ticket, no resumption: every connection verifies its peer
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    if bundle_pem is not None:
        context.load_verify_locations(cadata=bundle_pem)
    context.accept = accept
    context.live = None
    context.on_refused = None
    context.clock = time.time
    context.side = purpose
    context.front = front or context
    context.current = context
    context.helper = helper
    context._for_helpers = None
    return context


def new_context(purpose: ssl.Purpose, bundle_pem: str, allowed: Allowed) -> SpiffeContext:
    """TLS 1.3 only, no session tickets, the bundle's roots as the only trust anchors, a peer
    certificate required, ``allowed`` checked in the handshake."""
    return _make(purpose, bundle_pem, acceptor(allowed))


class LiveCache:
    """A live check whose ``active`` answers are kept per peer certificate (its SHA-256) for
    ``seconds``, never past the attestation's ``expires_at``, for at most ``entries``
    certificates: a peer opening many connections costs one broker request every ``seconds``
    (a revocation reaches new connections within ``seconds``). Refusals are never kept."""

    def __init__(
        self,
        check: LiveCheck,
        *,
        seconds: float = LIVE_CACHE_SECONDS,
        entries: int = LIVE_CACHE_ENTRIES,
        clock: Clock = time.time,
    ) -> None:
        self._check = check
        self._seconds = seconds
        self._entries = entries
        self._clock = clock
        self._kept: OrderedDict[bytes, tuple[float, object]] = OrderedDict()

    async def __call__(self, peer: Peer) -> object:
        """The check's answer for ``peer``, kept or asked.

        Raises:
            PeerRefused: as the check (and ``peer_no_certificate``).
        """
        leaf = peer_leaf(peer)
        digest = hashlib.sha256(leaf.public_bytes(serialization.Encoding.DER)).digest()
        kept = self._kept.get(digest)
        if kept is not None and self._clock() < kept[0]:
            self._kept.move_to_end(digest)
            return kept[1]
        answer = await self._check(leaf)
        now = self._clock()
        until = min(now + self._seconds, _expiry(answer))
        if until > now:
            self._kept[digest] = (until, answer)
            self._kept.move_to_end(digest)
            while len(self._kept) > self._entries:
                self._kept.popitem(last=False)
        return answer


def _expiry(answer: object) -> float:
    """The answer's ``expires_at`` in unix seconds (RFC 3339), or 0 (never kept)."""
    value = answer.get("expires_at") if isinstance(answer, Mapping) else None
    try:
        return datetime.fromisoformat(value).timestamp() if isinstance(value, str) else 0.0
    except ValueError:
        return 0.0


def check_peer(transport: asyncio.BaseTransport, context: SpiffeContext) -> str:
    """The peer's SPIFFE ID, checked again (``verdict``) after the handshake that already
    checked it; else the transport is aborted.

    Raises:
        PeerRefused: as ``spiffe_peer.verdict``.
    """
    front = context.front
    try:
        return verdict(transport.get_extra_info("ssl_object"), front.accept, front.clock())
    except PeerRefused:
        _abort(transport)
        raise


def _abort(transport: asyncio.BaseTransport) -> None:
    if isinstance(transport, asyncio.Transport):
        transport.abort()  # no close_notify, nothing flushed
    else:
        transport.close()


class _Guard(asyncio.Protocol):
    """Wraps a server protocol: the peer's attestation (``live``) is checked before the wrapped
    one sees the transport (the handshake has checked everything else)."""

    def __init__(self, inner: asyncio.Protocol, context: SpiffeContext) -> None:
        self._inner = inner
        self._context = context.front
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
            self._context.report(self.refused)
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
    """A protocol factory for ``loop.create_server(…, ssl=context.for_helpers())`` that makes
    the live check (``require_live_attestation``) on each peer before the protocol sees it."""
    return lambda: _Guard(factory(), context)


async def serve(
    runner: web.BaseRunner, host: str, port: int, context: SpiffeContext
) -> asyncio.Server:
    """Serve an aiohttp ``AppRunner`` (set up) over mTLS, each peer checked (``guarded``)."""
    server = runner.server
    if server is None:
        raise RuntimeError("call runner.setup() first")
    loop = asyncio.get_running_loop()
    return await loop.create_server(guarded(server, context), host, port, ssl=context.for_helpers())


async def connect(
    host: str, port: int, context: SpiffeContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """A stream to a runner over mTLS: the reader, the writer and the peer's SPIFFE ID,
    checked before this returns (nothing has been written). A server that refuses this
    runner says so at the first read (TLS 1.3): a TLS alert or a reset.

    Raises:
        PeerRefused: the server was refused (the codes in ``spiffe_peer``).
        BrokerClientError: ``require_live_attestation`` and the broker did not answer.
    """
    try:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context.for_helpers(), server_hostname=""
        )
    except ssl.SSLError as exc:
        raise refusal_of(exc) from exc
    try:
        spiffe_id = await _checked(writer.transport, context)
    except Exception:
        writer.close()
        raise
    return reader, writer, spiffe_id


async def _checked(transport: asyncio.BaseTransport, context: SpiffeContext) -> str:
    """``check_peer``, then ``live`` (if set); the transport is aborted on a refusal."""
    spiffe_id = check_peer(transport, context)
    front = context.front
    if front.live is not None:
        try:
            await front.live(transport.get_extra_info("ssl_object"))
        except Exception as exc:
            if isinstance(exc, PeerRefused):
                front.report(exc)
            _abort(transport)
            raise
    return spiffe_id


class SpiffeConnector(aiohttp.TCPConnector):
    """An aiohttp connector for a ``SpiffeContext``: the handshake checks the server (as
    ``ClientSession(ssl=context)`` would), a refused handshake is raised as ``PeerRefused``, and
    ``require_live_attestation`` is checked before the request is written. That last step and
    the mapping override aiohttp's private ``_create_connection`` (tested with aiohttp 3.14);
    the allow-list does not depend on it."""

    def __init__(self, context: SpiffeContext, **kwargs: Any) -> None:
        super().__init__(ssl=context.for_helpers(), **kwargs)
        self._spiffe = context

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109
        try:
            protocol = await super()._create_connection(req, traces, timeout)
        except aiohttp.ClientSSLError as exc:
            cause = exc.__cause__
            if isinstance(cause, ssl.SSLError):
                raise refusal_of(cause) from exc
            raise
        transport = protocol.transport
        if transport is None:
            raise PeerRefused("peer_handshake_failed", "the connection closed in the handshake")
        await _checked(transport, self._spiffe)
        return protocol
