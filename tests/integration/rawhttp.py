"""Raw HTTP/1.1 over TLS to a test broker: for requests aiohttp's client will not send
(short bodies, broken headers, slow sockets, bytes that are not UTF-8)."""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RawReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def open_raw(
    url: str, tls: ssl.SSLContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    return await asyncio.open_connection(
        parts.hostname, parts.port, ssl=tls, server_hostname=parts.hostname
    )


async def read_reply(reader: asyncio.StreamReader, *, timeout: float = 10.0) -> RawReply:
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await reader.readexactly(length) if length else b""
    return RawReply(status, headers, body)


async def raw_exchange(
    url: str, tls: ssl.SSLContext, data: bytes, *, timeout: float = 10.0, half_close: bool = False
) -> RawReply:
    """Send ``data`` as is and read one reply."""
    reader, writer = await open_raw(url, tls)
    try:
        writer.write(data)
        await writer.drain()
        if half_close and writer.can_write_eof():
            writer.write_eof()
        return await read_reply(reader, timeout=timeout)
    finally:
        writer.close()


def request_bytes(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    headers: dict[str, str] | None = None,
    content_length: int | None = None,
) -> bytes:
    all_headers = {"Host": "127.0.0.1", "Content-Type": "application/json", **(headers or {})}
    if "Transfer-Encoding" not in all_headers:
        all_headers["Content-Length"] = str(len(body) if content_length is None else content_length)
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in all_headers.items()
    )
    return head.encode("latin-1") + b"\r\n" + body
