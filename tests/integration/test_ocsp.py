"""OCSP for GPU device chains against a real HTTP responder on loopback, checked as RFC 6960
§3.2 says (freshness, delegated responders)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from aiohttp import web

from broker.attestation.nvidia.ocsp import chain_status
from broker.attestation.nvidia.sources import HttpOcspSource
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


async def judged(source: HttpOcspSource, gpu: SimulatedGpu, now: datetime) -> str:
    """What the pipeline makes of the bytes the adapter fetched (the service's path)."""
    answers = await source.responses(gpu.chain, now)
    return chain_status(gpu.chain, answers, now, include_leaf=False)


async def status(url: str, gpu: SimulatedGpu) -> str:
    async with aiohttp.ClientSession() as session:
        source = HttpOcspSource(url, session, timeout_seconds=5, cache_seconds=0)
        return await judged(source, gpu, datetime.now(UTC))


async def test_all_good(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    assert await status(url, fake.gpu) == "good"
    assert fake.requests == 3  # every certificate between leaf and root, as NVIDIA's verifier


async def test_answers_are_cached(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    async with aiohttp.ClientSession() as session:
        source = HttpOcspSource(url, session, timeout_seconds=5)
        now = datetime.now(UTC)
        assert await judged(source, fake.gpu, now) == "good"
        assert await judged(source, fake.gpu, now) == "good"
        assert fake.requests == 3
        # Past its nextUpdate (one hour here) the cached answer is not used, and the fresh
        # one, issued now, is itself stale for a request two hours later.
        assert await judged(source, fake.gpu, now + timedelta(hours=2)) == "unknown"
    assert fake.requests == 6


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


async def test_stale_good_answer_replay_rejected(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    fake.stale = True  # a "good" whose nextUpdate passed an hour ago
    assert await status(url, fake.gpu) == "unknown"


async def test_good_answer_from_the_future_rejected(responder: tuple[OcspResponder, str]) -> None:
    fake, url = responder
    async with aiohttp.ClientSession() as session:
        source = HttpOcspSource(url, session, timeout_seconds=5, cache_seconds=0)
        earlier = datetime.now(UTC) - timedelta(hours=1)  # thisUpdate is after this "now"
        assert await judged(source, fake.gpu, earlier) == "unknown"


async def test_delegated_responder_without_ocsp_signing_eku_rejected(
    responder: tuple[OcspResponder, str],
) -> None:
    fake, url = responder
    fake.delegate = "without_eku"
    assert await status(url, fake.gpu) == "unknown"


async def test_delegated_responder_with_ocsp_signing_eku_accepted(
    responder: tuple[OcspResponder, str],
) -> None:
    fake, url = responder
    fake.delegate = "with_eku"
    assert await status(url, fake.gpu) == "good"
