"""Records streamed to a SIEM as written (syslog over UDP, HTTP JSON lines), best effort: a
SIEM that is away never delays or fails a release."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
from aiohttp import web

from tests.integration.conftest import RunningBroker
from tests.support.constants import KEY


async def wait_for(condition: Any, seconds: float = 5) -> None:
    for _ in range(int(seconds * 20)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_http_sink_receives_every_record(start_broker: Any) -> None:
    received: list[bytes] = []

    async def ingest(request: web.Request) -> web.Response:
        received.extend((await request.read()).splitlines())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/ingest", ingest)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/ingest"
        broker: RunningBroker = await start_broker(environ={"BROKER_AUDIT_SINK": url})
        async with broker.client() as client:
            for _ in range(3):
                await client.release(KEY, broker.token_source())
        await wait_for(lambda: len(received) >= 4)  # the start-up policy_change, 3 releases
        log_lines = broker.settings.audit.log.read_bytes().splitlines()
        assert received == log_lines  # exactly the stored bytes, in order
    finally:
        await runner.cleanup()


async def test_syslog_sink_sends_rfc5424_messages(start_broker: Any) -> None:
    loop = asyncio.get_running_loop()
    messages: list[bytes] = []

    class Collector(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: Any) -> None:
            messages.append(data)

    transport, _ = await loop.create_datagram_endpoint(Collector, local_addr=("127.0.0.1", 0))
    try:
        port = transport.get_extra_info("sockname")[1]
        broker: RunningBroker = await start_broker(
            environ={"BROKER_AUDIT_SINK": f"syslog://127.0.0.1:{port}"}
        )
        async with broker.client() as client:
            await client.release(KEY, broker.token_source())
        await wait_for(lambda: len(messages) >= 2)  # the start-up policy_change, the release
        header, _, payload = messages[-1].partition(b" - decision - ")
        assert header.startswith(b"<38>1 ")  # facility auth (4), severity info (6): an allow
        assert json.loads(payload)["result"] == "allow"
    finally:
        transport.close()


async def test_a_sink_that_is_away_never_blocks_a_release(start_broker: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    broker: RunningBroker = await start_broker(
        environ={"BROKER_AUDIT_SINK": f"http://127.0.0.1:{port}/ingest"}
    )
    async with broker.client() as client:
        for _ in range(3):
            async with asyncio.timeout(5):
                await client.release(KEY, broker.token_source())
    assert len(broker.records()) >= 3  # the local log, the system of record, has everything

    async def dropped() -> float:
        async with (
            aiohttp.ClientSession() as session,
            session.get(broker.url + "/metrics", ssl=broker.client_tls) as response,
        ):
            text = await response.text()
        for line in text.splitlines():
            if line.startswith("broker_audit_sink_dropped_total"):
                return float(line.split()[-1])
        return 0.0

    for _ in range(300):
        if await dropped() >= 1:
            break
        await asyncio.sleep(0.05)
    assert await dropped() >= 1
