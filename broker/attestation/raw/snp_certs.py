"""Where SEV-SNP certificates come from, and the verifier the KBS facade calls (an adapter: all
SNP I/O is here; the checks are ``raw/snp.py``'s).

* **Roots**: the AMD ARKs pinned in ``certs/amd_sev_snp_roots.pem`` (Milan, Genoa, Turin), or
  the file ``[snp] roots`` names instead. Nothing a guest or a server sends is ever a root.
* **Intermediates**: the ASKs and ASVKs shipped in ``certs/amd_sev_snp_intermediates.pem``,
  those in ``[snp] certs_dir``, and those a guest sends in its ``cert_chain``; each counts only
  if a pinned ARK issued it.
* **The VCEK/VLEK**, first found wins: the guest's ``cert_chain`` (a VLEK can come from nowhere
  else), a certificate in ``[snp] certs_dir`` certified for the report's chip and TCB, then
  AMD's key distribution service (``[snp] kds_url``):
  ``GET {kds_url}/vcek/v1/{product}/{hwid}?blSPL=…&teeSPL=…&snpSPL=…&ucodeSPL=…`` (Turin:
  ``fmcSPL`` first and the chip id's first 8 bytes). A VCEK never changes for one chip and TCB,
  so answers are cached for the process's life (LRU-bounded); requests for one certificate in
  flight at once share one fetch, and at most ``KDS_MAX_CONCURRENT`` leave the broker at once.

The report is unsigned until its VCEK is found, so the chip id and TCB a KDS request names are
the guest's word: a stranger could make the broker ask AMD for any chip. So a KDS "no such
chip/TCB" (400/404) is remembered too, for ``KDS_MISS_SECONDS`` (bounded, ``KDS_MISS_ENTRIES``),
and requests for certificates not cached leave at most at ``KDS_FETCHES_PER_SECOND`` (bursts of
``KDS_FETCH_BURST``) per process: past that, ``snp_kds_unavailable`` without asking AMD (whose
own rate limit would otherwise shut out every guest). Operators avoid KDS entirely with
``[snp] certs_dir`` or guests that send their ``cert_chain`` (docs/kbs.md).

A KDS that cannot be reached, times out or answers 429/5xx, or the broker's own limit above, is
``snp_kds_unavailable`` (503); one that says 400/404 (no such chip or TCB), a masked chip id, or
no source at all is ``snp_vek_missing`` (401).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509

from broker.attestation.jwks_sources import get_bounded
from broker.attestation.raw import VerifiedRawEvidence
from broker.attestation.raw.snp import (
    HWID_BYTES,
    SnpTrust,
    common_name,
    find_vek,
    load_certificate,
    load_certificates,
    trust_from_pem,
    verify_snp_report,
)
from broker.attestation.raw.snp_evidence import SnpEvidence, cert_entries, parse_evidence
from broker.attestation.raw.snp_report import TURIN, SnpReport, parse_report
from broker.core.buckets import TokenBuckets
from broker.core.errors import AttestationError, ErrorCode, UpstreamError

log = logging.getLogger(__name__)
CERTS = Path(__file__).resolve().parents[2] / "shipped" / "certs"
SHIPPED_ROOTS = CERTS / "amd_sev_snp_roots.pem"
SHIPPED_INTERMEDIATES = CERTS / "amd_sev_snp_intermediates.pem"
MAX_CERT_FILE_BYTES = 64 * 1024
MAX_CERT_FILES = 4096
MAX_KDS_ANSWER_BYTES = 16 * 1024
KDS_CACHE_ENTRIES = 4096
KDS_MAX_CONCURRENT = 4
KDS_MISS_SECONDS = 600  # a KDS "no such chip or TCB" is believed this long
KDS_MISS_ENTRIES = 4096
KDS_FETCHES_PER_SECOND = 1.0  # requests for certificates not cached, per process
KDS_FETCH_BURST = 30
KDS_GONE = (400, 404)  # KDS: no such chip id or TCB (the report's claim, not an outage)


def read_certificate_files(paths: Iterable[Path]) -> list[x509.Certificate]:
    """The certificates in these files and directories (each file DER, or PEM with one or more;
    a directory: its files, not recursively). Blocking: the CLI's reader.

    Raises:
        ValueError: a file that is not a certificate, too large, or too many files.
        OSError: a path that cannot be read.
    """
    return parse_certificate_files(read_files(paths))


def read_files(paths: Iterable[Path]) -> list[tuple[Path, bytes]]:
    """Each file's bytes (a directory: its files). Blocking; parsing is left to the caller's
    thread (``load_certificate`` changes the warning filters, which threads share).

    Raises:
        ValueError: a file over ``MAX_CERT_FILE_BYTES``, or more than ``MAX_CERT_FILES``.
        OSError: a path that cannot be read.
    """
    files: list[Path] = []
    for path in paths:
        files.extend(sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path])
    if len(files) > MAX_CERT_FILES:
        raise ValueError(f"more than {MAX_CERT_FILES} certificate files")
    blobs = [(file, file.read_bytes()) for file in files]
    for file, data in blobs:
        if len(data) > MAX_CERT_FILE_BYTES:
            raise ValueError(f"{file}: over {MAX_CERT_FILE_BYTES} bytes")
    return blobs


def parse_certificate_files(blobs: Iterable[tuple[Path, bytes]]) -> list[x509.Certificate]:
    """The certificates of :func:`read_files`' answer.

    Raises:
        ValueError: naming a file that holds no certificate.
    """
    found: list[x509.Certificate] = []
    for file, data in blobs:
        try:
            found.extend(load_certificates(data))
        except ValueError as exc:
            raise ValueError(f"{file}: not a certificate (DER or PEM)") from exc
    return found


def split_certificates(
    certs: Iterable[x509.Certificate],
) -> tuple[list[x509.Certificate], list[x509.Certificate]]:
    """(endorsement keys, intermediates) of a pile of certificates; roots (``ARK-…``) are left
    out: only the pinned ones are trusted."""
    veks, middles = [], []
    for cert in certs:
        name = common_name(cert)
        if name in ("SEV-VCEK", "SEV-VLEK"):
            veks.append(cert)
        elif name.startswith("SEV-"):
            middles.append(cert)
    return veks, middles


def load_trust(roots: Path | None = None, extra: Iterable[x509.Certificate] = ()) -> SnpTrust:
    """The pinned roots (``roots`` or the shipped file) and the shipped intermediates plus
    ``extra``. Blocking (reads two files): the CLI's reader.

    Raises:
        ValueError, OSError: an unusable roots or intermediates file.
    """
    return trust_with(read_trust_files(roots), extra)


def read_trust_files(roots: Path | None) -> tuple[bytes, bytes]:
    """The roots file's and the shipped intermediates' bytes. Blocking.

    Raises:
        OSError: a file that cannot be read.
    """
    return (roots or SHIPPED_ROOTS).read_bytes(), SHIPPED_INTERMEDIATES.read_bytes()


def trust_with(pem: tuple[bytes, bytes], extra: Iterable[x509.Certificate]) -> SnpTrust:
    """``trust_from_pem`` of :func:`read_trust_files`' answer, with ``extra`` intermediates.

    Raises:
        ValueError: an unusable roots or intermediates file.
    """
    trust = trust_from_pem(*pem)
    return replace(trust, intermediates=(*trust.intermediates, *extra))


class KdsClient:
    """VCEKs from AMD's key distribution service (or a mirror of its API), cached."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        timeout_seconds: float,
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self._url = url.rstrip("/")
        self._session = session
        self._timeout = timeout_seconds
        self._on_request = on_request
        self._cache: OrderedDict[str, x509.Certificate] = OrderedDict()
        self._misses: OrderedDict[str, datetime] = OrderedDict()  # url -> believed until
        self._inflight: dict[str, asyncio.Task[x509.Certificate | None]] = {}
        self._slots = asyncio.Semaphore(KDS_MAX_CONCURRENT)
        self._fetches = TokenBuckets(KDS_FETCHES_PER_SECOND, KDS_FETCH_BURST, max_names=1)

    async def vcek(self, report: SnpReport, product: str, now: datetime) -> x509.Certificate | None:
        """The VCEK for the report's chip and REPORTED_TCB; ``None`` when the KDS has none
        (said now, or within ``KDS_MISS_SECONDS`` before ``now``).

        Raises:
            UpstreamError: ``snp_kds_unavailable`` (the KDS, or the broker's limit on it).
        """
        url = self.vcek_url(report, product)
        cached = self._cache.get(url)
        if cached is not None:
            self._cache.move_to_end(url)
            return cached
        if self._misses.get(url, now) > now:
            return None  # AMD said "no such chip or TCB" a moment ago: not asked again
        task = self._inflight.get(url)
        if task is None:
            if self._fetches.wait_for("kds", now.timestamp()) > 0:
                raise UpstreamError(
                    "too many AMD KDS lookups for certificates not cached; retry later (or "
                    "send the cert_chain, or set [snp] certs_dir)",
                    code=ErrorCode.SNP_KDS_UNAVAILABLE,
                )
            task = asyncio.ensure_future(self._fetch(url, now))
            self._inflight[url] = task
            task.add_done_callback(lambda _: self._inflight.pop(url, None))
        return await asyncio.shield(task)  # one caller's cancellation ends no other's fetch

    def vcek_url(self, report: SnpReport, product: str) -> str:
        """AMD 57230 §4.1: the VCEK's URL for this report."""
        tcb = report.tcbs(product)["reported_tcb"]
        hwid = report.chip_id[: HWID_BYTES[product]].hex()
        spl = [("blSPL", tcb.bootloader), ("teeSPL", tcb.tee), ("snpSPL", tcb.snp)]
        spl.append(("ucodeSPL", tcb.microcode))
        if product == TURIN:
            spl.insert(0, ("fmcSPL", tcb.fmc or 0))
        query = "&".join(f"{name}={value:02d}" for name, value in spl)
        return f"{self._url}/vcek/v1/{product}/{hwid}?{query}"

    async def _fetch(self, url: str, now: datetime) -> x509.Certificate | None:
        try:
            async with self._slots:
                status, body = await get_bounded(
                    self._session,
                    url,
                    timeout_seconds=self._timeout,
                    max_bytes=MAX_KDS_ANSWER_BYTES,
                    on_request=self._on_request,
                )
            if status in KDS_GONE:
                self._misses[url] = now + timedelta(seconds=KDS_MISS_SECONDS)
                self._misses.move_to_end(url)
                while len(self._misses) > KDS_MISS_ENTRIES:
                    self._misses.popitem(last=False)
                return None
            cert = _kds_certificate(status, body)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("AMD KDS %s failed: %s", url, exc)
            raise UpstreamError(
                "AMD's key distribution service did not answer",
                code=ErrorCode.SNP_KDS_UNAVAILABLE,
            ) from exc
        self._cache[url] = cert
        while len(self._cache) > KDS_CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return cert


def _kds_certificate(status: int, body: bytes) -> x509.Certificate:
    """A KDS answer as its certificate.

    Raises:
        ValueError: not 200, too large, or not a certificate.
    """
    if status != 200 or len(body) > MAX_KDS_ANSWER_BYTES:
        raise ValueError(f"HTTP {status}, {len(body)} bytes")
    return load_certificate(body)


class SnpVerifier:
    """The ``RawVerifier`` for SEV-SNP guests (KBS ``tee`` = ``snp``): certificates from the
    sources above, then ``raw/snp.verify_snp_report``."""

    tee_names: tuple[str, ...] = ("snp",)

    def __init__(
        self,
        trust: SnpTrust,
        *,
        veks: Iterable[x509.Certificate] = (),
        kds: KdsClient | None = None,
        max_vmpl: int = 0,
    ) -> None:
        self._trust = trust
        self._veks = tuple(veks)
        self._kds = kds
        self._max_vmpl = max_vmpl

    async def verify(
        self, primary_evidence: Mapping[str, Any], *, now: datetime
    ) -> VerifiedRawEvidence:
        """Verify a guest's SNP evidence object (``raw/snp_evidence.py``).

        Raises:
            AttestationError: the evidence does not verify (its code says which check failed).
            UpstreamError: ``snp_kds_unavailable``.
        """
        evidence = parse_evidence(primary_evidence)
        report = parse_report(evidence.report)
        sent, middles = sent_certificates(evidence, report)
        vek = sent[0] if sent else await self._vek(report, now)
        trust = replace(self._trust, intermediates=(*self._trust.intermediates, *middles))
        # RSA-PSS chain and ECDSA P-384 checks are CPU work: off the event loop (certificates
        # are loaded above, on the loop: their loader changes warning filters threads share)
        return await asyncio.to_thread(
            verify_snp_report, report, vek, trust, now=now, max_vmpl=self._max_vmpl
        )

    async def _vek(self, report: SnpReport, now: datetime) -> x509.Certificate:
        found = find_vek(report, self._veks)
        if found is not None:
            return found
        product = report.product_hint
        vek = None
        if self._kds is not None and report.signing_key == "vcek" and not report.chip_id_masked:
            if product is None:
                raise _missing("a version 2 report names no product to ask AMD's KDS for")
            vek = await self._kds.vcek(report, product, now)
        if vek is None:
            raise _missing("no VCEK/VLEK for this report: none sent, none configured, none at KDS")
        return vek


def sent_certificates(
    evidence: SnpEvidence, report: SnpReport
) -> tuple[list[x509.Certificate], list[x509.Certificate]]:
    """The guest's ``cert_chain``: the endorsement keys of the kind SIGNING_KEY names, and its
    ASKs (candidates only: a pinned ARK must have signed them). ``ARK`` entries are ignored.

    Raises:
        AttestationError: ``snp_report_malformed`` for an entry that is not a certificate.
    """
    kind = "VLEK" if report.signing_key == "vlek" else "VCEK"
    try:
        veks = [load_certificate(data) for data in cert_entries(evidence.certs, kind)]
        middles = [load_certificate(data) for data in cert_entries(evidence.certs, "ASK")]
    except ValueError as exc:
        raise AttestationError(
            "a cert_chain entry is not a certificate", code=ErrorCode.SNP_REPORT_MALFORMED
        ) from exc
    return veks, middles


def _missing(message: str) -> AttestationError:
    return AttestationError(message, code=ErrorCode.SNP_VEK_MISSING)


async def build_snp_verifier(
    *,
    roots: Path | None,
    certs_dir: Path | None,
    kds_url: str | None,
    session: aiohttp.ClientSession | None,
    timeout_seconds: float = 10.0,
    max_vmpl: int = 0,
    on_request: Callable[[], None] | None = None,
) -> SnpVerifier:
    """The verifier ``[snp]`` describes (docs/configuration.md), its files read off the loop.

    Raises:
        ValueError, OSError: an unusable roots file or certificate directory.
    """
    blobs = await asyncio.to_thread(read_files, [certs_dir] if certs_dir else [])
    veks, middles = split_certificates(parse_certificate_files(blobs))
    trust = trust_with(await asyncio.to_thread(read_trust_files, roots), middles)
    kds = None
    if kds_url and session is not None:
        kds = KdsClient(kds_url, session, timeout_seconds=timeout_seconds, on_request=on_request)
    return SnpVerifier(trust, veks=veks, kds=kds, max_vmpl=max_vmpl)
