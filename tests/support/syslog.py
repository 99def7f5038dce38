"""A syslog collector on loopback UDP: what an audit sink (``syslog://``) sends, as received."""

from __future__ import annotations

import asyncio
from typing import Any


async def syslog_collector(messages: list[bytes]) -> tuple[asyncio.DatagramTransport, int]:
    """Listen on 127.0.0.1 (a free port); each datagram is appended to ``messages``. Returns
    the transport (close it) and the port."""

    class Collector(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: Any) -> None:
            messages.append(data)

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Collector, local_addr=("127.0.0.1", 0))
    return transport, transport.get_extra_info("sockname")[1]
