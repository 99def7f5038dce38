"""Encrypted weights from ``https://`` and ``gs://`` through the public SDK, against a plain ranged
download of the same object from the same server, in the same run (issue 21, item 2).

    .venv/bin/python bench/sources_bench.py            # 256 MiB; --mib 64 for a quick look

Servers, each its own process on 127.0.0.1: aiohttp serving the file over TLS (Range is
aiohttp's own, the certificate from ``broker.dev.tls``), and fake-gcs-server (``make test``
builds it) holding it in memory. For each source:

* ``plain``: the same byte ranges the SDK asks for (one per segment), fetched by the same client
  library with the same number of requests in flight, nothing decrypted, ending where the SDK's
  output ends: assembled into one object in memory, or written into a file on tmpfs;
* ``read``: ``open_encrypted(url, dek, kid, …).read()``, the sync reader, against the plain
  download into memory (the whole plaintext ends in memory by definition: no RSS target);
* ``decrypt_to``: ``await decrypt_to(url, "/dev/shm/…", dek, kid, …)`` exactly as docs/runner.md
  shows it, in a fresh process whose peak RSS is reported (target: < 100 MiB for 1 GiB), against
  the plain download into a file.

Printed: GB/s of each and the SDK's ratio to its plain download (target >= 0.8). On 2 cores the
server, the client and the decryption share the CPU: the ratios are what a runner here sees.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Only what a runner imports at module level: the child that measures decrypt_to's peak RSS
# must not carry the bench's own tools (pytest, the development CA, the servers' helpers).
from broker.client.weights import (
    DEFAULT_PARALLELISM,
    decrypt_to,
    open_encrypted,
    open_source,
    read_sealed,
)

DEK = bytes(range(32))
KID = "models/bench#1"
OBJECT = "model.brkw"
IN_FLIGHT = 2 * DEFAULT_PARALLELISM  # what decrypt_to keeps in flight

HTTPS_SERVER = """
import ssl, sys
import uvloop
from aiohttp import web
uvloop.install()
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
context.load_cert_chain(sys.argv[3], sys.argv[4])
app = web.Application()
app.router.add_static("/w/", sys.argv[2])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), ssl_context=context, print=None,
            access_log=None)
"""


def gbps(size: int, seconds: float) -> float:
    return round(size / seconds / 1e9, 3)


def spans(source: str, options: dict[str, Any]) -> list[tuple[int, int]]:
    """The ranges the SDK reads: one per segment (the header is read once before)."""
    opened = open_source(source, **options)
    try:
        sealed = read_sealed(opened)
        return [sealed.span(index) for index in range(sealed.segments)]
    finally:
        opened.close()


class Sink:
    """Where a plain download puts each range: assembled into one object in memory (what
    ``open_encrypted(…).read()`` returns), or written at its offset into a file on tmpfs and
    fsync'd (what ``decrypt_to`` does). The SDK is compared with the plain download that ends
    in the same place."""

    def __init__(self, ranges: list[tuple[int, int]], path: Path | None) -> None:
        self._pieces: list[bytes] = [b""] * len(ranges)
        self._path = path
        self._fd = -1 if path is None else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        first = ranges[0][0]
        self._offsets = [start - first for start, _ in ranges]

    def put(self, index: int, data: bytes) -> None:
        if self._fd < 0:
            self._pieces[index] = data
        else:
            os.pwrite(self._fd, data, self._offsets[index])

    def finish(self) -> None:
        if self._fd < 0:
            whole = b"".join(self._pieces)
            assert whole
            self._pieces = []
        else:
            os.fsync(self._fd)
            os.close(self._fd)
            assert self._path is not None
            self._path.unlink()


async def plain_https(
    url: str, context: ssl.SSLContext, ranges: list[tuple[int, int]], path: Path | None
) -> float:
    """Ranged GETs with aiohttp (the SDK's async client), IN_FLIGHT at a time, into ``Sink``."""
    import aiohttp  # noqa: PLC0415

    queue = list(reversed(list(enumerate(ranges))))
    sink = Sink(ranges, path)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            while queue:
                index, (start, length) = queue.pop()
                headers = {"Range": f"bytes={start}-{start + length - 1}"}
                async with session.get(url, headers=headers, ssl=context) as response:
                    assert response.status == 206
                    data = await response.read()
                    assert len(data) == length
                if path is None:
                    sink.put(index, data)
                else:  # a file write blocks: off the loop, as decrypt_to's are
                    await loop.run_in_executor(None, sink.put, index, data)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        await loop.run_in_executor(None, sink.finish)
        return time.perf_counter() - started


def plain_gcs(uri: str, client: Any, ranges: list[tuple[int, int]], path: Path | None) -> float:
    """Ranged downloads with google-cloud-storage (the SDK's GCS client), IN_FLIGHT threads,
    into ``Sink``."""
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    blob = client.bucket(bucket).blob(name)
    sink = Sink(ranges, path)

    def one(index: int) -> None:
        start, length = ranges[index]
        data = blob.download_as_bytes(
            start=start, end=start + length - 1, checksum=None, raw_download=True
        )
        assert len(data) == length
        sink.put(index, data)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=IN_FLIGHT) as pool:
        list(pool.map(one, range(len(ranges))))
    sink.finish()
    return time.perf_counter() - started


def gcs_client() -> Any:
    from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415
    from google.cloud import storage  # type: ignore[attr-defined]  # noqa: PLC0415

    return storage.Client(project="bench", credentials=AnonymousCredentials())  # type: ignore[no-untyped-call]


def child(kind: str, source: str, target: str, cafile: str) -> None:
    """``decrypt_to`` from ``source`` in this fresh process: seconds and peak RSS."""
    options: dict[str, Any] = {}
    if kind == "https":
        options["ssl_context"] = ssl.create_default_context(cafile=cafile)
    else:
        options["client"] = gcs_client()
    started = time.perf_counter()
    asyncio.run(decrypt_to(source, target, DEK, KID, **options))
    seconds = time.perf_counter() - started
    status = Path("/proc/self/status").read_text()
    peak_kib = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")
    )
    print(json.dumps({"seconds": seconds, "peak_rss_mib": round(peak_kib / 1024, 1)}))


def run_child(kind: str, source: str, target: Path, cafile: Path, environ: dict[str, str]) -> Any:
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, source, str(target), str(cafile)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **environ},
    )
    target.unlink()
    return json.loads(done.stdout)


def measure(
    kind: str,
    source: str,
    options: dict[str, Any],
    plain: Any,
    out: Path,
    cafile: Path,
    environ: dict[str, str],
    size: int,
) -> dict[str, Any]:
    ranges = spans(source, options)
    plain(None)  # warm: connections, the server's page cache
    to_memory = min(plain(None) for _ in range(2))
    to_file = min(plain(out) for _ in range(2))
    started = time.perf_counter()
    with open_encrypted(source, DEK, KID, **options) as reader:
        got = len(reader.read())
    read_s = time.perf_counter() - started
    assert got == size
    figures = run_child(kind, source, out, cafile, environ)
    return {
        f"{kind}_segments": len(ranges),
        f"{kind}_plain_ranged_download_to_memory_gbps": gbps(size, to_memory),
        f"{kind}_plain_ranged_download_to_file_gbps": gbps(size, to_file),
        f"{kind}_sdk_read_gbps": gbps(size, read_s),
        f"{kind}_sdk_read_vs_plain_to_memory": round(to_memory / read_s, 2),
        f"{kind}_sdk_decrypt_to_gbps": gbps(size, figures["seconds"]),
        f"{kind}_sdk_decrypt_to_vs_plain_to_file": round(to_file / figures["seconds"], 2),
        f"{kind}_sdk_decrypt_to_peak_rss_mib": figures["peak_rss_mib"],
    }


def main(mib: int) -> int:
    from broker.crypto.weights import encrypt_stream  # noqa: PLC0415
    from broker.dev.tls import make_dev_tls  # noqa: PLC0415
    from tests.support.processes import fake_gcs_server, free_port, wait_until  # noqa: PLC0415

    size = mib * 2**20
    shm = Path("/dev/shm")
    report: dict[str, Any] = {"size_mib": mib, "in_flight": IN_FLIGHT, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(
        prefix="broker-sources-", dir=shm if shm.is_dir() else None
    ) as tmp:
        work = Path(tmp)
        files, bucket = work / "files", work / "seed" / "weights"
        files.mkdir()
        bucket.mkdir(parents=True)
        data = os.urandom(size)
        with (files / OBJECT).open("wb") as sink:
            encrypt_stream(DEK, KID, io.BytesIO(data), sink)
        del data
        shutil.copy(files / OBJECT, bucket / OBJECT)
        tls = make_dev_tls(work / "tls", now=datetime.now(UTC))
        tls_files = (str(tls.server_cert), str(tls.server_key))
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-c", HTTPS_SERVER, str(port), str(files), *tls_files],
            stderr=subprocess.DEVNULL,
        )
        try:
            context = ssl.create_default_context(cafile=str(tls.ca_cert))
            url = f"https://127.0.0.1:{port}/w/{OBJECT}"

            def accepts() -> bool:
                return open_source(url, ssl_context=context).size() > 0

            wait_until(accepts, what="the HTTPS file server")
            ranges = spans(url, {"ssl_context": context})
            report |= measure(
                "https",
                url,
                {"ssl_context": context},
                lambda path: asyncio.run(plain_https(url, context, ranges, path)),
                work / "out",
                tls.ca_cert,
                {},
                size,
            )
        finally:
            server.terminate()
            server.wait(timeout=10)
        with fake_gcs_server(work / "seed") as gcs_port:
            environ = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{gcs_port}"}
            os.environ.update(environ)
            client = gcs_client()
            uri = f"gs://weights/{OBJECT}"
            ranges = spans(uri, {"client": client})
            report |= measure(
                "gs",
                uri,
                {"client": client},
                lambda path: plain_gcs(uri, client, ranges, path),
                work / "out",
                tls.ca_cert,
                environ,
                size,
            )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
        raise SystemExit(0)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256)
    raise SystemExit(main(parser.parse_args().mib))
