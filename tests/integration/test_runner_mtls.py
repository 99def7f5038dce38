"""Runners authenticate each other on their SVIDs (issue 32 items 4 and 6): two runners attest
to a live broker, get certificates through the SDK (``Attestation.identity``) and talk over
real mTLS on 127.0.0.1; a client with no certificate, a peer with an allowed chain but a
disallowed SPIFFE ID, an expired leaf and a certificate from another trust domain are each
refused, and the refused side's application never sees a byte."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from broker.client import BrokerClientError
from broker.client.identity import Identity
from broker.client.mtls import (
    PeerRefused,
    SpiffeConnector,
    SpiffeContext,
    connect,
    guarded,
    serve,
)
from broker.crypto.svid import attestation_of
from broker.dev.identity_ca import DevIdentityCa
from tests.integration.attested import ADMIN, admin_post
from tests.integration.conftest import RunningBroker
from tests.integration.identity import IDENTITY_TOML, SPIFFE_ID, TRUST_DOMAIN, identity_broker
from tests.integration.identity import with_identity as identity_setup
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.support.svids import SigningCa

FRONTEND = f"spiffe://{TRUST_DOMAIN}/frontend"  # an ID no runner here holds


async def _identity(broker: RunningBroker) -> tuple[Identity, Any]:
    client = broker.client()
    attestation = await client.attest(broker.token_source())
    return await attestation.identity(), client


@asynccontextmanager
async def _server(
    identity: Identity, allowed: Any, seen: list[str], refused: list[PeerRefused] | None = None
) -> AsyncIterator[tuple[int, SpiffeContext]]:
    """An aiohttp app on 127.0.0.1 served with ``mtls.serve``; ``seen`` gets each request,
    ``refused`` each peer the handshake refused."""

    async def hello(request: web.Request) -> web.Response:
        seen.append(await request.text())
        return web.Response(text=f"hello from {identity.spiffe_id}")

    app = web.Application()
    app.router.add_post("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    context = await identity.server_context(allowed=allowed)
    if refused is not None:
        context.on_refused = refused.append
    server = await serve(runner, "127.0.0.1", 0, context)
    try:
        yield server.sockets[0].getsockname()[1], context
    finally:
        server.close()
        await runner.cleanup()


async def _post(context: ssl.SSLContext, port: int, text: str) -> str:
    connector = (
        SpiffeConnector(context)
        if isinstance(context, SpiffeContext)
        else aiohttp.TCPConnector(ssl=context)
    )
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(f"https://127.0.0.1:{port}/", data=text) as response,
    ):
        return await response.text()


async def test_two_attested_runners_exchange_a_message_over_mtls(
    start_broker: Callable[..., Any],
) -> None:
    broker = await identity_broker(start_broker)
    (server_id, c1), (client_id, c2) = await _identity(broker), await _identity(broker)
    seen: list[str] = []
    try:
        assert server_id.spiffe_id == client_id.spiffe_id == SPIFFE_ID
        assert "PRIVATE" not in repr(server_id)
        async with _server(server_id, [SPIFFE_ID], seen) as (port, _):
            context = await client_id.client_context(allowed=lambda i: i == SPIFFE_ID)
            assert await _post(context, port, "activations") == f"hello from {SPIFFE_ID}"
            _, writer, peer = await connect("127.0.0.1", port, context)  # a raw stream
            writer.close()
            assert peer == SPIFFE_ID
            # a client with no certificate at all is refused in the server's handshake
            bare = ssl.create_default_context(cadata=client_id.bundle_pem)
            bare.check_hostname = False
            with pytest.raises(aiohttp.ClientError):
                await _post(bare, port, "no identity")
            # a client that allows only another SPIFFE ID refuses this server before writing
            other = await client_id.client_context(allowed=[FRONTEND])
            with pytest.raises(PeerRefused) as refused:
                await _post(other, port, "not for you")
            assert refused.value.code == "peer_not_allowed"
            assert refused.value.spiffe_id == SPIFFE_ID
            with pytest.raises(PeerRefused):
                await connect("127.0.0.1", port, other)
        # a revoked result gets no new certificate: the broker's error, the old one kept
        jti = client_id.svid.attestation
        revoke = f"/v1/admin/attestations/{jti}/revoke"
        assert (await admin_post(broker, revoke, {"reason": "test"}))[0] == 200
        serial = client_id.svid.serial
        with pytest.raises(BrokerClientError) as revoked:
            await client_id.renew()
        assert revoked.value.code == "attestation_revoked"
        assert client_id.svid.serial == serial
    finally:
        await c1.close()
        await c2.close()
    assert seen == ["activations"]
    issued = [r["spiffe_id"] for r in broker.records() if r["type"] == "identity"]
    assert issued == [SPIFFE_ID, SPIFFE_ID, None]  # the refused renewal is recorded too


class _Recorder(asyncio.Protocol):
    def __init__(self, log: list[bytes]) -> None:
        self.log = log

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.log.append(b"<connected>")

    def data_received(self, data: bytes) -> None:
        self.log.append(data)


async def _raw_send(context: ssl.SSLContext, port: int) -> bytes:
    """Connect, write at once, read what comes: an EOF (``b""``) or ``REFUSED`` (a reset or a
    TLS alert) is a refusal; an accepted peer gets no answer (``TimeoutError``)."""
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=""
        )
    except (ConnectionError, ssl.SSLError):
        return REFUSED
    try:
        writer.write(b"first application bytes")
        await writer.drain()
        return await asyncio.wait_for(reader.read(100), 3)
    except (ConnectionError, ssl.SSLError):
        return REFUSED
    finally:
        writer.close()


REFUSED = b"<refused>"


async def test_a_peer_with_a_disallowed_spiffe_id_never_reaches_the_application(
    start_broker: Callable[..., Any],
) -> None:
    broker = await identity_broker(start_broker)
    (server_id, c1), (client_id, c2) = await _identity(broker), await _identity(broker)
    log: list[bytes] = []
    refused: list[PeerRefused] = []
    server = None
    try:
        context = await server_id.server_context(allowed=[FRONTEND])
        context.on_refused = refused.append
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            guarded(lambda: _Recorder(log), context), "127.0.0.1", 0, ssl=context.for_helpers()
        )
        port = server.sockets[0].getsockname()[1]
        # no certificate: refused by the server's handshake
        bare = ssl.create_default_context(cadata=client_id.bundle_pem)
        bare.check_hostname = False
        assert await _raw_send(bare, port) in {b"", REFUSED}
        sender = await client_id.client_context(allowed=[SPIFFE_ID])
        assert await _raw_send(sender, port) in {b"", REFUSED}
        assert [(r.code, r.spiffe_id) for r in refused] == [
            ("peer_no_certificate", None),
            ("peer_not_allowed", SPIFFE_ID),
        ]
        # the same client is let in once the server allows its ID: the test can fail
        context.accept = lambda spiffe_id: spiffe_id == SPIFFE_ID
        with pytest.raises(TimeoutError):
            await _raw_send(sender, port)  # nothing is answered; the bytes arrive
    finally:
        if server is not None:
            server.close()
        await c1.close()
        await c2.close()
    assert log == [b"<connected>", b"first application bytes"]
    assert len(refused) == 2


def _foreign_pem(tmp: Path, domain: str) -> Path:
    """A key and a leaf for ``SPIFFE_ID`` from a CA of ``domain`` made here (not the broker's,
    whatever its name), with its chain (blocking)."""
    ca = SigningCa.make(tmp / domain, domain)
    pem = tmp / f"{domain}.pem"
    pem.write_bytes(
        ca.key_and_chain(SPIFFE_ID, lifetime=timedelta(minutes=10), starts=timedelta(minutes=-1))
    )
    return pem


async def test_a_certificate_from_another_trust_domain_is_refused(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    broker = await identity_broker(start_broker)
    (server_id, c1), (client_id, c2) = await _identity(broker), await _identity(broker)
    seen: list[str] = []
    refused: list[PeerRefused] = []
    try:
        async with _server(server_id, [SPIFFE_ID], seen, refused) as (port, _):
            # another trust domain's CA, then a CA named like ours that is not the bundle's root
            for domain in ("other.invalid", TRUST_DOMAIN):
                pem = await asyncio.to_thread(_foreign_pem, tmp_path, domain)
                context = ssl.create_default_context(cadata=server_id.bundle_pem)
                context.check_hostname = False
                context.load_cert_chain(pem)
                with pytest.raises(aiohttp.ClientError):
                    await _post(context, port, domain)
            # the control: a leaf the broker issued passes the same server
            genuine = await client_id.client_context(allowed=[SPIFFE_ID])
            assert await _post(genuine, port, "genuine") == f"hello from {SPIFFE_ID}"
    finally:
        await c1.close()
        await c2.close()
    assert [r.code for r in refused] == ["peer_untrusted", "peer_untrusted"]
    assert seen == ["genuine"]


SHORT_TOML = ATTEST_TOML.replace("ttl_seconds = 120", "ttl_seconds = 4") + IDENTITY_TOML


async def test_an_expired_leaf_is_refused_and_a_renewed_one_accepted(
    start_broker: Callable[..., Any],
) -> None:
    """Results live 4 s here, so certificates do too (a leaf never outlives its result)."""

    def setup(workdir: Path) -> None:
        with_result_key(workdir)
        identity_setup(workdir)

    broker = await start_broker(
        extra_toml=SHORT_TOML,
        workdir_setup=setup,
        environ={"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN.encode()).hexdigest()},
    )
    (server_id, c1), (client_id, c2) = await _identity(broker), await _identity(broker)
    seen: list[str] = []
    refused: list[PeerRefused] = []
    try:
        assert client_id.svid.not_after - client_id.svid.received_at <= 5
        async with _server(server_id, [SPIFFE_ID], seen, refused) as (port, _):
            sender = await client_id.client_context(allowed=[SPIFFE_ID])
            assert await _post(sender, port, "fresh") == f"hello from {SPIFFE_ID}"
            await asyncio.sleep(max(0.0, client_id.svid.not_after - datetime.now(UTC).timestamp()))
            await asyncio.sleep(1.5)
            await server_id.renew()  # the server's own leaf expired too: renewed in its context
            with pytest.raises(aiohttp.ClientError):
                await _post(sender, port, "expired")
            await client_id.fresh()  # past two thirds: renewed, reloaded into ``sender``
            assert client_id.renewals == 2
            assert await _post(sender, port, "renewed") == f"hello from {SPIFFE_ID}"
    finally:
        await c1.close()
        await c2.close()
    assert seen == ["fresh", "renewed"]
    assert [r.code for r in refused] == ["peer_certificate_expired"]


CACHE_SECONDS = 3.0  # how long the live check keeps an ``active`` answer, in these tests


async def test_a_peer_whose_attestation_is_revoked_is_refused_before_any_byte(
    start_broker: Callable[..., Any],
) -> None:
    """Issue 32 item 3: runner A checks runner B's attestation (the jti in B's leaf) at the
    broker, by hand (``peer_attestation``) and in the handshake helpers
    (``require_live_attestation``); B passes until its attestation is revoked, and for at most
    ``CACHE_SECONDS`` after (an ``active`` answer is kept that long)."""
    broker = await identity_broker(start_broker)
    (a_id, a_client), (b_id, b_client) = await _identity(broker), await _identity(broker)
    seen: list[str] = []
    log: list[bytes] = []
    guards: list[Any] = []
    server = None
    b_leaf = x509.load_pem_x509_certificates(b_id.svid.chain_pem.encode())[0]
    try:
        async with _server(b_id, [SPIFFE_ID], seen) as (port, _):
            status = await a_client.peer_attestation(b_leaf)
            assert (status["jti"], status["status"]) == (b_id.svid.attestation, "active")
            live = await a_id.client_context(
                allowed=[SPIFFE_ID], require_live_attestation=True, live_cache_seconds=CACHE_SECONDS
            )
            assert await _post(live, port, "before") == f"hello from {SPIFFE_ID}"
            asked = asyncio.get_running_loop().time()
            revoke = f"/v1/admin/attestations/{b_id.svid.attestation}/revoke"
            assert (await admin_post(broker, revoke, {"reason": "test"}))[0] == 200
            with pytest.raises(PeerRefused) as refused:
                await a_client.peer_attestation(b_leaf.public_bytes(serialization.Encoding.DER))
            assert refused.value.code == "peer_attestation_revoked"
            assert await _post(live, port, "kept") == f"hello from {SPIFFE_ID}"  # the answer kept
            assert asyncio.get_running_loop().time() - asked < CACHE_SECONDS
            await asyncio.sleep(CACHE_SECONDS)
            with pytest.raises(PeerRefused) as refused:
                await _post(live, port, "after")
            assert refused.value.code == "peer_attestation_revoked"
            with pytest.raises(PeerRefused):
                await connect("127.0.0.1", port, live)
            plain = await a_id.client_context(allowed=[SPIFFE_ID])  # the check is opt-in
            assert await _post(plain, port, "unchecked") == f"hello from {SPIFFE_ID}"
        # a server that requires a live attestation: B is cut off before its bytes are read
        context = await a_id.server_context(allowed=[SPIFFE_ID], require_live_attestation=True)
        factory = guarded(lambda: _Recorder(log), context)

        def counted() -> asyncio.Protocol:
            guard = factory()
            guards.append(guard)
            return guard

        server = await asyncio.get_running_loop().create_server(
            counted, "127.0.0.1", 0, ssl=context.for_helpers()
        )
        port = server.sockets[0].getsockname()[1]
        sender = await b_id.client_context(allowed=[SPIFFE_ID])
        assert await _raw_send(sender, port) in {b"", REFUSED}
        assert guards[0].refused.code == "peer_attestation_revoked"
        with pytest.raises(TimeoutError):  # A's own live attestation is let in
            await _raw_send(await a_id.client_context(allowed=[SPIFFE_ID]), port)
        assert guards[1].refused is None
    finally:
        if server is not None:
            server.close()
        await a_client.close()
        await b_client.close()
    assert seen == ["before", "kept", "unchecked"]
    assert log == [b"<connected>", b"first application bytes"]


def _forged(workdir: Path, tmp: Path, attestation: bytes | None) -> tuple[x509.Certificate, Path]:
    """What a holder of the broker's CA key could make (blocking): a 30-day leaf for
    ``spiffe://…/admin`` with ``attestation`` in the extension, its key and chain in a file."""
    identity = workdir / "identity"
    ca = SigningCa.load(
        DevIdentityCa(identity / "ca-chain.pem", identity / "ca.key", identity / "root.pem")
    )
    pem = ca.key_and_chain(
        f"spiffe://{TRUST_DOMAIN}/admin",
        lifetime=timedelta(days=30),
        starts=timedelta(minutes=-1),
        attestation=attestation,
    )
    path = tmp / f"forged-{len(list(tmp.iterdir()))}.pem"
    path.write_bytes(pem)
    return x509.load_pem_x509_certificates(pem)[0], path


async def test_a_leaf_forged_with_the_ca_key_and_a_copied_jti_is_refused(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    """The jti in a live runner's leaf is visible to every peer. A leaf signed with the CA key
    outside the broker that copies it is not among the certificates the broker lists for that
    attestation (``identities``): ``peer_certificate_unknown``, by hand and in the handshake
    helpers; a leaf naming no attestation is ``peer_attestation_unknown``."""
    broker = await identity_broker(start_broker)
    (a_id, a_client), (b_id, b_client) = await _identity(broker), await _identity(broker)
    log: list[bytes] = []
    refused: list[PeerRefused] = []
    b_leaf = x509.load_pem_x509_certificates(b_id.svid.chain_pem.encode())[0]
    copied = attestation_of(b_leaf)
    assert copied is not None
    server = None
    try:
        status = await a_client.peer_attestation(b_leaf)  # the genuine leaf is listed
        listed = [entry["sha256"] for entry in status["identities"]]
        digest = hashlib.sha256(b_leaf.public_bytes(serialization.Encoding.DER)).hexdigest()
        assert digest in listed
        forged, forged_pem = await asyncio.to_thread(_forged, broker.workdir, tmp_path, copied)
        with pytest.raises(PeerRefused) as caught:
            await a_client.peer_attestation(forged)
        assert caught.value.code == "peer_certificate_unknown"
        bare, _ = await asyncio.to_thread(_forged, broker.workdir, tmp_path, None)
        with pytest.raises(PeerRefused) as caught:
            await a_client.peer_attestation(bare)
        assert caught.value.code == "peer_attestation_unknown"
        # the same forged leaf against a server that requires a live attestation
        context = await a_id.server_context(
            allowed=lambda spiffe_id: spiffe_id.startswith(f"spiffe://{TRUST_DOMAIN}/"),
            require_live_attestation=True,
        )
        context.on_refused = refused.append
        server = await asyncio.get_running_loop().create_server(
            guarded(lambda: _Recorder(log), context), "127.0.0.1", 0, ssl=context.for_helpers()
        )
        port = server.sockets[0].getsockname()[1]
        forger = ssl.create_default_context(cadata=a_id.bundle_pem)
        forger.check_hostname = False
        await asyncio.to_thread(forger.load_cert_chain, forged_pem)
        assert await _raw_send(forger, port) in {b"", REFUSED}
        with pytest.raises(TimeoutError):  # B's genuine leaf passes the same server
            await _raw_send(await b_id.client_context(allowed=[SPIFFE_ID]), port)
    finally:
        if server is not None:
            server.close()
        await a_client.close()
        await b_client.close()
    assert [r.code for r in refused] == ["peer_certificate_unknown"]
    assert log == [b"<connected>", b"first application bytes"]
