"""Every replica's log, reachable by its origin through any replica.

Each replica keeps its own log under its own origin ``<prefix><replica id>`` (``[audit] origin``
ends with ``/{replica}``). A public log request (key, checkpoint, proofs) may name the log it is
for (``?origin=``); the replica that answers serves its own, and forwards a request for another
replica's log of this deployment to that replica (``[audit] peer_url`` with the replica id put
in), once: a forwarded request carries ``Broker-Log-Forwarded`` and is never forwarded again.
Nothing forwarded needs trusting the forwarder: checkpoints are signed notes and proofs verify
against them (a forwarder can refuse to answer, never forge one).

Only names of this deployment are forwarded (the replica id must be one DNS label: letters,
digits and inner ``-``, as a StatefulSet pod's name is, so a client cannot pick host names of
several labels under ``peer_url``'s domain), only to ``peer_url``'s host pattern, only for the
read-only public paths, with a timeout and a bounded answer.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from broker.config import Settings, origin_prefix
from broker.core.errors import ConfigError, ErrorCode, NotFound, UpstreamError

FORWARDED = "Broker-Log-Forwarded"
DNS_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # RFC 1123 §2.1
MAX_FORWARDED_BYTES = 1024 * 1024
FORWARD_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Forwarded:
    status: int
    body: bytes
    content_type: str


class LogPeers:
    """Which log a request names, and the replica that holds it."""

    def __init__(self, settings: Settings, session: aiohttp.ClientSession) -> None:
        """Raises: ConfigError when ``[audit] peer_ca`` is not a readable CA file."""
        self.origin = settings.audit.origin
        self._prefix = origin_prefix(self.origin, settings.server.replica_id)
        self._peer_url = settings.audit.peer_url
        ca = settings.audit.peer_ca
        try:
            self._ssl = ssl.create_default_context(cafile=None if ca is None else str(ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("audit.peer_ca", f"not a readable CA file: {exc}") from exc
        self._session = session

    def named(self, request: web.Request) -> str | None:
        """The replica id of the other log the request names; ``None``: this replica's own.

        Raises:
            NotFound: no log of that origin in this deployment (or a forwarded request that
                is not for this replica).
        """
        origin = request.query.get("origin")
        if origin is None or origin == self.origin:
            return None
        replica = None
        if self._prefix is not None and origin.startswith(self._prefix):
            replica = origin.removeprefix(self._prefix)
        if (
            replica is None
            or not DNS_LABEL.fullmatch(replica)
            or self._peer_url is None
            or FORWARDED in request.headers
        ):
            raise NotFound(f"no log of origin {origin!r} is served here")
        return replica

    async def forward(self, request: web.Request, replica: str) -> web.Response:
        """The peer's answer to the same public request, as it answered.

        Raises:
            UpstreamError: ``log_peer_unavailable`` when the peer does not answer.
        """
        assert self._peer_url is not None  # noqa: S101 - named() checked it
        url = self._peer_url.replace("{replica}", replica).rstrip("/") + request.path
        try:
            answer = await self._get(url, request.query_string)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise UpstreamError(
                f"the log of replica {replica} cannot be read from it now",
                code=ErrorCode.LOG_PEER_UNAVAILABLE,
            ) from exc
        return web.Response(
            status=answer.status, body=answer.body, content_type=answer.content_type
        )

    async def _get(self, url: str, query: str) -> Forwarded:
        async with self._session.get(
            url + "?" + query,
            headers={FORWARDED: "1"},
            ssl=self._ssl,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_SECONDS),
        ) as reply:
            body = await reply.content.read(MAX_FORWARDED_BYTES + 1)
            if (
                len(body) > MAX_FORWARDED_BYTES
                or reply.status >= 500
                or reply.status in (301, 302, 307, 308)
            ):
                raise ValueError(f"peer answered {reply.status}")
            return Forwarded(reply.status, body, reply.content_type)
