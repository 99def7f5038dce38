"""A command that sends a token (``broker audit monitor --rules --token-file``, ``broker keys
create --url``) follows no redirect, pinned or not (``broker/cli/broker_pin.BrokerConnection``):
urllib would send the ``Authorization`` header on to wherever a redirect points — another host,
plain HTTP. A loopback HTTPS stand-in redirects to a loopback plain-HTTP collector, which must
see nothing; a request without a token still follows it."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web

from broker.cli.broker_pin import BrokerConnection
from broker.dev.tls import make_dev_tls

TOKEN = "redirect-test-token"


async def _serve(
    app: web.Application, ssl_context: ssl.SSLContext | None
) -> tuple[str, web.AppRunner]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = runner.addresses[0][1]
    return f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}", runner


def _contexts(directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A loopback server's TLS context and a client's that trusts it. Blocking (files)."""
    tls = make_dev_tls(directory, now=datetime.now(UTC))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tls.server_cert, tls.server_key)
    return server, ssl.create_default_context(cafile=str(tls.ca_cert))


@pytest.fixture
async def redirecting(tmp_path: Path) -> AsyncIterator[tuple[str, ssl.SSLContext, list[str]]]:
    """The stand-in's URL, a client context trusting it, and the collector's received headers
    (``Authorization`` values, or ``-`` for a request without one)."""
    server, client = await asyncio.to_thread(_contexts, tmp_path / "tls")
    received: list[str] = []

    async def collect(request: web.Request) -> web.Response:
        received.append(request.headers.get("Authorization", "-"))
        return web.json_response({"entries": []})

    collector = web.Application()
    collector.router.add_get("/{tail:.*}", collect)
    plain, collector_runner = await _serve(collector, None)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(plain + request.path_qs)

    stand_in = web.Application()
    stand_in.router.add_get("/{tail:.*}", redirect)
    url, stand_in_runner = await _serve(stand_in, server)
    try:
        yield url, client, received
    finally:
        await stand_in_runner.cleanup()
        await collector_runner.cleanup()


async def test_a_request_with_a_token_follows_no_redirect(
    redirecting: tuple[str, ssl.SSLContext, list[str]],
) -> None:
    url, context, received = redirecting
    broker = BrokerConnection(url, 10, context)
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def with_token() -> None:
        with broker.open("/v1/log/entries?start=0&end=1", headers=headers):
            pass

    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(with_token)
    assert refused.value.code == 302
    refused.value.close()
    assert received == []  # the token went nowhere else

    def without_token() -> bytes:
        with broker.open("/v1/log/checkpoint") as response:
            return bytes(response.read())

    assert await asyncio.to_thread(without_token) == b'{"entries": []}'
    assert received == ["-"]  # a request without a token may still follow it
