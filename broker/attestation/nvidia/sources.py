"""Async ports for local GPU verification: RIM retrieval and OCSP. All I/O for NVIDIA lives here.

* ``RimSource``: RIM bytes by id, from a directory (``<dir>/<id>.swidtag``) and/or NVIDIA's RIM
  service (``GET <rim_url>/<id>`` → ``{"id", "rim": base64, "sha256"}``), cached for
  ``rim_cache_seconds``. A RIM that cannot be had raises ``RimUnavailable``; the GPU's
  measurements then read ``unverified`` and the policy decides (never a silent pass). A RIM
  directory that exists but cannot be read is a broken dependency: 503
  ``rim_source_unavailable``, nothing released.
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
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Protocol

import aiohttp
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID

from broker.errors import ErrorCode, UpstreamError

log = logging.getLogger(__name__)
OCSP_LEEWAY = timedelta(minutes=5)
OCSP_MAX_AGE = timedelta(days=1)  # an answer without nextUpdate older than this is stale
MAX_RIM_RESPONSE_BYTES = 2 * 1024 * 1024
MAX_OCSP_RESPONSE_BYTES = 64 * 1024
RIM_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


class RimSource(Protocol):
    async def get(self, rim_id: str) -> bytes:
        """The signed RIM XML; raise ``RimUnavailable`` when it cannot be had."""
        ...


class OcspChecker(Protocol):
    async def status(
        self, chain: Sequence[x509.Certificate], now: datetime, *, include_leaf: bool = False
    ) -> str:
        """``good`` | ``revoked`` | ``unknown`` for the chain (leaf first, root last) at ``now``.

        Every certificate below the root is asked about; a GPU chain's FMC leaf is not
        (NVIDIA's OCSP does not cover it: EVIDENCE.md §3.3), a RIM signer chain's leaf is
        (``include_leaf``).
        """
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
        except OSError as exc:  # permissions, a directory in its place, I/O: a broken store
            log.exception("RIM directory unreadable for %s", rim_id)
            raise UpstreamError(
                "the RIM directory cannot be read", code=ErrorCode.RIM_SOURCE_UNAVAILABLE
            ) from exc

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

    async def status(
        self, chain: Sequence[x509.Certificate], now: datetime, *, include_leaf: bool = False
    ) -> str:
        return "unknown"


class HttpOcspChecker:
    """OCSP over HTTP POST for every certificate between leaf and root (EVIDENCE.md §3.3).

    Each answer is checked by ``verify_ocsp_response`` (RFC 6960 §3.2) against the request's
    time. Good and revoked answers are cached until the earlier of ``cache_seconds`` and the
    answer's ``nextUpdate``; ``unknown`` is never cached.
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
        # (issuer subject, serial) -> (valid until, status)
        self._cache: dict[tuple[bytes, int], tuple[datetime, str]] = {}

    async def status(
        self, chain: Sequence[x509.Certificate], now: datetime, *, include_leaf: bool = False
    ) -> str:
        pairs = list(itertools.pairwise(chain if include_leaf else chain[1:]))
        results = [await self._one(cert, issuer, now) for cert, issuer in pairs]
        return combine_ocsp(results)

    async def _one(self, cert: x509.Certificate, issuer: x509.Certificate, now: datetime) -> str:
        key = (issuer.subject.public_bytes(), cert.serial_number)
        cached = self._cache.get(key)
        if cached is not None and now < cached[0]:
            return cached[1]
        answer = await self._ask(cert, issuer, now)
        if answer.status != "unknown" and self._cache_seconds > 0:
            until = now + timedelta(seconds=self._cache_seconds)
            if answer.next_update is not None:
                until = min(until, answer.next_update)
            self._cache[key] = (until, answer.status)
        return answer.status

    async def _ask(
        self, cert: x509.Certificate, issuer: x509.Certificate, now: datetime
    ) -> OcspAnswer:
        request = ocsp.OCSPRequestBuilder().add_certificate(cert, issuer, hashes.SHA384()).build()
        try:
            async with self._session.post(
                self._url,
                data=request.public_bytes(serialization.Encoding.DER),
                headers={"Content-Type": "application/ocsp-request"},
                timeout=self._timeout,
            ) as reply:
                body = await reply.content.read(MAX_OCSP_RESPONSE_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("OCSP responder %s unreachable: %s", self._url, exc)
            return OcspAnswer("unknown", None)
        answer = verify_ocsp_response(body, cert, issuer, now=now)
        if answer.status == "unknown":
            log.warning("OCSP answer for serial %x not usable: %s", cert.serial_number, answer.why)
        return answer


def combine_ocsp(results: Sequence[str]) -> str:
    """One status for several certificates: any ``revoked`` wins; ``good`` only if all are."""
    if "revoked" in results:
        return "revoked"
    return "good" if results and all(r == "good" for r in results) else "unknown"


@dataclass(frozen=True)
class OcspAnswer:
    status: str  # good | revoked | unknown
    next_update: datetime | None
    why: str = ""


def verify_ocsp_response(  # noqa: PLR0911 - one return per RFC 6960 check
    body: bytes,
    cert: x509.Certificate,
    issuer: x509.Certificate,
    *,
    now: datetime,
    leeway: timedelta = OCSP_LEEWAY,
) -> OcspAnswer:
    """Interpret one OCSP response per RFC 6960 §3.2. Pure; anything off is ``unknown``.

    1. The response is SUCCESSFUL and its single response names ``cert``: serial, and the
       issuer's name and key hashes under the response's hash algorithm (§3.2 item 1).
    2. The signer is the issuer itself, or a delegated responder certificate the issuer signed
       directly that carries the id-kp-OCSPSigning EKU and is valid at ``now`` (§3.2 items 2-3,
       §4.2.2.2).
    3. The signature verifies with the signer's key (§3.2 item 4).
    4. ``thisUpdate`` is not in the future and, with ``nextUpdate``, ``now`` is not past it;
       without ``nextUpdate``, ``thisUpdate`` is at most ``OCSP_MAX_AGE`` old (§3.2 items 5-6,
       §4.2.2.1), each with ``leeway``. An old "good" cannot be replayed.
    """
    try:
        response = ocsp.load_der_ocsp_response(body)
    except ValueError:
        return OcspAnswer("unknown", None, "not a DER OCSP response")
    if response.response_status is not ocsp.OCSPResponseStatus.SUCCESSFUL:
        return OcspAnswer("unknown", None, f"status {response.response_status.name}")
    if not _names_certificate(response, cert, issuer):
        return OcspAnswer("unknown", None, "answer is about another certificate")
    signer = _authorised_signer(response, issuer, now)
    if signer is None:
        return OcspAnswer("unknown", None, "no authorised signer (issuer or OCSP-signing EKU)")
    if not _signed_by(response, signer):
        return OcspAnswer("unknown", None, "signature does not verify")
    this_update = response.this_update_utc
    next_update = response.next_update_utc
    if this_update > now + leeway:
        return OcspAnswer("unknown", None, "thisUpdate is in the future")
    if next_update is not None and now > next_update + leeway:
        return OcspAnswer("unknown", None, "answer is past its nextUpdate (stale)")
    if next_update is None and now - this_update > OCSP_MAX_AGE + leeway:
        return OcspAnswer("unknown", None, "answer without nextUpdate is too old")
    status = response.certificate_status
    if status is ocsp.OCSPCertStatus.REVOKED:
        return OcspAnswer("revoked", next_update)
    if status is ocsp.OCSPCertStatus.GOOD:
        return OcspAnswer("good", next_update)
    return OcspAnswer("unknown", None, "responder does not know the certificate")


def _names_certificate(
    response: ocsp.OCSPResponse, cert: x509.Certificate, issuer: x509.Certificate
) -> bool:
    if response.serial_number != cert.serial_number:
        return False
    algorithm = response.hash_algorithm
    name_hash = hashes.Hash(algorithm)
    name_hash.update(issuer.subject.public_bytes())
    key_bits = issuer.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    key_hash = hashes.Hash(algorithm)
    key_hash.update(_subject_public_key_bits(key_bits))
    return (
        response.issuer_name_hash == name_hash.finalize()
        and response.issuer_key_hash == key_hash.finalize()
    )


def _subject_public_key_bits(spki: bytes) -> bytes:
    """The BIT STRING contents of a SubjectPublicKeyInfo (what CertID's issuerKeyHash hashes)."""
    # SPKI ::= SEQUENCE { algorithm AlgorithmIdentifier, subjectPublicKey BIT STRING }
    _, body = _der_element(spki, 0)
    offset = body
    header, _ = _der_element(spki, offset)  # AlgorithmIdentifier
    offset = header
    _, content_start = _der_element(spki, offset)
    return spki[content_start + 1 :]  # skip the unused-bits byte


def _der_element(data: bytes, offset: int) -> tuple[int, int]:
    """(end of the element at ``offset``, start of its contents)."""
    length = data[offset + 1]
    start = offset + 2
    if length & 0x80:
        count = length & 0x7F
        length = int.from_bytes(data[start : start + count], "big")
        start += count
    return start + length, start


def _authorised_signer(
    response: ocsp.OCSPResponse, issuer: x509.Certificate, now: datetime
) -> x509.Certificate | None:
    if _responder_is(response, issuer):
        return issuer
    for candidate in response.certificates:
        if not _responder_is(response, candidate) or candidate.issuer != issuer.subject:
            continue
        try:
            candidate.verify_directly_issued_by(issuer)
            usage = candidate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
            continue
        in_time = candidate.not_valid_before_utc <= now <= candidate.not_valid_after_utc
        if ExtendedKeyUsageOID.OCSP_SIGNING in usage and in_time:
            return candidate
    return None


def _responder_is(response: ocsp.OCSPResponse, cert: x509.Certificate) -> bool:
    if response.responder_name is not None:
        return response.responder_name == cert.subject
    digest = hashes.Hash(hashes.SHA1())  # noqa: S303 - RFC 6960 ResponderID byKey is SHA-1
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest.update(_subject_public_key_bits(spki))
    return response.responder_key_hash == digest.finalize()


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
