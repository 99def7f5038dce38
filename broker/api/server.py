"""The HTTP server around the app: slow-client limits and protocol errors in our error shape.

aiohttp handles a few things before any middleware runs, and its defaults do not suit a security
service: a request line or header it cannot parse is answered in plain text (one form echoes the
header back), a client may take forever to send its request head, and one address may open any
number of connections. ``BrokerRunner`` replaces aiohttp's per-connection handler with
``HardenedRequestHandler``:

* protocol errors are rendered as ``{"error": {"code", "message", "request_id"}}`` with a fixed
  message per status, never echoing input;
* a connection that has not delivered a complete request head within
  ``[server] header_timeout_seconds`` of its first byte (or of opening) is closed;
* idle keep-alive connections are closed after ``keepalive_timeout_seconds`` (aiohttp's own);
* at most ``max_connections_per_ip`` connections per remote address; the next is closed at once.

Request bodies have their own deadline (``body_timeout_seconds``, 408) in ``api.body``.
SIGHUP reloads the TLS certificate and key (``reload_server_certificate``) with the policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from broker.api.middleware import HTTP_CODES, REQUEST_ID_HEADER
from broker.config import ServerSettings
from broker.core.errors import ErrorCode

log = logging.getLogger(__name__)
PROTOCOL_MESSAGES = {
    400: "the request could not be parsed as HTTP/1.1",
    413: "the request head is too large",
    431: "the request headers are too large",
    500: "internal error",
}


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_seconds: float
    max_connections_per_ip: int

    @classmethod
    def from_settings(cls, server: ServerSettings) -> ConnectionLimits:
        return cls(server.header_timeout_seconds, server.max_connections_per_ip)


class HardenedServer(web.Server):
    """aiohttp's ``Server`` that builds ``HardenedRequestHandler`` connections."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.connections_by_ip: Counter[str] = Counter()

    def __call__(self) -> RequestHandler:
        return HardenedRequestHandler(self, loop=self._loop, **self._kwargs)


class HardenedRequestHandler(RequestHandler):
    """One connection: header deadline, per-address cap, JSON protocol errors."""

    def __init__(self, manager: HardenedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = manager.limits
        self._by_ip = manager.connections_by_ip
        self._peer_ip: str | None = None
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        if self._by_ip[ip] >= self._limits.max_connections_per_ip:
            log.warning("closing a connection from %s: over max_connections_per_ip", ip)
            self.force_close()
            transport.close()
            return
        self._peer_ip = ip
        self._by_ip[ip] += 1
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._peer_ip is not None:
            self._by_ip[self._peer_ip] -= 1
            if self._by_ip[self._peer_ip] <= 0:
                del self._by_ip[self._peer_ip]
            self._peer_ip = None
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._current_request is None and not self._messages:
            self._arm_head_timer()  # first bytes of a (next) request head
        super().data_received(data)
        if self._messages or self._current_request is not None:
            self._disarm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self._loop.call_later(
            self._limits.header_timeout_seconds, self._head_deadline
        )

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self._current_request is None and not self._messages and self.transport is not None:
            log.info("closing a connection from %s: no request head in time", self._peer_ip)
            self.force_close()
            self.transport.close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's protocol-level errors (bad request line, headers) in our error shape."""
        if status >= 500:
            log.error("protocol error from %s", request.remote, exc_info=exc)
        else:
            log.info("protocol error %s from %s: %s", status, request.remote, exc)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        request_id = uuid.uuid4().hex
        code = HTTP_CODES.get(
            status, ErrorCode.INTERNAL if status >= 500 else ErrorCode.BAD_REQUEST
        )
        body = {
            "error": {
                "code": code.value,
                "message": PROTOCOL_MESSAGES.get(status, "the request was refused"),
                "request_id": request_id,
            }
        }
        response = web.Response(
            status=status, text=json.dumps(body), content_type="application/json"
        )
        response.headers[REQUEST_ID_HEADER] = request_id
        response.force_close()
        return response


class BrokerRunner(web.AppRunner):
    """``AppRunner`` whose connections are ``HardenedRequestHandler``s."""

    def __init__(self, app: web.Application, server: ServerSettings, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", server.keepalive_timeout_seconds)
        kwargs.setdefault("access_log", None)
        # Bodies are identity-encoded only (body.py refuses the rest with 415): the parser must
        # not decompress them first. It used to, and with uvloop a bad deflate body closed the
        # connection before the handler could answer (found running the hostile suite against
        # `broker serve --workers 2`); it is also a decompression bomb nobody needs.
        kwargs.setdefault("auto_decompress", False)
        super().__init__(app, **kwargs)
        self._limits = ConnectionLimits.from_settings(server)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return HardenedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            limits=self._limits,
            **plain._kwargs,
        )


def reload_server_certificate(context: ssl.SSLContext, cert: Path, key: Path) -> bool:
    """SIGHUP: serve the certificate and key now in ``cert`` and ``key`` to new connections.

    Each file is read once; those bytes are checked (the key must match the certificate) in a
    throwaway context and then loaded, from the same in-memory copies, into the live context, so
    a file swapped between the check and the load cannot go live. A pair that does not load
    leaves the current certificate serving and says why in the log.

    Returns:
        Whether the new pair is now served.
    """
    try:
        pem = cert.read_bytes(), key.read_bytes()
        with _memory_file(pem[0]) as cert_path, _memory_file(pem[1]) as key_path:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_path, key_path)
            context.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        log.error("TLS certificate %s not reloaded (the old one keeps serving): %s", cert, exc)  # noqa: TRY400 - one line, no traceback
        return False
    log.warning("TLS certificate reloaded from %s", cert)
    return True


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path to ``data`` that no other process can change (a memfd of this process)."""
    fd = os.memfd_create("broker-tls", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
