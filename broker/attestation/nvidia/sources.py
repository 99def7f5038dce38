"""Async ports for local GPU verification: RIM retrieval and OCSP. All I/O for NVIDIA lives here.

* ``RimSource``: RIM bytes by id, from a directory (``<dir>/<id>.swidtag``) and/or NVIDIA's RIM
  service (``GET <rim_url>/<id>`` → ``{"id", "rim": base64, "sha256"}``), cached for
  ``rim_cache_seconds``. A RIM that cannot be had raises ``RimUnavailable``; the GPU's
  measurements then read ``unverified`` and the policy decides (never a silent pass).
* ``OcspChecker``: the revocation status of a device chain, ``good``, ``revoked`` or
  ``unknown``. Without a configured responder, or when it cannot be reached or its answer does
  not verify, the status is ``unknown``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import aiohttp
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509 import ocsp

log = logging.getLogger(__name__)
MAX_RIM_RESPONSE_BYTES = 2 * 1024 * 1024
MAX_OCSP_RESPONSE_BYTES = 64 * 1024
RIM_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


class RimSource(Protocol):
    async def get(self, rim_id: str) -> bytes:
        """The signed RIM XML; raise ``RimUnavailable`` when it cannot be had."""
        ...


class OcspChecker(Protocol):
    async def status(self, chain: Sequence[x509.Certificate]) -> str:
        """``good`` | ``revoked`` | ``unknown`` for the chain (leaf first, root last)."""
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
    ) -> None:
        self._directory = directory
        self._url = url.rstrip("/") if url else None
        self._session = session
        self._cache_seconds = cache_seconds
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._cache: dict[str, tuple[float, bytes]] = {}

    async def get(self, rim_id: str) -> bytes:
        if not rim_id or set(rim_id) - RIM_ID_CHARS or len(rim_id) > 128:
            raise RimUnavailable("RIM id has characters outside [A-Za-z0-9._-]")
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

    async def _from_service(self, rim_id: str) -> bytes:
        if self._url is None or self._session is None:
            raise RimUnavailable(f"RIM {rim_id} is not in the RIM directory")
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
    """No responder configured: every status is ``unknown`` and the policy decides."""

    async def status(self, chain: Sequence[x509.Certificate]) -> str:
        return "unknown"


class HttpOcspChecker:
    """OCSP over HTTP POST for every certificate between leaf and root (EVIDENCE.md §3.3).

    The response must be SUCCESSFUL, signed (SHA-384/256) by the issuer or by a responder
    certificate the issuer signed, and name the certificate asked about.
    """

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        timeout_seconds: float,
        cache_seconds: float = 3600.0,
    ) -> None:
        self._url = url
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._cache_seconds = cache_seconds
        # (issuer subject, serial) -> (fetched at, status); "unknown" is never cached
        self._cache: dict[tuple[bytes, int], tuple[float, str]] = {}

    async def status(self, chain: Sequence[x509.Certificate]) -> str:
        results = [await self._one(cert, issuer) for cert, issuer in itertools.pairwise(chain[1:])]
        if "revoked" in results:
            return "revoked"
        return "good" if results and all(r == "good" for r in results) else "unknown"

    async def _one(self, cert: x509.Certificate, issuer: x509.Certificate) -> str:
        key = (issuer.subject.public_bytes(), cert.serial_number)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < self._cache_seconds:
            return cached[1]
        status = await self._ask(cert, issuer)
        if status != "unknown":
            self._cache[key] = (time.monotonic(), status)
        return status

    async def _ask(self, cert: x509.Certificate, issuer: x509.Certificate) -> str:
        request = ocsp.OCSPRequestBuilder().add_certificate(cert, issuer, hashes.SHA384()).build()
        try:
            async with self._session.post(
                self._url,
                data=request.public_bytes(serialization.Encoding.DER),
                headers={"Content-Type": "application/ocsp-request"},
                timeout=self._timeout,
            ) as reply:
                body = await reply.content.read(MAX_OCSP_RESPONSE_BYTES)
            return verify_ocsp_response(body, cert, issuer)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("OCSP responder %s unreachable: %s", self._url, exc)
            return "unknown"


def verify_ocsp_response(body: bytes, cert: x509.Certificate, issuer: x509.Certificate) -> str:
    """Interpret one OCSP response; anything that does not verify is ``unknown``. Pure."""
    try:
        response = ocsp.load_der_ocsp_response(body)
    except ValueError:
        return "unknown"
    if response.response_status is not ocsp.OCSPResponseStatus.SUCCESSFUL:
        return "unknown"
    if response.serial_number != cert.serial_number:
        return "unknown"
    signer = issuer
    for candidate in response.certificates:
        if candidate.issuer == issuer.subject:
            try:
                candidate.verify_directly_issued_by(issuer)
            except (ValueError, TypeError, InvalidSignature):
                continue
            signer = candidate
    if not _signed_by(response, signer):
        return "unknown"
    status = response.certificate_status
    if status is ocsp.OCSPCertStatus.REVOKED:
        return "revoked"
    return "good" if status is ocsp.OCSPCertStatus.GOOD else "unknown"


def _signed_by(response: ocsp.OCSPResponse, signer: x509.Certificate) -> bool:
    key = signer.public_key()
    algorithm = response.signature_hash_algorithm
    if algorithm is None:
        return False
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(response.signature, response.tbs_response_bytes, ec.ECDSA(algorithm))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(
                response.signature, response.tbs_response_bytes, padding.PKCS1v15(), algorithm
            )
        else:
            return False
    except InvalidSignature:
        return False
    return True
