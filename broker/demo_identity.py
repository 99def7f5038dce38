"""``broker demo``, runners talking to runners (issue 32): two runners attest, each gets a
workload certificate (SPIFFE X.509-SVID) through ``Attestation.identity()``, and they exchange
a message over mTLS on 127.0.0.1, each accepting only the other's SPIFFE ID; a third client with
no certificate (it never attested) is refused in the server's handshake."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from aiohttp import web

from broker.client import BrokerClient, BrokerClientError
from broker.client.identity import Identity
from broker.client.mtls import PeerRefused, SpiffeConnector, serve
from broker.client.tokens import TokenSource
from broker.dev.identity_ca import make_dev_identity_ca

TRUST_DOMAIN = "runners.demo.invalid"
SPIFFE_PATH = "demo/shard"
IDENTITY_TOML = (
    f'\n[identity]\nenabled = true\ntrust_domain = "{TRUST_DOMAIN}"\n'
    'ca_certificates = "identity/ca-chain.pem"\nca_key = "identity/ca.key"\n'
)
Say = Callable[[str, str], None]


def write_identity_ca(workdir: Path) -> None:
    """The development root and intermediate the ``[identity]`` section names (blocking)."""
    make_dev_identity_ca(workdir / "identity", TRUST_DOMAIN, now=datetime.now(UTC))


async def runners_talk(client: BrokerClient, source: TokenSource, say: Say) -> bool:
    """Two attested runners exchange a message over mTLS; an unattested one is refused."""
    try:
        shard = await (await client.attest(source)).identity()
        front = await (await client.attest(source)).identity()
    except BrokerClientError as exc:
        say("mtls", f"FAILED: no workload certificate: {exc}")
        return False
    svid = shard.svid
    say(
        "mtls",
        f"two runners attested and got certificates for {svid.spiffe_id} "
        f"(lifetime {svid.not_after - svid.not_before:.0f} s, keys made in the runners)",
    )
    answered: list[str] = []

    async def activations(request: web.Request) -> web.Response:
        answered.append(await request.text())
        return web.Response(text=f"{shard.spiffe_id} got {answered[-1]!r}")

    app = web.Application()
    app.router.add_post("/activations", activations)
    runner = web.AppRunner(app)
    await runner.setup()
    server = await serve(
        runner, "127.0.0.1", 0, await shard.server_context(allowed=[front.spiffe_id])
    )
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/activations"
    try:
        return await _exchange(front, url, say) and await _unattested(front, url, answered, say)
    finally:
        server.close()
        await runner.cleanup()


async def _exchange(front: Identity, url: str, say: Say) -> bool:
    context = await front.client_context(allowed=[front.spiffe_id])
    try:
        async with (
            aiohttp.ClientSession(connector=SpiffeConnector(context)) as session,
            session.post(url, data="layer 5 activations") as response,
        ):
            text = await response.text()
    except (aiohttp.ClientError, PeerRefused) as exc:
        say("mtls", f"FAILED: the attested runners could not talk: {exc}")
        return False
    say("mtls", f"runner 2 -> runner 1 over mTLS, each checked the other's SPIFFE ID: {text}")
    return True


async def _unattested(front: Identity, url: str, answered: list[str], say: Say) -> bool:
    """A client that trusts the bundle but holds no certificate: the handshake fails."""
    bare = ssl.create_default_context(cadata=front.bundle_pem)
    bare.check_hostname = False
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=bare)) as session,
            session.post(url, data="let me in") as response,
        ):
            await response.read()
    except aiohttp.ClientError as exc:
        if len(answered) == 1:
            say("mtls", f"a third, unattested client is refused at the handshake ({exc})")
            return True
    say("mtls", "FAILED: a client with no certificate reached the runner")
    return False
