"""OCSP for GPU device chains against a real HTTP responder on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import aiohttp
import pytest
from aiohttp import web

from broker.attestation.nvidia.sources import HttpOcspChecker
from tests.vectors.gpu import OcspResponder, SimulatedGpu


@pytest.fixture
async def responder() -> AsyncIterator[tuple[OcspResponder, str]]:
    gpu = SimulatedGpu(datetime.now(UTC))
    fake = OcspResponder(gpu)

    async def handle(request: web.Request) -> web.Response:
        assert request.content_type == "application/ocsp-request"
        return web.Response(
            body=fake.answer(await request.read()), content_type="application/ocsp-response"
        )

    app = web.Application()
    app.router.add_post("/", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield fake, f"http://127.0.0.1:{runner.addresses[0][1]}/"
    await runner.cleanup()


async def status(url: str, gpu: SimulatedGpu) -> str:
    async with aiohttp.ClientSession() as session:
        return await HttpOcspChecker(url, session, timeout_seconds=5).status(gpu.chain)


async def test_all_good(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    assert await status(url, fake.gpu) == "good"
    assert fake.requests == 3  # every certificate between leaf and root, as NVIDIA's verifier


async def test_answers_are_cached(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    async with aiohttp.ClientSession() as session:
        checker = HttpOcspChecker(url, session, timeout_seconds=5)
        assert await checker.status(fake.gpu.chain) == "good"
        assert await checker.status(fake.gpu.chain) == "good"
    assert fake.requests == 3


async def test_revoked_intermediate_reported(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    fake.revoked = frozenset({fake.gpu.chain[2].serial_number})
    assert await status(url, fake.gpu) == "revoked"


async def test_forged_response_is_unknown_not_good(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    fake.sign_with_wrong_key = True
    assert await status(url, fake.gpu) == "unknown"


async def test_unreachable_responder_is_unknown() -> None:
    gpu = SimulatedGpu(datetime.now(UTC))
    assert await status("http://127.0.0.1:9/", gpu) == "unknown"
