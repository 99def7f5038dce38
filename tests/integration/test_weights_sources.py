"""The runner SDK reads encrypted weights from real servers on loopback: a local file, an HTTPS
server answering ranged GETs (aiohttp's static file handler, TLS from the development CA), and
``fake-gcs-server`` (the Cloud Storage emulator, ``make test`` builds it) through the real
``google-cloud-storage`` client. No client library is mocked.

Checked on every source: ``decrypt_to`` (async, parallel, progress, nothing left behind when a
segment does not authenticate) and ``open_encrypted`` (random access); on a ``.safetensors``
file, one tensor is loaded without decrypting the rest.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import ssl
import struct
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from broker.client.weights import (
    READ_THREADS,
    EncryptedReader,
    SourceError,
    decrypt_to,
    open_encrypted,
    open_source,
)
from broker.crypto.weights import WeightsFormatError, encrypt_stream
from broker.dev.tls import make_dev_tls
from tests.support.processes import fake_gcs_server

ROOT = Path(__file__).parents[2]
DEK = bytes(range(32))
KID = "models/tiny#1"
SEGMENT = 4096
LARGE_SEGMENT = 512 * 1024  # arrives over HTTPS in many TCP reads: partial reads must not pass


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "embed.weight": rng.standard_normal((64, 48), dtype=np.float32),
        "layer0.weight": rng.standard_normal((48, 48), dtype=np.float32),
        "layer1.bias": rng.standard_normal((48,), dtype=np.float32),
        "head.weight": rng.standard_normal((48, 200), dtype=np.float32),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A .safetensors file (several segments) and a random blob, both encrypted."""
    directory = tmp_path_factory.mktemp("weights")
    model = save_safetensors(tensors())
    blob = os.urandom(5 * SEGMENT + 123)
    out: dict[str, Any] = {"dir": directory, "plain": {"model": model, "blob": blob}}
    out["plain"]["large"] = os.urandom(3 * LARGE_SEGMENT - 5)
    for name, data in out["plain"].items():
        sealed = io.BytesIO()
        segment = LARGE_SEGMENT if name == "large" else SEGMENT
        encrypt_stream(DEK, KID, io.BytesIO(data), sealed, segment_size=segment)
        (directory / f"{name}.brkw").write_bytes(sealed.getvalue())
    return out


@pytest.fixture(scope="module")
def fake_gcs(files: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """fake-gcs-server on 127.0.0.1 with bucket ``weights`` holding the encrypted files."""
    seed = tmp_path_factory.mktemp("gcs")
    (seed / "weights").mkdir()
    for path in files["dir"].glob("*.brkw"):
        (seed / "weights" / path.name).write_bytes(path.read_bytes())
    with fake_gcs_server(seed) as port:
        from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415
        from google.cloud import storage  # type: ignore[attr-defined]  # noqa: PLC0415

        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
        try:
            yield storage.Client(project="test", credentials=AnonymousCredentials())  # type: ignore[no-untyped-call]
        finally:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)


@pytest.fixture
async def https(files: dict[str, Any], tmp_path: Path) -> AsyncIterator[tuple[str, ssl.SSLContext]]:
    """An HTTPS static file server (Range support is aiohttp's own) and a context trusting it."""
    tls = await asyncio.to_thread(make_dev_tls, tmp_path / "tls", now=datetime.now(UTC))
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tls.server_cert, tls.server_key)
    app = web.Application()
    app.router.add_static("/w/", files["dir"])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context)
    await site.start()
    port = runner.addresses[0][1]
    yield f"https://127.0.0.1:{port}/w", ssl.create_default_context(cafile=str(tls.ca_cert))
    await runner.cleanup()


def locate(kind: str, name: str, files: dict[str, Any], extra: Any) -> tuple[Any, dict[str, Any]]:
    if kind == "local":
        return files["dir"] / f"{name}.brkw", {}
    if kind == "https":
        base, context = extra
        return f"{base}/{name}.brkw", {"ssl_context": context}
    return f"gs://weights/{name}.brkw", {"client": extra}


@pytest.fixture(params=["local", "https", "gs"])
def source_kind(request: pytest.FixtureRequest) -> tuple[str, Any]:
    if request.param == "https":
        return "https", request.getfixturevalue("https")
    if request.param == "gs":
        return "gs", request.getfixturevalue("fake_gcs")
    return "local", None


async def test_decrypt_to_from_every_source(
    source_kind: tuple[str, Any], files: dict[str, Any], tmp_path: Path
) -> None:
    kind, extra = source_kind
    where, options = locate(kind, "blob", files, extra)
    seen: list[tuple[int, int]] = []
    dest = tmp_path / "blob.bin"
    ticks = 0

    async def ticker() -> None:  # the event loop keeps running while segments decrypt
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    running = asyncio.create_task(ticker())
    size = await decrypt_to(
        where, dest, DEK, KID, progress=lambda d, t: seen.append((d, t)), **options
    )
    running.cancel()
    assert dest.read_bytes() == files["plain"]["blob"]
    assert size == len(files["plain"]["blob"])
    assert seen[-1] == (size, size)
    assert len(seen) == 6  # one report per segment
    assert ticks > 6
    assert oct(dest.stat().st_mode & 0o777) == "0o600"


async def test_open_encrypted_loads_one_tensor_without_decrypting_the_rest(
    source_kind: tuple[str, Any], files: dict[str, Any]
) -> None:
    kind, extra = source_kind
    where, options = locate(kind, "model", files, extra)
    expected = tensors()

    def load_one(name: str) -> tuple[np.ndarray, int]:
        source = open_source(where, **options)
        counting = _Counting(source)
        with open_encrypted(counting, DEK, KID) as f:
            (header_len,) = struct.unpack("<Q", f.read(8))  # the safetensors layout
            header = json.loads(f.read(header_len))
            info = header[name]
            start, end = info["data_offsets"]
            f.seek(8 + header_len + start)
            data = f.read(end - start)
        array = np.frombuffer(data, dtype=np.float32).reshape(info["shape"])
        return array, counting.segments

    array, segments_read = await asyncio.to_thread(load_one, "layer1.bias")
    assert np.array_equal(array, expected["layer1.bias"])
    total_segments = -(-len(files["plain"]["model"]) // SEGMENT)
    assert total_segments == 15
    assert segments_read <= 3  # the safetensors header's segment and the tensor's own
    # The whole file, read through the same object, is what safetensors itself loads.
    with open_encrypted(files["dir"] / "model.brkw", DEK, KID) as f:
        loaded = load_safetensors(f.read())
    assert all(np.array_equal(loaded[k], v) for k, v in expected.items())


async def test_large_segments_over_https(
    files: dict[str, Any], https: tuple[str, ssl.SSLContext], tmp_path: Path
) -> None:
    base, context = https
    dest = tmp_path / "large.bin"
    await decrypt_to(f"{base}/large.brkw", dest, DEK, KID, ssl_context=context)
    assert dest.read_bytes() == files["plain"]["large"]


async def test_a_changed_segment_fails_and_leaves_no_plaintext(
    files: dict[str, Any], tmp_path: Path
) -> None:
    sealed = bytearray((files["dir"] / "blob.brkw").read_bytes())
    sealed[-100] ^= 1  # in the final segment: earlier ones decrypt first
    broken = tmp_path / "broken.brkw"
    broken.write_bytes(bytes(sealed))
    dest = tmp_path / "out.bin"
    with pytest.raises(WeightsFormatError):
        await decrypt_to(broken, dest, DEK, KID)
    assert not dest.exists()
    assert not Path(f"{dest}.partial").exists()
    with pytest.raises(WeightsFormatError):
        await decrypt_to(files["dir"] / "blob.brkw", dest, DEK, "models/other#1")
    assert not dest.exists()


def test_a_signed_url_query_stays_out_of_names_and_errors() -> None:
    source = open_source("https://127.0.0.1:9/w/model.brkw?X-Goog-Signature=secret123")
    assert source.name == "https://127.0.0.1:9/w/model.brkw"
    with pytest.raises(SourceError) as caught:
        source.read_range(0, 10)  # nothing listens: the error names the URL without its query
    assert "secret123" not in str(caught.value)


async def test_sources_refuse_what_they_cannot_serve(
    files: dict[str, Any], https: tuple[str, ssl.SSLContext], tmp_path: Path
) -> None:
    base, context = https
    with pytest.raises(SourceError):
        open_source("http://127.0.0.1:9/x.brkw")
    with pytest.raises(SourceError):
        await decrypt_to(f"{base}/missing.brkw", tmp_path / "m", DEK, KID, ssl_context=context)
    with pytest.raises(SourceError):  # an unknown CA: the TLS handshake fails
        await decrypt_to(f"{base}/blob.brkw", tmp_path / "m", DEK, KID)
    assert not (tmp_path / "m").exists()


class _Counting:
    """Wraps a source and counts the segment reads after the header."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.segments = 0

    def size(self) -> int:
        return int(self.inner.size())

    def read_range(self, start: int, length: int) -> bytes:
        if start:
            self.segments += 1
        return bytes(self.inner.read_range(start, length))

    async def aread_range(self, start: int, length: int) -> bytes:
        return self.read_range(start, length)

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        self.close()


def test_reader_reports_its_size_and_supports_seek_from_the_end(files: dict[str, Any]) -> None:
    reader = EncryptedReader(open_source(files["dir"] / "blob.brkw"), DEK, KID)
    assert reader.plaintext_size == len(files["plain"]["blob"])
    reader.seek(-10, io.SEEK_END)
    buffer = bytearray(10)
    assert reader.readinto(buffer) == 10
    assert bytes(buffer) == files["plain"]["blob"][-10:]
    reader.close()


async def test_without_a_key_id_the_dek_alone_authenticates(
    files: dict[str, Any], tmp_path: Path
) -> None:
    sealed = files["dir"] / "blob.brkw"
    with open_encrypted(sealed, DEK) as reader:  # the two-argument form
        assert reader.read() == files["plain"]["blob"]
    with pytest.raises(WeightsFormatError), open_encrypted(sealed, bytes(32)) as reader:
        reader.read()  # another DEK: the first segment does not authenticate
    dest = tmp_path / "blob.bin"
    await decrypt_to(sealed, dest, DEK)
    assert dest.read_bytes() == files["plain"]["blob"]


@dataclass
class Tricky:
    base: str
    context: ssl.SSLContext
    peers: set[Any]  # client addresses: one per connection
    credentials: list[tuple[str, str | None]]  # (Host, Authorization) of every request


@pytest.fixture
async def tricky_https(files: dict[str, Any], tmp_path: Path) -> AsyncIterator[Tricky]:
    """An HTTPS server that redirects (to itself, to another origin, to plain HTTP) or answers
    more than the range asked for, and records what each request brought."""
    tls = await asyncio.to_thread(make_dev_tls, tmp_path / "tls", now=datetime.now(UTC))
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tls.server_cert, tls.server_key)
    peers: set[Any] = set()
    credentials: list[tuple[str, str | None]] = []  # (Host, Authorization) of every request

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        credentials.append((request.host, request.headers.get("Authorization")))
        response: web.StreamResponse = await handler(request)
        return response

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"/w/{request.match_info['name']}")

    async def elsewhere(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"https://localhost:{port}/w/{request.match_info['name']}")

    async def to_plain(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://127.0.0.1:9/w/{request.match_info['name']}")

    async def oversized(request: web.Request) -> web.Response:
        blob = (files["dir"] / "blob.brkw").read_bytes()
        if request.method == "HEAD":
            return web.Response(headers={"Content-Length": str(len(blob))})
        first, _, last = request.headers["Range"].removeprefix("bytes=").partition("-")
        return web.Response(status=206, body=blob[int(first) : int(last) + 100])

    app = web.Application(middlewares=[count])
    app.router.add_static("/w/", files["dir"])
    app.router.add_get("/moved/{name}", moved)
    app.router.add_get("/plain/{name}", to_plain)
    app.router.add_get("/elsewhere/{name}", elsewhere)
    app.router.add_route("*", "/oversized/blob.brkw", oversized)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context)
    await site.start()
    port = runner.addresses[0][1]
    context = ssl.create_default_context(cafile=str(tls.ca_cert))
    yield Tricky(f"https://127.0.0.1:{port}", context, peers, credentials)
    await runner.cleanup()


async def test_sync_reads_keep_their_connections_alive(
    files: dict[str, Any], tricky_https: Tricky
) -> None:
    """``open_encrypted(url).read()`` reuses one connection per reading thread (a TLS handshake
    per segment cost two thirds of a plain download's rate, bench/sources_bench.py)."""
    base, context, peers = tricky_https.base, tricky_https.context, tricky_https.peers

    def read_all() -> bytes:
        with open_encrypted(f"{base}/w/blob.brkw", DEK, KID, ssl_context=context) as f:
            return f.read()

    assert await asyncio.to_thread(read_all) == files["plain"]["blob"]
    segments = -(-len(files["plain"]["blob"]) // SEGMENT)
    assert segments == 6
    assert len(peers) <= 1 + min(segments, READ_THREADS)  # the header's, then one per thread
    assert len(peers) < segments + 2  # without keep-alive: one per request (HEAD, header, 6)


async def test_sync_reads_follow_https_redirects_only(
    files: dict[str, Any], tricky_https: Tricky
) -> None:
    base, context = tricky_https.base, tricky_https.context

    def read(url: str) -> bytes:
        with open_encrypted(url, DEK, KID, ssl_context=context) as f:
            return f.read()

    assert await asyncio.to_thread(read, f"{base}/moved/blob.brkw") == files["plain"]["blob"]
    with pytest.raises(SourceError, match="redirected away from https"):
        await asyncio.to_thread(read, f"{base}/plain/blob.brkw")


async def test_credentials_are_not_sent_to_another_origin_a_redirect_names(
    files: dict[str, Any], tricky_https: Tricky, tmp_path: Path
) -> None:
    base, context = tricky_https.base, tricky_https.context

    def read() -> bytes:
        headers = {"Authorization": "Bearer for-127.0.0.1-only"}
        url = f"{base}/elsewhere/blob.brkw"  # -> https://localhost:PORT/w/blob.brkw
        with open_encrypted(url, DEK, KID, ssl_context=context, headers=headers) as f:
            return f.read()

    assert await asyncio.to_thread(read) == files["plain"]["blob"]
    dest = tmp_path / "blob.bin"  # the async path (aiohttp) too
    await decrypt_to(
        f"{base}/elsewhere/blob.brkw",
        dest,
        DEK,
        KID,
        ssl_context=context,
        headers={"Authorization": "Bearer for-127.0.0.1-only"},
    )
    assert dest.read_bytes() == files["plain"]["blob"]
    by_host: dict[str, set[str | None]] = {}
    for host, auth in tricky_https.credentials:
        by_host.setdefault(host.split(":")[0], set()).add(auth)
    assert by_host["127.0.0.1"] == {"Bearer for-127.0.0.1-only"}  # the URL's own origin
    assert by_host["localhost"] == {None}  # the origin a redirect named


async def test_a_range_answered_with_more_bytes_is_refused(tricky_https: Tricky) -> None:
    base, context = tricky_https.base, tricky_https.context
    source = open_source(f"{base}/oversized/blob.brkw", ssl_context=context)
    try:
        with pytest.raises(SourceError, match="answered 206"):
            await asyncio.to_thread(source.read_range, 0, 100)
    finally:
        source.close()
