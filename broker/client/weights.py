"""Runner side of the weights data path: read encrypted weights from where they are stored,
decrypt them with the released DEK — all of a file (``decrypt_to``, async, parallel) or any part
of it (``open_encrypted``, a seekable read-only file object).

Sources (``open_source``): a local path, an ``https://`` URL (ranged GETs: aiohttp when async,
the standard library when sync), or ``gs://bucket/object`` through ``google-cloud-storage``
(ranged reads; point ``STORAGE_EMULATOR_HOST`` at an emulator to test). Every byte handed out has
been authenticated: a segment is decrypted whole before any of it is returned.

    dek = released.dek
    with open_encrypted("gs://weights/llama.safetensors.brkw", dek, kid) as f:
        f.seek(offset); tensor_bytes = f.read(length)          # decrypts only those segments
    await decrypt_to("https://cdn.example/llama.brkw", "/dev/shm/llama", dek, kid,
                     progress=lambda done, total: ...)
"""

from __future__ import annotations

import asyncio
import http.client
import io
import os
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urljoin, urlsplit, urlunsplit

import aiohttp

from broker.crypto.weights import (
    MAX_HEADER_BYTES,
    TAG_BYTES,
    Header,
    SealedFile,
    SegmentCipher,
    WeightsFormatError,
)

Progress = Callable[[int, int], None]  # (plaintext bytes done, plaintext bytes in all)
DEFAULT_PARALLELISM = min(8, os.cpu_count() or 1)
# open_encrypted(…).read(): as many segments in flight as decrypt_to keeps (a remote source
# waits on the network; with DEFAULT_PARALLELISM it reached 0.72 of a plain HTTPS download)
READ_THREADS = 2 * DEFAULT_PARALLELISM
MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})


class SourceError(OSError):
    """The encrypted file could not be read from its source."""


class RangeSource(Protocol):
    """Where an encrypted file lives: its size and any byte range, sync and async."""

    name: str

    def size(self) -> int: ...

    def read_range(self, start: int, length: int) -> bytes: ...

    async def aread_range(self, start: int, length: int) -> bytes: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


class LocalSource:
    def __init__(self, path: str | Path) -> None:
        self.name = str(path)
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise SourceError(f"cannot open {path}: {exc.strerror}") from exc

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read_range(self, start: int, length: int) -> bytes:
        data = os.pread(self._fd, length, start)
        if len(data) != length:
            raise SourceError(f"{self.name}: short read at {start}")
        return data

    def read_range_into(self, start: int, buffer: memoryview) -> None:
        """``read_range`` into a caller's buffer (``len(buffer)`` bytes): no allocation."""
        done = 0
        while done < len(buffer):
            got = os.preadv(self._fd, [buffer[done:]], start + done)
            if got <= 0:
                raise SourceError(f"{self.name}: short read at {start + done}")
            done += got

    async def aread_range(self, start: int, length: int) -> bytes:
        return await asyncio.to_thread(self.read_range, start, length)

    def close(self) -> None:
        os.close(self._fd)

    async def aclose(self) -> None:
        self.close()


class HttpsSource:
    """Ranged GETs (RFC 9110 §14): every answer must be ``206`` with exactly the asked range."""

    def __init__(
        self,
        url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        headers: dict[str, str] | None = None,
        timeout_seconds: float = 60.0,
    ) -> None:
        self.name = _without_query(
            url
        )  # a signed URL's query is a credential: kept out of messages
        self._url = url
        self._ssl = ssl_context if ssl_context is not None else ssl.create_default_context()
        self._headers = dict(headers or {})
        self._timeout = timeout_seconds
        self._size: int | None = None
        self._session: aiohttp.ClientSession | None = None
        self._local = threading.local()  # sync reads: one kept-alive connection per thread
        self._opened: list[http.client.HTTPSConnection] = []
        self._opened_lock = threading.Lock()

    def size(self) -> int:
        if self._size is None:
            status, headers, _ = self._exchange("HEAD", {}, limit=0)
            length = headers.get("Content-Length", "")
            if status != 200 or not length.isdigit():
                raise SourceError(f"{self.name}: no size (answered {status})")
            self._size = int(length)
        return self._size

    def read_range(self, start: int, length: int) -> bytes:
        status, _, data = self._exchange(
            "GET", {"Range": f"bytes={start}-{start + length - 1}"}, limit=length
        )
        return self._checked(status, data, start, length)

    def _exchange(
        self, method: str, extra: dict[str, str], *, limit: int
    ) -> tuple[int, Any, bytes]:
        """One request on this thread's kept-alive connection (a new TLS handshake per range
        held ``open_encrypted(…).read()`` to a third of a plain download), following up to
        ``MAX_REDIRECTS`` redirects to other ``https`` URLs (a CDN or a signed URL may
        redirect). The caller's headers (credentials, say) go to the URL's own origin only,
        never to another a redirect names. A connection the server closed is reopened once. At
        most ``limit`` + 1 bytes of a body are read (a server cannot make us hold more); a
        connection with unread bytes left is closed, never reused."""
        url = self._url
        origin = _origin(url)
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme != "https" or parts.hostname is None:
                raise SourceError(f"{self.name}: redirected away from https")
            target = urlunsplit(("", "", parts.path or "/", parts.query, ""))
            own = self._headers if _origin(url) == origin else {}
            headers = {**own, **extra}
            for attempt in (0, 1):
                connection = self._connection(parts.hostname, parts.port or 443, fresh=attempt > 0)
                try:
                    connection.request(method, target, headers=headers)
                    response = connection.getresponse()
                    data = response.read(max(limit, 65536) + 1)  # HEAD: b"", and done
                    if not response.isclosed():
                        connection.close()  # more than we read: this connection is spent
                    break
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                    connection.close()
                    if attempt:
                        raise SourceError(f"{self.name}: the connection was closed") from None
                except (OSError, http.client.HTTPException) as exc:
                    connection.close()
                    raise SourceError(f"{self.name}: {method}: {exc}") from exc
            if response.status in REDIRECTS and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location"))
                continue
            return response.status, response.headers, data
        raise SourceError(f"{self.name}: more than {MAX_REDIRECTS} redirects")

    def _connection(self, host: str, port: int, *, fresh: bool) -> http.client.HTTPSConnection:
        connections: dict[tuple[str, int], http.client.HTTPSConnection] = getattr(
            self._local, "connections", {}
        )
        self._local.connections = connections
        connection = connections.get((host, port))
        if connection is None or fresh:
            if connection is not None:
                connection.close()
            connection = http.client.HTTPSConnection(
                host, port, context=self._ssl, timeout=self._timeout
            )
            connections[(host, port)] = connection
            with self._opened_lock:
                self._opened.append(connection)
        return connection

    async def aread_range(self, start: int, length: int) -> bytes:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout)
            )
        headers = {**self._headers, "Range": f"bytes={start}-{start + length - 1}"}
        try:
            async with self._session.get(self._url, headers=headers, ssl=self._ssl) as response:
                if response.status != 206 or response.content_length != length:
                    return self._checked(response.status, b"", start, length)
                data = await response.content.readexactly(length)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise SourceError(f"{self.name}: range {start}+{length}: {exc}") from exc
        return self._checked(status, data, start, length)

    def _checked(self, status: int, data: bytes, start: int, length: int) -> bytes:
        if status != 206 or len(data) != length:  # a 200 would be the whole file: refuse
            raise SourceError(f"{self.name}: range {start}+{length} answered {status}")
        return data

    async def aclose(self) -> None:
        """Closes the session and the connections sync reads opened (the header is read sync)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.close()

    def close(self) -> None:
        """Closes the sync reads' connections; async users close the session with ``aclose``."""
        with self._opened_lock:
            opened, self._opened = self._opened, []
        for connection in opened:
            connection.close()


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or 443


def _gcs_errors() -> tuple[type[BaseException], ...]:
    from google.api_core.exceptions import GoogleAPIError  # noqa: PLC0415
    from google.auth.exceptions import GoogleAuthError  # noqa: PLC0415
    from requests import RequestException  # noqa: PLC0415 - the storage client's transport

    return (GoogleAPIError, GoogleAuthError, RequestException)


class GcsSource:
    """``gs://bucket/object`` through google-cloud-storage (ranged downloads)."""

    def __init__(self, uri: str, *, client: Any | None = None) -> None:
        # Only runners reading GCS need the client (the ``gcs`` extra); others never import it.
        try:
            from google.cloud import storage  # type: ignore[attr-defined,import-untyped,unused-ignore]  # noqa: PLC0415

            self._errors = _gcs_errors()
        except ImportError as exc:
            raise SourceError(
                f"{uri}: gs:// needs google-cloud-storage (pip install 'sealed-runner-broker[gcs]')"
            ) from exc
        bucket, _, name = uri.removeprefix("gs://").partition("/")
        if not bucket or not name:
            raise SourceError(f"{uri}: expected gs://BUCKET/OBJECT")
        self.name = uri
        self._client = client if client is not None else storage.Client()
        self._blob = self._client.bucket(bucket).blob(name)
        self._size: int | None = None

    def size(self) -> int:
        if self._size is None:
            try:
                self._blob.reload()
            except self._errors as exc:
                raise SourceError(f"{self.name}: {type(exc).__name__}") from exc
            self._size = int(self._blob.size)
        return self._size

    def read_range(self, start: int, length: int) -> bytes:
        try:
            data: bytes = self._blob.download_as_bytes(
                start=start, end=start + length - 1, checksum=None, raw_download=True
            )
        except self._errors as exc:
            raise SourceError(f"{self.name}: range {start}+{length}: {type(exc).__name__}") from exc
        if len(data) != length:
            raise SourceError(f"{self.name}: range {start}+{length} returned {len(data)} bytes")
        return data

    async def aread_range(self, start: int, length: int) -> bytes:
        return await asyncio.to_thread(self.read_range, start, length)

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def open_source(source: str | Path | RangeSource, **options: Any) -> RangeSource:
    """A ``RangeSource`` for a path, ``https://`` URL or ``gs://`` URI (or one given as is).

    ``options`` go to the source (``ssl_context``/``headers`` for HTTPS, ``client`` for GCS).
    Plain ``http://`` is refused: weights travel encrypted, but a runner must not be pointed
    at a man in the middle that can stall or swap files silently.
    """
    if not isinstance(source, str | Path):
        return source
    text = str(source)
    if text.startswith("https://"):
        return HttpsSource(text, **options)
    if text.startswith("gs://"):
        return GcsSource(text, **options)
    if "://" in text:
        raise SourceError(f"{text}: unsupported source (a path, https:// or gs://)")
    return LocalSource(text)


def _without_query(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query="", fragment=""))


def key_of_file(source: str | Path, options: dict[str, Any]) -> tuple[str, int]:
    """``(key, version)`` an encrypted file was made with, from its header (``<key>#<version>``).

    Raises:
        WeightsFormatError: not a BRKW1 file, or a key id that is not ``<key>#<version>``.
        SourceError: the file cannot be read.
    """
    opened = open_source(source, **options)
    try:
        kid = read_sealed(opened).header.kid
    finally:
        opened.close()
    name, _, version = kid.rpartition("#")
    if not name or not version.isdigit():
        raise WeightsFormatError(f"key id {kid!r} is not <key>#<version>")
    return name, int(version)


def read_sealed(source: RangeSource) -> SealedFile:
    """A file's header and size (one ranged read), before any key is needed.

    Raises:
        WeightsFormatError: when it is not a BRKW1 file.
    """
    size = source.size()
    head = source.read_range(0, min(size, MAX_HEADER_BYTES))
    return SealedFile(Header.parse(head), size)


class EncryptedReader(io.RawIOBase):
    """A read-only, seekable view of the plaintext; decrypts only the segments it reads and
    keeps the last one (sequential reads decrypt each segment once)."""

    def __init__(self, source: RangeSource, dek: bytes, kid: str | None = None) -> None:
        super().__init__()
        self._source = source
        self._cipher = SegmentCipher(dek, read_sealed(source), kid)
        self._position = 0
        self._cached: tuple[int, bytes] | None = None

    @property
    def plaintext_size(self) -> int:
        return self._cipher.sealed.plaintext_size

    @property
    def segment_size(self) -> int:
        return self._cipher.sealed.header.segment_size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.plaintext_size}
        target = base[whence] + offset
        if target < 0:
            raise ValueError("negative seek position")
        self._position = target
        return target

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        written = 0
        segment_size = self._cipher.sealed.header.segment_size
        while written < len(view) and self._position < self.plaintext_size:
            index, within = divmod(self._position, segment_size)
            if within == 0 and len(view) - written >= segment_size:
                # A whole segment wanted: decrypt straight into the caller's buffer.
                start, length = self._cipher.sealed.span(index)
                size = self._cipher.open_into(
                    index, self._source.read_range(start, length), view[written:]
                )
                written += size
                self._position += size
                continue
            plain = self._segment(index)
            piece = plain[within : within + len(view) - written]
            view[written : written + len(piece)] = piece
            written += len(piece)
            self._position += len(piece)
        return written

    def readall(self) -> bytes:
        """The rest of the plaintext, its segments fetched and decrypted by a few threads
        (AES-GCM releases the GIL), then joined once: ``open_encrypted(…).read()`` at the
        cipher's rate, not 8 KiB at a time as ``RawIOBase.readall`` would."""
        sealed = self._cipher.sealed
        segment_size = sealed.header.segment_size
        first, within = divmod(self._position, segment_size)
        pieces: list[bytes] = []
        if within and first < sealed.segments:  # the rest of the segment the position is in
            pieces.append(self._segment(first)[within:])
            first += 1

        def open_one(index: int) -> bytes:
            start, length = sealed.span(index)
            return self._cipher.open(index, self._source.read_range(start, length))

        with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            pieces.extend(pool.map(open_one, range(first, sealed.segments)))
        self._position = max(self._position, self.plaintext_size)
        return b"".join(pieces)

    def _segment(self, index: int) -> bytes:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        start, length = self._cipher.sealed.span(index)
        plain = self._cipher.open(index, self._source.read_range(start, length))
        self._cached = (index, plain)
        return plain

    def close(self) -> None:
        if not self.closed:
            self._source.close()
        super().close()


def open_encrypted(
    source: str | Path | RangeSource, dek: bytes, kid: str | None = None, **options: Any
) -> io.BufferedReader:
    """The plaintext of an encrypted weights file as a seekable binary file object.

    ``kid`` (``"<key>#<version>"``), when given, must be the file's: pass it to refuse a file
    meant for another key version up front; without it the DEK alone authenticates every segment.

    Raises:
        WeightsFormatError: a wrong key id (checked before any read past the header), a wrong
            key or a changed file (when a segment is read).
        SourceError: when the source cannot be read.
    """
    reader = EncryptedReader(open_source(source, **options), dek, kid)
    return io.BufferedReader(reader, buffer_size=reader.segment_size)


async def decrypt_to(
    source: str | Path | RangeSource,
    dest: str | Path,
    dek: bytes,
    kid: str | None = None,
    *,
    progress: Progress | None = None,
    parallelism: int = DEFAULT_PARALLELISM,
    **options: Any,
) -> int:
    """Decrypt a whole file to ``dest`` without blocking the event loop; return its size.

    Segments are fetched and decrypted ``parallelism`` at a time (AES-GCM releases the GIL, so
    threads decrypt in parallel) and written at their offsets; at most ``2 * parallelism``
    segments are in memory. ``dest`` is written to ``<dest>.partial`` and renamed only once
    every segment has authenticated: a failed or cancelled run leaves no plaintext file behind.

    Raises:
        WeightsFormatError, SourceError.
    """
    opened = open_source(source, **options)
    partial = Path(f"{dest}.partial")
    pool = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="weights")
    loop = asyncio.get_running_loop()
    try:
        sealed = await loop.run_in_executor(pool, read_sealed, opened)
        cipher = SegmentCipher(dek, sealed, kid)
        fd = await loop.run_in_executor(
            pool, lambda: os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        )
        try:
            await _decrypt_segments(
                opened, cipher, fd, pool=pool, workers=2 * parallelism, progress=progress
            )
            await loop.run_in_executor(pool, os.fsync, fd)
        finally:
            await loop.run_in_executor(pool, os.close, fd)
        await loop.run_in_executor(pool, os.replace, partial, dest)
        return sealed.plaintext_size
    finally:  # a failed or cancelled run leaves no partial file (renamed after a success)
        await asyncio.shield(loop.run_in_executor(pool, _remove, partial))
        await opened.aclose()
        pool.shutdown(wait=False)


async def _decrypt_segments(
    opened: RangeSource,
    cipher: SegmentCipher,
    fd: int,
    *,
    pool: ThreadPoolExecutor,
    workers: int,
    progress: Progress | None,
) -> None:
    """``workers`` coroutines take segment indexes in turn, each decrypting into a buffer of its
    own (no fresh megabyte per segment: allocation and page faults cost more than AES-GCM
    itself) and writing at the segment's offset; memory stays the same whatever the size."""
    loop = asyncio.get_running_loop()
    sealed = cipher.sealed
    indexes = iter(range(sealed.segments))
    done, total = 0, sealed.plaintext_size

    def open_and_write(index: int, data: bytes | memoryview, buffer: bytearray) -> int:
        size = cipher.open_into(index, data, buffer)
        view = memoryview(buffer)[:size]
        offset = index * sealed.header.segment_size
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
        return size

    read_into = getattr(opened, "read_range_into", None)  # a local file: no copy, one hop

    def read_open_and_write(index: int, sealed_buffer: bytearray, buffer: bytearray) -> int:
        start, length = sealed.span(index)
        view = memoryview(sealed_buffer)[:length]
        read_into(start, view)  # type: ignore[misc]
        return open_and_write(index, view, buffer)

    async def worker() -> None:
        nonlocal done
        buffer = bytearray(sealed.header.segment_size)
        sealed_buffer = bytearray(sealed.header.segment_size + TAG_BYTES)
        for index in indexes:
            if read_into is not None:
                size = await loop.run_in_executor(
                    pool, read_open_and_write, index, sealed_buffer, buffer
                )
            else:
                start, length = sealed.span(index)
                data = await opened.aread_range(start, length)
                size = await loop.run_in_executor(pool, open_and_write, index, data, buffer)
            done += size  # after the await: `done += await …` would read `done` before it
            if progress is not None:
                progress(done, total)

    tasks = [asyncio.create_task(worker()) for _ in range(workers)]
    try:
        await asyncio.gather(*tasks)
    finally:  # one failed or the caller was cancelled: stop the others (no-op when all done)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


__all__ = [
    "EncryptedReader",
    "GcsSource",
    "HttpsSource",
    "LocalSource",
    "RangeSource",
    "SourceError",
    "WeightsFormatError",
    "decrypt_to",
    "open_encrypted",
    "open_source",
    "read_sealed",
]
