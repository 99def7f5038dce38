"""Issue 28 item 8: a runner that cannot reach the broker gets the SDK's error type with a
stable code (``BrokerClientError``, status 0), never a raw aiohttp or ssl exception: a closed
port (``broker_unreachable``), a server whose certificate another CA signed (``tls_error``, a
man in the middle), a server that never answers (``timeout``) and one that hangs up
(``connection_lost``). Real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from broker.client import BrokerClient, BrokerClientError
from broker.client.query import QueryClient
from broker.client.sdk import TRANSPORT_CODES
from broker.client.unwrap import ReleasedDek
from broker.crypto.checkpoint import NoteSigner
from broker.dev.issuer import DevTokenSource, Workload
from broker.dev.tls import make_dev_tls
from tests.support.constants import ALLOWED, KEY
from tests.support.issuers import dev_issuer

Call = Callable[[BrokerClient], Awaitable[object]]
LOG_KEY = NoteSigner("example.test/log", ed25519.Ed25519PrivateKey.generate()).verifier_key()


def token_source() -> DevTokenSource:
    return DevTokenSource(dev_issuer(), Workload(image_digest=ALLOWED), lambda: datetime.now(UTC))


CALLS: dict[str, Call] = {
    "release": lambda client: client.release(KEY, token_source()),
    "attest": lambda client: client.attest(token_source()),
    "prove": lambda client: client.prove(
        ReleasedDek(KEY, 1, "d", b"k" * 32, log_index=0, leaf_hash=b"h" * 32), LOG_KEY
    ),
}


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
async def silent_server() -> AsyncIterator[tuple[int, list[asyncio.StreamWriter]]]:
    """Accepts connections and never answers (a stuck proxy)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1], held
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


async def expect(code: str, client: BrokerClient, call: Call) -> BrokerClientError:
    async with client:
        with pytest.raises(BrokerClientError) as caught:
            await call(client)
    error = caught.value
    assert (error.status, error.code) == (0, code), error
    assert code in TRANSPORT_CODES
    return error


@pytest.mark.parametrize("call", sorted(CALLS))
async def test_a_closed_port_is_broker_unreachable(call: str) -> None:
    url = f"https://127.0.0.1:{closed_port()}"
    error = await expect("broker_unreachable", BrokerClient(url), CALLS[call])
    assert url in error.message


@pytest.mark.parametrize("call", sorted(CALLS))
async def test_a_certificate_from_another_ca_is_a_tls_error(tmp_path: Path, call: str) -> None:
    now = datetime.now(UTC)
    impostor = await asyncio.to_thread(make_dev_tls, tmp_path / "impostor", now=now)
    pinned = await asyncio.to_thread(make_dev_tls, tmp_path / "pinned", now=now)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(impostor.server_cert, impostor.server_key)

    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=served)
    port = server.sockets[0].getsockname()[1]
    trusting = ssl.create_default_context(cafile=str(pinned.ca_cert))
    try:
        await expect(
            "tls_error",
            BrokerClient(f"https://127.0.0.1:{port}", ssl_context=trusting),
            CALLS[call],
        )
    finally:
        server.close()
        await server.wait_closed()


async def test_a_server_that_never_answers_is_a_timeout(
    silent_server: tuple[int, list[asyncio.StreamWriter]],
) -> None:
    port, _ = silent_server
    client = BrokerClient(f"http://127.0.0.1:{port}", timeout_seconds=0.5)
    await expect("timeout", client, CALLS["release"])


async def test_a_server_that_hangs_up_is_connection_lost() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await expect("connection_lost", BrokerClient(f"http://127.0.0.1:{port}"), CALLS["attest"])
    finally:
        server.close()
        await server.wait_closed()


async def test_the_query_client_says_unreachable_too() -> None:
    client = QueryClient(
        f"https://127.0.0.1:{closed_port()}",
        statement_key=ec.generate_private_key(ec.SECP256R1()).public_key(),
    )
    with pytest.raises(BrokerClientError) as caught:
        await client.public_key("queries/chat")
    assert caught.value.code == "broker_unreachable"
