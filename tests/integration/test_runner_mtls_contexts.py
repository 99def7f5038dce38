"""The runner SDK's mTLS contexts keep their promises however they are used (issue 32 review):
the allow-list holds with ``web.TCPSite(ssl_context=…)`` and ``ClientSession(ssl=…)``; a resumed
session cannot bring an expired peer back; a context built before a root rotation trusts the new
root and forgets the retired one; refusals carry stable codes (``test_runner_identity_renewal``:
the same review's renewal, key-file and live-cache fixes).

No broker: a development CA (``tests/support/svids.py``) issues the SVIDs an ``Identity``
asks for. The TLS is real: OpenSSL on 127.0.0.1, asyncio and blocking sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from broker.client.mtls import (
    HandshakeRefused,
    Peer,
    PeerRefused,
    SpiffeConnector,
    SpiffeContext,
    connect,
    serve,
)
from tests.support.svids import LocalIssuer, SigningCa

TRUST_DOMAIN = "runners.sdk.invalid"
FRONT = f"spiffe://{TRUST_DOMAIN}/front"
SHARD = f"spiffe://{TRUST_DOMAIN}/shard"
OTHER = f"spiffe://{TRUST_DOMAIN}/other"
EXPIRED_FOR, EXPIRED_SINCE = timedelta(minutes=-1), timedelta(minutes=-10)  # lifetime, starts


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[SigningCa, SigningCa, SigningCa]:
    """Two roots of the trust domain with the same names (before and after a rotation), and
    another trust domain's."""
    base = tmp_path_factory.mktemp("cas")
    return (
        SigningCa.make(base / "old", TRUST_DOMAIN),
        SigningCa.make(base / "new", TRUST_DOMAIN),
        SigningCa.make(base / "foreign", "elsewhere.invalid"),
    )


@contextlib.asynccontextmanager
async def _site(
    context: ssl.SSLContext, seen: list[str], *, helper: bool = False
) -> AsyncIterator[int]:
    """An aiohttp app served the ordinary way (``web.TCPSite(ssl_context=…)``), or with
    ``mtls.serve``; yields its port. ``seen`` gets every request body the app reads."""

    async def hello(request: web.Request) -> web.Response:
        seen.append(await request.text())
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_post("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    server = None
    try:
        if helper:
            assert isinstance(context, SpiffeContext)
            server = await serve(runner, "127.0.0.1", 0, context)
            yield server.sockets[0].getsockname()[1]
        else:
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
            await site.start()
            yield runner.addresses[0][1]
    finally:
        if server is not None:
            server.close()
        await runner.cleanup()


async def _post(port: int, context: ssl.SSLContext, text: str, *, connector: bool = False) -> str:
    """POST ``text`` with ``ClientSession(ssl=context)``, or through ``SpiffeConnector``."""
    url = f"https://127.0.0.1:{port}/"
    if connector:
        assert isinstance(context, SpiffeContext)
        session = aiohttp.ClientSession(connector=SpiffeConnector(context))
        request = session.post(url, data=text)
    else:
        session = aiohttp.ClientSession()
        request = session.post(url, data=text, ssl=context)
    async with session, request as response:
        assert response.status == 200
        return await response.text()


async def test_a_plain_aiohttp_site_and_session_enforce_the_allow_list(
    cas: tuple[SigningCa, ...],
) -> None:
    issuer = LocalIssuer(cas[0], [cas[0]])
    shard, front, intruder = (issuer.identity(i) for i in (SHARD, FRONT, OTHER))
    for identity in (shard, front, intruder):
        await identity.renew()
    seen: list[str] = []
    refused: list[PeerRefused] = []
    server = await shard.server_context(allowed=[FRONT])
    server.on_refused = refused.append
    async with _site(server, seen) as port:
        assert await _post(port, await front.client_context(allowed=[SHARD]), "front") == "hello"
        with pytest.raises(aiohttp.ClientError):  # the server cuts a runner it does not allow
            await _post(port, await intruder.client_context(allowed=[SHARD]), "intruder")
        picky = await front.client_context(allowed=[OTHER])
        with pytest.raises(aiohttp.ClientSSLError) as caught:  # the client refuses the server
            await _post(port, picky, "not for this server")
    cause = caught.value.__cause__
    assert isinstance(cause, HandshakeRefused)
    assert (cause.refused.code, cause.refused.spiffe_id) == ("peer_not_allowed", SHARD)
    assert (refused[0].code, refused[0].spiffe_id) == ("peer_not_allowed", OTHER)
    assert seen == ["front"]


async def test_a_live_check_context_used_without_the_helpers_refuses_every_peer(
    cas: tuple[SigningCa, ...],
) -> None:
    """``require_live_attestation`` needs a network call the handshake cannot make: used
    directly the context fails closed; through ``mtls.serve`` the check runs."""
    asked: list[Peer] = []

    async def live(peer: Peer) -> object:
        asked.append(peer)
        return {"status": "active"}  # no expires_at: never kept

    issuer = LocalIssuer(cas[0], [cas[0]])
    shard, front = issuer.identity(SHARD, live), issuer.identity(FRONT)
    await shard.renew()
    await front.renew()
    server = await shard.server_context(allowed=[FRONT], require_live_attestation=True)
    refused: list[PeerRefused] = []
    server.on_refused = refused.append
    client = await front.client_context(allowed=[SHARD])
    seen: list[str] = []
    async with _site(server, seen) as port:
        with pytest.raises(aiohttp.ClientError):
            await _post(port, client, "plain")
    assert [r.code for r in refused] == ["peer_attestation_unchecked"]
    assert asked == []
    async with _site(server, seen, helper=True) as port:
        assert await _post(port, client, "served") == "hello"
    assert len(asked) == 1
    assert seen == ["served"]


def _request(context: ssl.SSLContext, port: int, session: Any = None) -> tuple[bytes, Any]:
    """One HTTP request on a blocking socket (``sslsocket_class``): the status line, ``b""``
    when refused, and the TLS session."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, session=session) as tls:
                tls.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
                status = tls.recv(4096).split(b"\r\n", 1)[0]
                return status, tls.session
        except (ssl.SSLError, ConnectionError):
            return b"", None


async def test_a_resumed_session_cannot_bring_back_an_expired_peer(
    cas: tuple[SigningCa, ...],
) -> None:
    server_id = LocalIssuer(cas[0], [cas[0]]).identity(SHARD)
    short = LocalIssuer(cas[0], [cas[0]], lifetime=timedelta(seconds=2))
    client_id = short.identity(FRONT)
    await server_id.renew()
    await client_id.renew()
    seen: list[str] = []
    refused: list[PeerRefused] = []
    server = await server_id.server_context(allowed=[FRONT])
    server.on_refused = refused.append
    client = await client_id.client_context(allowed=[SHARD])
    async with _site(server, seen) as port:
        status, session = await asyncio.to_thread(_request, client, port)
        assert status == b"HTTP/1.1 200 OK"
        assert not session.has_ticket  # the server issues none: nothing to resume
        await asyncio.sleep(client_id.svid.not_after - time.time() + 0.5)
        assert (await asyncio.to_thread(_request, client, port, session))[0] == b""
        assert (await asyncio.to_thread(_request, client, port))[0] == b""
    assert seen == ["hi"]
    assert [r.code for r in refused] == ["peer_certificate_expired"] * 2


async def test_the_handshake_check_refuses_a_leaf_past_its_not_after(
    cas: tuple[SigningCa, ...],
) -> None:
    """OpenSSL checks the dates in a full handshake; the SDK's check does again, on its own
    clock (what a resumed session would otherwise skip): one hour on, the leaf has expired."""
    issuer = LocalIssuer(cas[0], [cas[0]])
    server_id, client_id = issuer.identity(SHARD), issuer.identity(FRONT)
    await server_id.renew()
    await client_id.renew()
    server = await server_id.server_context(allowed=[FRONT])
    refused: list[PeerRefused] = []
    server.on_refused = refused.append
    client = await client_id.client_context(allowed=[SHARD])
    seen: list[str] = []
    async with _site(server, seen) as port:
        assert await _post(port, client, "now") == "hello"
        server.clock = lambda: client_id.svid.not_after + 1
        with pytest.raises(aiohttp.ClientError):
            await _post(port, client, "later")
    assert [r.code for r in refused] == ["peer_certificate_expired"]
    assert seen == ["now"]


async def test_a_client_refuses_a_session_a_foreign_server_resumes(
    cas: tuple[SigningCa, ...], tmp_path: Path
) -> None:
    """A server that is not ours issues tickets and resumes: the resumed handshake carries the
    first one's certificate, unchecked, and this SDK's client refuses it."""
    pem = tmp_path / "server.pem"
    await asyncio.to_thread(
        pem.write_bytes,
        cas[0].key_and_chain(SHARD, lifetime=timedelta(minutes=5), starts=timedelta(minutes=-1)),
    )
    foreign = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # tickets on (OpenSSL's default: 2)
    await asyncio.to_thread(foreign.load_cert_chain, pem)
    foreign.load_verify_locations(cadata=cas[0].root_pem)
    foreign.verify_mode = ssl.CERT_REQUIRED

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
        await writer.drain()
        writer.close()

    client_id = LocalIssuer(cas[0], [cas[0]]).identity(FRONT)
    await client_id.renew()
    client = await client_id.client_context(allowed=[SHARD])
    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=foreign)
    port = server.sockets[0].getsockname()[1]
    try:
        status, session = await asyncio.to_thread(_request, client, port)
        assert status == b"HTTP/1.1 200 OK"
        assert session.has_ticket
        with pytest.raises(HandshakeRefused) as caught:
            await asyncio.to_thread(_resume, client, port, session)
    finally:
        server.close()
    assert caught.value.refused.code == "peer_session_resumed"


def _resume(context: ssl.SSLContext, port: int, session: Any) -> None:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, session=session),
    ):
        pass


async def test_a_context_built_before_a_root_rotation_follows_the_bundle(
    cas: tuple[SigningCa, ...],
) -> None:
    """The two roots have the same names (the development CA's): each intermediate's
    authority key identifier picks its own."""
    old, new, _ = cas
    issuer = LocalIssuer(old, [old])
    server_id, early = issuer.identity(SHARD), issuer.identity(FRONT)
    await server_id.renew()
    await early.renew()
    server = await server_id.server_context(allowed=[FRONT])
    refused: list[PeerRefused] = []
    server.on_refused = refused.append
    early_context = await early.client_context(allowed=[SHARD])  # the old root only
    seen: list[str] = []
    async with _site(server, seen) as port:
        assert await _post(port, early_context, "before") == "hello"
        issuer.ca, issuer.roots = new, [old, new]  # the new root published, then issuing
        await server_id.renew()  # a new-root leaf, both roots, into the running site's context
        late = issuer.identity(FRONT)
        await late.renew()
        assert await _post(port, await late.client_context(allowed=[SHARD]), "new") == "hello"
        legacy = LocalIssuer(old, [old, new]).identity(FRONT)
        await legacy.renew()
        legacy_context = await legacy.client_context(allowed=[SHARD])
        assert await _post(port, legacy_context, "old") == "hello"
        with pytest.raises(PeerRefused) as caught:  # built before: the new root unknown
            await connect("127.0.0.1", port, early_context)
        assert caught.value.code == "peer_untrusted"
        await early.renew()  # the same context object now trusts the new root
        _, writer, peer = await connect("127.0.0.1", port, early_context)
        writer.close()
        assert peer == SHARD
        assert await _post(port, early_context, "renewed", connector=True) == "hello"
        issuer.roots = [new]  # the old root retired
        await server_id.renew()
        with pytest.raises(aiohttp.ClientError):
            await _post(port, legacy_context, "retired")
    assert seen == ["before", "new", "old", "renewed"]
    assert [r.code for r in refused if r.code != "peer_handshake_failed"] == ["peer_untrusted"]


async def test_handshake_refusals_carry_stable_codes(
    cas: tuple[SigningCa, ...], tmp_path: Path
) -> None:
    old, _, foreign = cas
    shard = LocalIssuer(old, [old]).identity(SHARD)
    front, intruder = (
        LocalIssuer(old, [old]).identity(FRONT),
        LocalIssuer(old, [old]).identity(OTHER),
    )
    for identity in (shard, front, intruder):
        await identity.renew()
    refused: list[PeerRefused] = []
    server = await shard.server_context(allowed=[FRONT])
    server.on_refused = refused.append
    clients = [
        await asyncio.to_thread(_plain_client, old, tmp_path, None),  # no certificate
        await asyncio.to_thread(
            _plain_client,
            old,
            tmp_path,
            foreign.key_and_chain(FRONT, lifetime=timedelta(minutes=5), starts=timedelta(0)),
        ),
        await asyncio.to_thread(
            _plain_client,
            old,
            tmp_path,
            old.key_and_chain(FRONT, lifetime=EXPIRED_FOR, starts=EXPIRED_SINCE),
        ),
        await intruder.client_context(allowed=[SHARD]),
    ]
    seen: list[str] = []
    async with _site(server, seen, helper=True) as port:
        for client in clients:
            with pytest.raises(aiohttp.ClientError):
                await _post(port, client, "refused")
        assert await _post(port, await front.client_context(allowed=[SHARD]), "ok") == "hello"
    assert [r.code for r in refused] == [
        "peer_no_certificate",
        "peer_untrusted",
        "peer_certificate_expired",
        "peer_not_allowed",
    ]
    assert seen == ["ok"]
    # a client's helpers raise PeerRefused with the same codes for the server's certificate
    servers = {
        "peer_untrusted": LocalIssuer(foreign, [foreign]).identity(SHARD),
        "peer_certificate_expired": LocalIssuer(old, [old], EXPIRED_FOR, EXPIRED_SINCE).identity(
            SHARD
        ),
        "peer_not_allowed": LocalIssuer(old, [old]).identity(OTHER),
    }
    for code, server_id in servers.items():
        await server_id.renew()
        async with _site(await server_id.server_context(allowed=[FRONT]), seen) as port:
            client = await front.client_context(allowed=[SHARD])
            with pytest.raises(PeerRefused) as by_connect:
                await connect("127.0.0.1", port, client)
            with pytest.raises(PeerRefused) as by_connector:
                await _post(port, client, "refused", connector=True)
        assert by_connect.value.code == by_connector.value.code == code
    assert seen == ["ok"]


def _plain_client(ca: SigningCa, directory: Path, pem: bytes | None) -> ssl.SSLContext:
    """A client context that is not an ``Identity``'s: ``ca``'s root trusted, ``pem`` (a key
    and chain) presented if given."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cadata=ca.root_pem)
    if pem is not None:
        path = directory / f"client-{len(list(directory.iterdir()))}.pem"
        path.write_bytes(pem)
        context.load_cert_chain(path)
    return context
