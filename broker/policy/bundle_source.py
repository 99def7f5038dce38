"""Where replicas get their policy: a bundle server, as OPA's bundle service does it.

``[policy] bundle_url`` names an OPA bundle (``broker policy build`` output) at ``https://…``
(plain ``http://`` only on loopback, for tests) or ``gs://BUCKET/OBJECT``. The broker fetches it
at start-up and polls it every ``reload_seconds`` (±20 % jitter, so replicas do not poll in step)
with a conditional request — ``If-None-Match`` with the last ``ETag`` over HTTPS, the object's
generation on Cloud Storage — and reloads only when it changed. The bytes fetched are the bytes
verified and loaded (``bundle_loader``: signature required when
``bundle_verification_key`` is set). A private CA for the HTTPS server: ``[policy] bundle_ca``
(PEM), used for this source only. Every failure is an ``UpstreamError`` naming the source;
the last good policy keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from broker.core.errors import ErrorCode, UpstreamError
from broker.core.refs import BundleRef, GcsBundleRef
from broker.policy.opa_bundle import MAX_BUNDLE_BYTES

FETCH_TIMEOUT_SECONDS = 30.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class BundleSource(Protocol):
    name: str

    async def fetch(self) -> bytes:
        """The bundle's bytes now (start-up, SIGHUP, admin reload)."""
        ...

    async def changed(self) -> bytes | None:
        """The bundle's bytes if they changed since the last fetch, else ``None``."""
        ...


def open_bundle_source(
    ref: BundleRef, session: aiohttp.ClientSession, *, tls: ssl.SSLContext | None = None
) -> BundleSource:
    """The source ``[policy] bundle_url`` names (``PolicySettings.bundle_ref``); ``tls``
    verifies an HTTPS server with a private CA (``[policy] bundle_ca``), else the system's
    trust store."""
    if isinstance(ref, GcsBundleRef):
        return GcsBundleSource(ref)
    return HttpBundleSource(ref.uri, session, tls=tls)


def _unavailable(name: str, problem: str) -> UpstreamError:
    return UpstreamError(f"bundle {name}: {problem}", code=ErrorCode.POLICY_UNAVAILABLE)


class HttpBundleSource:
    """An HTTPS bundle server; conditional GETs with ``If-None-Match``."""

    def __init__(
        self, url: str, session: aiohttp.ClientSession, *, tls: ssl.SSLContext | None = None
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "https" and not (
            parts.scheme == "http" and parts.hostname in LOOPBACK_HOSTS
        ):
            raise ValueError("bundle_url must be https:// (http:// only on loopback) or gs://")
        self.name = url
        self._session = session
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True
        self._etag: str | None = None

    async def fetch(self) -> bytes:
        body = await self._get(conditional=False)
        assert body is not None  # noqa: S101 - an unconditional GET has a body or raised
        return body

    async def changed(self) -> bytes | None:
        return await self._get(conditional=True)

    async def _get(self, *, conditional: bool) -> bytes | None:
        headers = {"If-None-Match": self._etag} if conditional and self._etag else {}
        try:
            async with self._session.get(
                self.name,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_SECONDS),
                allow_redirects=False,
                ssl=self._tls,
            ) as response:
                if response.status == 304 and conditional:
                    return None
                if response.status != 200:
                    raise _unavailable(self.name, f"HTTP {response.status}")
                body = bytearray()
                async for chunk in response.content.iter_chunked(64 * 1024):
                    body += chunk
                    if len(body) > MAX_BUNDLE_BYTES:
                        raise _unavailable(self.name, f"larger than {MAX_BUNDLE_BYTES} bytes")
                self._etag = response.headers.get("ETag")
                return bytes(body)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _unavailable(self.name, type(exc).__name__) from exc


class GcsBundleSource:
    """``gs://BUCKET/OBJECT`` through google-cloud-storage; a change is a new generation.
    ``STORAGE_EMULATOR_HOST`` (the library's own convention) points it at an emulator."""

    def __init__(self, ref: GcsBundleRef) -> None:
        if not ref.bucket or not ref.name:
            raise ValueError("bundle_url gs:// needs gs://BUCKET/OBJECT")
        self.name = ref.uri
        self._bucket, self._object = ref.bucket, ref.name
        self._client: Any = None
        self._generation: int | None = None

    async def fetch(self) -> bytes:
        data = await asyncio.to_thread(self._download, None)
        assert data is not None  # noqa: S101 - with no known generation there is always a body
        return data

    async def changed(self) -> bytes | None:
        return await asyncio.to_thread(self._download, self._generation)

    def _download(self, known: int | None) -> bytes | None:
        from google.api_core import exceptions  # noqa: PLC0415
        from requests import RequestException  # noqa: PLC0415 - the storage client's transport

        try:
            blob = self._blob_handle()
            blob.reload()
            generation = int(blob.generation)
            if known is not None and generation == known:
                return None
            if int(blob.size) > MAX_BUNDLE_BYTES:
                raise _unavailable(self.name, f"larger than {MAX_BUNDLE_BYTES} bytes")
            data: bytes = blob.download_as_bytes(if_generation_match=generation)
        except (exceptions.GoogleAPIError, RequestException, OSError) as exc:
            raise _unavailable(self.name, type(exc).__name__) from exc
        self._generation = generation
        return data

    def _blob_handle(self) -> Any:
        """A fresh handle each time: a reloaded one is pinned to the generation it read."""
        if self._client is None:
            from google.cloud import storage  # type: ignore[attr-defined,import-untyped,unused-ignore]  # noqa: PLC0415

            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415

                anonymous = AnonymousCredentials()  # type: ignore[no-untyped-call]
                self._client = storage.Client(project="emulator", credentials=anonymous)
            else:
                self._client = storage.Client()
        return self._client.bucket(self._bucket).blob(self._object)
