"""A round-robin HTTPS reverse proxy on 127.0.0.1: what a Kubernetes Service in front of several
replicas looks like to a client, made harder (each request, not each connection, goes to the next
replica in turn, so consecutive requests of one client never reach the same one).

It terminates TLS with the broker's own development certificate and forwards each request, body
and headers (less hop-by-hop ones), to the next upstream over HTTPS, answering what it answered.
"""

from __future__ import annotations

import itertools
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "content-length"}
)


@asynccontextmanager
async def round_robin_proxy(
    upstreams: Sequence[str], *, tls_dir: Path, port: int
) -> AsyncIterator[list[str]]:
    """Serve ``https://127.0.0.1:<port>`` until the block ends; yields the log of which
    upstream answered each request, in order (so a test can show both replicas served)."""
    client_tls = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(tls_dir / "server.pem", tls_dir / "server.key")
    turns = itertools.cycle(upstreams)
    answered: list[str] = []
    async with aiohttp.ClientSession(auto_decompress=False) as session:

        async def forward(request: web.Request) -> web.Response:
            upstream = next(turns)
            answered.append(upstream)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
            async with session.request(
                request.method,
                upstream + request.rel_url.path_qs,
                headers=headers,
                data=await request.read(),
                ssl=client_tls,
                allow_redirects=False,
            ) as reply:
                body = await reply.read()
                kept = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP}
                return web.Response(status=reply.status, body=body, headers=kept)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_tls)
        await site.start()
        try:
            yield answered
        finally:
            await runner.cleanup()
