"""A development Confidential Space launcher. DEVELOPMENT ONLY.

It listens on a Unix socket and speaks the launcher's custom-token API (``POST /v1/token`` with
``{"audience", "token_type": "OIDC", "nonces"}``; the answer body is the token), minting tokens
with the development issuer (``issuer.py``) for a workload running ``image``. A broker with
``[sealed] launcher_socket`` pointed at it attests itself as a real one would, under the
development issuer's ``*.invalid`` URL, which no client trusts unless told to.

Bounds, as the SDK documents Google's: at most ``MAX_NONCES`` nonces of 8..88 bytes each.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aiohttp import web

from broker.client.tokens import MAX_NONCES, NONCE_BYTES_RANGE
from broker.dev.issuer import DevIssuer, Workload


class DevLauncher:
    """The ``/v1/token`` handler; ``lifetime`` sets each token's validity (tests shorten it)."""

    def __init__(
        self, issuer: DevIssuer, workload: Workload, *, lifetime: timedelta = timedelta(hours=1)
    ) -> None:
        self.issuer = issuer
        self.workload = workload
        self.lifetime = lifetime

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024)
        app.router.add_post("/v1/token", self.token)
        return app

    async def token(self, request: web.Request) -> web.Response:
        """``POST /v1/token``: a token for the body's audience and nonces, as plain text."""
        try:
            body = json.loads(await request.read())
            audience, nonces = body["audience"], body.get("nonces", [])
            kind = body.get("token_type", "OIDC")
        except (ValueError, KeyError, TypeError):
            return web.Response(status=400, text="expected {audience, token_type, nonces}")
        problem = request_problem(audience, kind, nonces)
        if problem:
            return web.Response(status=400, text=problem)
        token = self.issuer.mint(
            audience=audience,
            nonces=nonces,
            workload=self.workload,
            now=datetime.now(UTC),
            lifetime=self.lifetime,
        )
        return web.Response(text=token, content_type="text/plain")


def request_problem(audience: object, kind: object, nonces: object) -> str | None:
    """What is wrong with a token request, as the launcher would refuse it; None: nothing."""
    if not isinstance(audience, str) or not audience:
        return "audience must be a non-empty string"
    if kind != "OIDC":
        return "this development launcher mints OIDC tokens only"
    if not isinstance(nonces, list) or len(nonces) > MAX_NONCES:
        return f"nonces must be a list of at most {MAX_NONCES}"
    low, high = NONCE_BYTES_RANGE
    if not all(isinstance(n, str) and low <= len(n.encode()) <= high for n in nonces):
        return f"each nonce must be {low}..{high} bytes"
    return None


@asynccontextmanager
async def serve_dev_launcher(launcher: DevLauncher, socket_path: Path) -> AsyncIterator[Path]:
    """Serve ``launcher`` on the Unix socket ``socket_path`` (mode 0600) until the block ends."""
    runner = web.AppRunner(launcher.app(), access_log=None)
    await runner.setup()
    try:
        site = web.UnixSite(runner, str(socket_path))
        await site.start()
        await asyncio.to_thread(socket_path.chmod, 0o600)
        yield socket_path
    finally:
        await runner.cleanup()
