"""The Confidential Space launcher socket client and JWKS fetched over HTTP, on real servers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from broker.attestation.jwks_sources import UrlJwksSource
from broker.client import ConfidentialSpaceTokenSource
from broker.client.tokens import TokenSourceError
from broker.core.errors import ErrorCode, UpstreamError
from broker.dev.issuer import DevIssuer, Workload
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from tests.integration.attested import DENIED_KEY
from tests.integration.conftest import RunningBroker
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.support.constants import ALLOWED, GPU_KEY, KEY
from tests.support.issuers import dev_issuer
from tests.support.weights import sealed_before_a_rotation, sealed_with


class FakeLauncher:
    """A teeserver stand-in on a Unix socket: same path, body and reply shape as the launcher."""

    def __init__(self, issuer: DevIssuer) -> None:
        self.issuer = issuer
        self.requests: list[dict[str, Any]] = []

    async def token(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if set(body) - {"audience", "nonces", "token_type"} or not body.get("audience"):
            return web.Response(status=400, text="bad TokenOptions")
        jwt = self.issuer.mint(
            audience=body["audience"],
            nonces=body["nonces"],
            workload=Workload(image_digest=ALLOWED),
            now=datetime.now(UTC),
        )
        return web.Response(text=jwt, content_type="text/html")  # as the real launcher does


@contextlib.asynccontextmanager
async def serve_launcher(
    issuer: DevIssuer, socket_path: str
) -> AsyncIterator[tuple[FakeLauncher, str]]:
    fake = FakeLauncher(issuer)
    app = web.Application()
    app.router.add_post("/v1/token", fake.token)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, socket_path).start()
    try:
        yield fake, socket_path
    finally:
        await runner.cleanup()


@pytest.fixture
async def launcher(
    broker: RunningBroker, tmp_path: Path
) -> AsyncIterator[tuple[FakeLauncher, str]]:
    async with serve_launcher(broker.issuer, str(tmp_path / "teeserver.sock")) as served:
        yield served


RUNNER = Path(__file__).parents[2] / "deploy" / "confidential-space" / "runner.py"


@pytest.mark.parametrize("attest", [False, True])
async def test_the_confidential_space_runner_decrypts_with_the_files_own_key(
    start_broker: Callable[..., Any], tmp_path: Path, attest: bool
) -> None:
    """deploy/confidential-space/runner.py as launched: environment only, the launcher's
    socket, the key version from the file's header, plaintext on tmpfs-like storage. With
    ``[attest]`` on it attests once and releases on the result (DPoP); with it off (404) it
    falls back to a full-evidence release."""
    broker: RunningBroker = await start_broker(
        **({"extra_toml": ATTEST_TOML, "workdir_setup": with_result_key} if attest else {})
    )
    async with serve_launcher(broker.issuer, str(tmp_path / "teeserver.sock")) as launcher:
        await run_the_runner(broker, launcher[1], attest)


async def run_the_runner(broker: RunningBroker, socket_path: str, attest: bool) -> None:
    sealed, plain = await sealed_before_a_rotation(broker.workdir, "m.safetensors", 150_000)
    environ = {
        **os.environ,
        "BROKER_URL": broker.url,
        "BROKER_AUDIENCE": broker.settings.server.audience,
        "BROKER_CA": str(broker.workdir / "tls" / "ca.pem"),
        "WEIGHTS_IN": str(sealed),
        "WEIGHTS_OUT": str(broker.workdir / "out.safetensors"),
        "TEE_LAUNCHER_SOCKET": socket_path,
        "MODEL_KEY": KEY,
    }
    done = await asyncio.create_subprocess_exec(
        sys.executable, str(RUNNER), env=environ, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await done.communicate()
    assert done.returncode == 0, err.decode()
    assert f"key {KEY}#1 released" in out.decode()
    kinds = [r["type"] for r in broker.records()]
    assert kinds.count("attestation") == int(attest)  # attested once, or not at all
    assert ("attested_release" in kinds, "release" in kinds) == (attest, not attest)
    assert await asyncio.to_thread((broker.workdir / "out.safetensors").read_bytes) == plain
    environ["MODEL_KEY"] = "models/other"  # a file for another model is refused up front
    refused = await asyncio.create_subprocess_exec(
        sys.executable, str(RUNNER), env=environ, stderr=asyncio.subprocess.PIPE
    )
    _, err = await refused.communicate()
    assert refused.returncode == 1
    assert "not 'models/other'" in err.decode()


@pytest.mark.parametrize("attest", [False, True])
async def test_the_runner_opens_several_files_with_one_request_for_their_keys(
    start_broker: Callable[..., Any], tmp_path: Path, attest: bool
) -> None:
    """Issue 31: ``WEIGHTS_IN`` lists four files (a shard made before a rotation, two after,
    one for another key): one attestation and one release for the three distinct keys, or,
    without results (404), one full-evidence release per distinct key; each file decrypted into
    the ``WEIGHTS_OUT`` directory. Refusals write no plaintext, nor does a last file that fails
    to authenticate after the others decrypted (each is staged as ``.partial`` until all have)."""
    broker: RunningBroker = await start_broker(
        **({"extra_toml": ATTEST_TOML, "workdir_setup": with_result_key} if attest else {})
    )
    old, old_plain = await sealed_before_a_rotation(broker.workdir, "a.safetensors", 50_000)
    made = [await sealed_with(broker.workdir, n, KEY) for n in ("b.safetensors", "c.safetensors")]
    made.append(await sealed_with(broker.workdir, "tok.json", GPU_KEY))
    files = [(old, old_plain), *made]
    out = tmp_path / "out"
    await asyncio.to_thread(out.mkdir)
    broker = broker.from_now_on()
    environ = {
        **os.environ,
        "BROKER_URL": broker.url,
        "BROKER_AUDIENCE": broker.settings.server.audience,
        "BROKER_CA": str(broker.workdir / "tls" / "ca.pem"),
        "WEIGHTS_IN": " , ".join(str(path) for path, _ in files),
        "WEIGHTS_OUT": f"{out}/",
        "TEE_LAUNCHER_SOCKET": str(tmp_path / "teeserver.sock"),
    }
    async with serve_launcher(broker.issuer, environ["TEE_LAUNCHER_SOCKET"]):
        code, stdout, stderr = await run_runner(environ)
        assert code == 0, stderr
        distinct = [(KEY, 1), (KEY, 2), (GPU_KEY, 1)]
        records = broker.records()
        if attest:
            assert [r["type"] for r in records] == ["attestation", "attested_release"]
            assert [(k["key"], k["version"]) for k in records[1]["keys"]] == distinct
        else:
            assert [(r["type"], r["key"], r["version"]) for r in records] == [
                ("release", *kid) for kid in distinct
            ]
        for path, plain in files:
            opened = out / path.name.removesuffix(".brkw")
            assert await asyncio.to_thread(opened.read_bytes) == plain
        assert "decrypted 4 files" in stdout
        tampered = await last_tag_flipped(files, tmp_path / "tampered")
        for name, value, code_wanted, says in (
            ("MODEL_KEY", KEY, 1, f"is for key {GPU_KEY!r}, not {KEY!r}"),
            ("WEIGHTS_OUT", str(out / "one.safetensors"), 2, "must list as many targets"),
            ("WEIGHTS_IN", f"{old},{await denied_file(broker)}", 1, "policy_denied"),
            ("WEIGHTS_IN", tampered, 1, "do not decrypt"),  # the first three did
        ):
            await asyncio.to_thread(shutil.rmtree, out)
            await asyncio.to_thread(out.mkdir)
            broker = broker.from_now_on()
            code, _, stderr = await run_runner({**environ, name: value})
            assert (code, says in stderr) == (code_wanted, True), stderr
            asked = name == "WEIGHTS_IN"  # a key refused, or a file failing: asked
            assert bool(broker.records()) is asked
            # no plaintext of any file, no .partial (the tampered run decrypted three first)
            assert not await asyncio.to_thread(lambda: list(out.iterdir()))


async def last_tag_flipped(files: list[tuple[Path, bytes]], where: Path) -> str:
    """``WEIGHTS_IN`` for ``files`` with one bit of the last file's final tag flipped (a copy
    under ``where``, the same name): every other file decrypts, the last does not."""
    *first, (last, _) = files
    sealed = bytearray(await asyncio.to_thread(last.read_bytes))
    sealed[-1] ^= 0x01
    await asyncio.to_thread(where.mkdir)
    await asyncio.to_thread((where / last.name).write_bytes, bytes(sealed))
    return ",".join([*(str(path) for path, _ in first), str(where / last.name)])


async def denied_file(broker: RunningBroker) -> Path:
    """A file for ``DENIED_KEY``, a key no image is allowed."""
    async with open_key_service(broker.settings.keys) as keys:
        await keys.create(DENIED_KEY, Purpose.MODEL_WEIGHTS, now=datetime.now(UTC))
    sealed, _ = await sealed_with(broker.workdir, "denied.safetensors", DENIED_KEY)
    return sealed


async def run_runner(environ: dict[str, str]) -> tuple[int | None, str, str]:
    done = await asyncio.create_subprocess_exec(
        sys.executable, str(RUNNER), env=environ, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await done.communicate()
    return done.returncode, out.decode(), err.decode()


async def test_release_with_launcher_token(
    broker: RunningBroker, launcher: tuple[FakeLauncher, str]
) -> None:
    fake, socket_path = launcher
    async with broker.client() as client:
        released = await client.release(KEY, ConfidentialSpaceTokenSource(socket_path))
    assert len(released.dek) == 32
    (request,) = fake.requests
    assert request["token_type"] == "OIDC"
    assert request["audience"] == broker.settings.server.audience
    assert len(request["nonces"]) == 2


async def test_launcher_limits_enforced_before_asking(launcher: tuple[FakeLauncher, str]) -> None:
    _, socket_path = launcher
    source = ConfidentialSpaceTokenSource(socket_path)
    with pytest.raises(TokenSourceError):
        await source.token("aud", ["short"])
    with pytest.raises(TokenSourceError):
        await source.token("aud", ["n" * 20] * 7)


async def test_missing_launcher_socket_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenSourceError, match="launcher socket"):
        await ConfidentialSpaceTokenSource(str(tmp_path / "absent.sock")).token("a", ["n" * 20])


class JwksServer:
    def __init__(self, issuer: DevIssuer) -> None:
        self.documents = [issuer.jwks()]
        self.hits = 0
        self.fail = False

    async def jwks(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.fail:
            return web.Response(status=500)
        return web.json_response(self.documents[-1])


@pytest.fixture
async def jwks_server() -> AsyncIterator[tuple[JwksServer, str, DevIssuer]]:
    issuer = dev_issuer()
    server = JwksServer(issuer)
    app = web.Application()
    app.router.add_get("/jwks", server.jwks)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield server, f"http://127.0.0.1:{runner.addresses[0][1]}/jwks", issuer
    await runner.cleanup()


async def test_jwks_url_cached_and_refreshed_on_unknown_kid_with_rate_limit(
    jwks_server: tuple[JwksServer, str, DevIssuer],
) -> None:
    server, url, issuer = jwks_server
    async with aiohttp.ClientSession() as session:
        source = UrlJwksSource(url, session, cache_seconds=3600, refresh_min_seconds=3600)
        first = await source.key_set()
        assert first.get(issuer.kid) is not None
        await source.key_set()
        assert server.hits == 1  # cached
        await source.key_set(unknown_kid="rotated")
        assert server.hits == 1  # refresh refused: inside the rate limit

        eager = UrlJwksSource(url, session, cache_seconds=3600, refresh_min_seconds=0.0)
        await eager.key_set()
        rotated = dev_issuer()
        server.documents.append(rotated.jwks())
        keys = await eager.key_set(unknown_kid=rotated.kid)
        assert keys.get(rotated.kid) is not None  # rotation picked up


async def test_jwks_outage_keeps_last_good_keys_and_fails_closed_without_any(
    jwks_server: tuple[JwksServer, str, DevIssuer],
) -> None:
    server, url, issuer = jwks_server
    async with aiohttp.ClientSession() as session:
        source = UrlJwksSource(url, session, cache_seconds=3600, refresh_min_seconds=0.0)
        await source.key_set()
        server.fail = True
        assert (await source.key_set(unknown_kid="x")).get(issuer.kid) is not None
        cold = UrlJwksSource(url, session, cache_seconds=3600, refresh_min_seconds=0.0)
        with pytest.raises(UpstreamError) as caught:
            await cold.key_set()
        assert caught.value.code is ErrorCode.JWKS_UNAVAILABLE


async def test_broker_with_jwks_url_releases(
    start_broker: Any, jwks_server: tuple[JwksServer, str, DevIssuer]
) -> None:
    server, url, _ = jwks_server
    broker: RunningBroker = await start_broker(jwks_url=url)
    server.documents.append(broker.issuer.jwks())  # fetched lazily, on the first token
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
    assert len(released.dek) == 32
    assert server.hits == 1
