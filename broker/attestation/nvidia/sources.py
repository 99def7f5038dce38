"""Async ports for local GPU verification: RIM retrieval and OCSP. All I/O for NVIDIA lives here.

* ``RimSource``: RIM bytes by id, from a directory (``<dir>/<id>.swidtag``) and/or NVIDIA's RIM
  service (``GET <rim_url>/<id>`` → ``{"id", "rim": base64, "sha256"}``), cached for
  ``rim_cache_seconds``. A RIM that cannot be had raises ``RimUnavailable``; the GPU's
  measurements then read ``unverified`` and the policy decides (never a silent pass). A RIM
  directory that exists but cannot be read is a broken dependency: 503
  ``rim_source_unavailable``, nothing released.
* ``OcspSource``: OCSP responses (bytes) for a chain's certificates. The pipeline judges them
  (``nvidia/ocsp.py``, pure); without a configured responder, or when it cannot be reached,
  there is no answer and the status reads ``unknown``.

The service (``attestation/service.py``) asks these only for reports whose chain and signature
verified, within a per-request budget; each request that actually leaves the broker is counted
(``on_request``: ``broker_outbound_requests_total{kind="rim"|"ocsp"}``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509 import ocsp

from broker.attestation.nvidia.ocsp import CertKey, cert_key, ocsp_pairs, verify_ocsp_response
from broker.attestation.nvidia.rim import is_known_rim_id
from broker.core.errors import ErrorCode, UpstreamError

log = logging.getLogger(__name__)
MAX_RIM_RESPONSE_BYTES = 2 * 1024 * 1024
MAX_OCSP_RESPONSE_BYTES = 64 * 1024
CertPair = tuple[x509.Certificate, x509.Certificate]  # (certificate, its issuer)
OnRequest = Callable[[], None]  # told of each request that leaves the broker (a metric)


class RimSource(Protocol):
    async def get(self, rim_id: str) -> bytes:
        """The signed RIM XML; raise ``RimUnavailable`` when it cannot be had."""
        ...


class OcspSource(Protocol):
    async def responses(
        self, chain: Sequence[x509.Certificate], now: datetime, *, include_leaf: bool = False
    ) -> dict[CertKey, bytes]:
        """The DER OCSP responses it could get for the chain (leaf first, root last), by
        ``ocsp.cert_key``; a certificate it has no answer for is absent (reads ``unknown``).

        Every certificate below the root is asked about; a GPU chain's FMC leaf is not
        (NVIDIA's OCSP does not cover it: docs/evidence.md), a RIM signer chain's leaf is
        (``include_leaf``).
        """
        ...

    async def answers(self, pairs: Sequence[CertPair], now: datetime) -> dict[CertKey, bytes]:
        """The DER OCSP responses it could get for these (certificate, issuer) pairs."""
        ...


class RimUnavailable(Exception):
    """The RIM could not be had; the GPU's measurements read ``unverified``."""


class CachingRimSource:
    """Directory first, then the RIM service; results cached in memory."""

    def __init__(
        self,
        *,
        directory: Path | None,
        url: str | None,
        session: aiohttp.ClientSession | None,
        cache_seconds: float,
        timeout_seconds: float,
        on_request: OnRequest | None = None,
    ) -> None:
        self._on_request = on_request
        self._directory = directory
        self._url = url.rstrip("/") if url else None
        self._session = session
        self._cache_seconds = cache_seconds
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._cache: dict[str, tuple[float, bytes]] = {}

    async def get(self, rim_id: str) -> bytes:
        if not is_known_rim_id(rim_id):
            raise RimUnavailable("RIM id is not of a form NVIDIA names RIMs by")
        cached = self._cache.get(rim_id)
        if cached is not None and time.monotonic() - cached[0] < self._cache_seconds:
            return cached[1]
        data = await self._from_directory(rim_id)
        if data is None:
            data = await self._from_service(rim_id)
        self._cache[rim_id] = (time.monotonic(), data)
        return data

    async def _from_directory(self, rim_id: str) -> bytes | None:
        if self._directory is None:
            return None
        path = self._directory / f"{rim_id}.swidtag"
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None
        except OSError as exc:  # permissions, a directory in its place, I/O: a broken store
            log.exception("RIM directory unreadable for %s", rim_id)
            raise UpstreamError(
                "the RIM directory cannot be read", code=ErrorCode.RIM_SOURCE_UNAVAILABLE
            ) from exc

    async def _from_service(self, rim_id: str) -> bytes:
        if self._url is None or self._session is None:
            raise RimUnavailable(f"RIM {rim_id} is not in the RIM directory")
        if self._on_request is not None:
            self._on_request()
        try:
            async with self._session.get(f"{self._url}/{rim_id}", timeout=self._timeout) as reply:
                if reply.status != 200:
                    raise RimUnavailable(f"RIM service answered HTTP {reply.status} for {rim_id}")
                body = json.loads(await reply.content.read(MAX_RIM_RESPONSE_BYTES))
            rim = base64.b64decode(str(body["rim"]), validate=True)
        except (
            aiohttp.ClientError,
            TimeoutError,
            ValueError,
            KeyError,
            TypeError,
            binascii.Error,
        ) as exc:
            raise RimUnavailable(f"RIM {rim_id} could not be fetched") from exc
        if "sha256" in body and hashlib.sha256(rim).hexdigest() != str(body["sha256"]).lower():
            raise RimUnavailable(f"RIM {rim_id} does not match its published digest")
        return rim


class NoOcsp:
    """No responder configured: no answers, so every status reads ``unknown`` and the policy
    decides."""

    async def responses(
        self, chain: Sequence[x509.Certificate], now: datetime, *, include_leaf: bool = False
    ) -> dict[CertKey, bytes]:
        return {}

    async def answers(self, pairs: Sequence[CertPair], now: datetime) -> dict[CertKey, bytes]:
        return {}


class HttpOcspSource:
    """OCSP responses over HTTP POST for every certificate between leaf and root (docs/evidence.md
    §3.3), as bytes: the pipeline judges them (``ocsp.verify_ocsp_response``), not this adapter.

    An answer that judges good or revoked at fetch time is cached until the earlier of
    ``cache_seconds`` and its ``nextUpdate`` (the pipeline judges the cached bytes again at each
    use, so a cached answer past its time reads ``unknown``); any other answer is not cached.
    """

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        timeout_seconds: float,
        cache_seconds: float = 3600.0,
        on_request: OnRequest | None = None,
    ) -> None:
        self._on_request = on_request
        self._url = url
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._cache_seconds = cache_seconds
        self._cache: dict[CertKey, tuple[datetime, bytes]] = {}  # key -> (valid until, DER)

    async def responses(
        self, chain: Sequence[x509.Certificate], now: datetime, *, include_leaf: bool = False
    ) -> dict[CertKey, bytes]:
        return await self.answers(ocsp_pairs(chain, include_leaf=include_leaf), now)

    async def answers(self, pairs: Sequence[CertPair], now: datetime) -> dict[CertKey, bytes]:
        found: dict[CertKey, bytes] = {}
        for cert, issuer in pairs:
            body = await self._one(cert, issuer, now)
            if body is not None:
                found[cert_key(cert, issuer)] = body
        return found

    async def _one(
        self, cert: x509.Certificate, issuer: x509.Certificate, now: datetime
    ) -> bytes | None:
        key = cert_key(cert, issuer)
        cached = self._cache.get(key)
        if cached is not None and now < cached[0]:
            return cached[1]
        body = await self._ask(cert, issuer)
        if body is None:
            return None
        answer = verify_ocsp_response(body, cert, issuer, now=now)
        if answer.status == "unknown":
            log.warning("OCSP answer for serial %x not usable: %s", cert.serial_number, answer.why)
        elif self._cache_seconds > 0:
            until = now + timedelta(seconds=self._cache_seconds)
            if answer.next_update is not None:
                until = min(until, answer.next_update)
            self._cache[key] = (until, body)
        return body

    async def _ask(self, cert: x509.Certificate, issuer: x509.Certificate) -> bytes | None:
        request = ocsp.OCSPRequestBuilder().add_certificate(cert, issuer, hashes.SHA384()).build()
        if self._on_request is not None:
            self._on_request()
        try:
            async with self._session.post(
                self._url,
                data=request.public_bytes(serialization.Encoding.DER),
                headers={"Content-Type": "application/ocsp-request"},
                timeout=self._timeout,
            ) as reply:
                return await reply.content.read(MAX_OCSP_RESPONSE_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("OCSP responder %s unreachable: %s", self._url, exc)
            return None
