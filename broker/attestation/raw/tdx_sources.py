"""Where TDX collateral comes from (an adapter: all DCAP collateral I/O is here), and the
``RawVerifier`` for KBS ``tee: "tdx"`` that composes it with the pure verifier.

* ``FileCollateralSource``: ``dcap-qvl`` collateral JSON files in ``[tdx] collateral_dir``,
  matched by content (the TCB info's FMSPC, the PCK CRL issuer's CA), re-read when a file
  changes. The freshest match is returned even when it is past its ``nextUpdate``: the
  verifier then refuses with ``tdx_collateral_expired``, which tells the operator what to do.
* ``PcsCollateralSource``: Intel's PCS v4 API, or a PCCS serving it (``[tdx] pccs_url``):
  ``/tdx/certification/v4/tcb?fmspc=…``, ``/tdx/certification/v4/qe/identity``,
  ``/sgx/certification/v4/pckcrl?ca=…&encoding=der`` and the root CA CRL
  (``root_ca_crl_url``, default the PCCS's ``/sgx/certification/v4/rootcacrl``). Cached per
  (FMSPC, CA); refetched after ``refresh_seconds`` or within ``refresh_seconds`` of the
  earliest ``nextUpdate``; when a refetch fails the last good answer serves **until its
  nextUpdate, never after** (then ``503 tdx_collateral_unavailable``).

Nothing is fetched for a quote before it authenticates to the pinned root without collateral
(``tdx.authenticate_quote``): the FMSPC and CA asked for are Intel-signed, so a stranger's
quote costs no outbound request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from cryptography import x509

from broker.attestation.raw import VerifiedRawEvidence
from broker.attestation.raw.tdx import TdxTrust, authenticate_quote, verify_tdx_quote
from broker.attestation.raw.tdx_collateral import (
    MAX_COLLATERAL_BYTES,
    TdxCollateral,
    collateral_from_pcs,
    parse_collateral_json,
)
from broker.attestation.raw.tdx_guest import parse_tdx_evidence
from broker.core.errors import AttestationError, ConfigError, ErrorCode, UpstreamError

log = logging.getLogger(__name__)
MAX_COLLATERAL_FILES = 256
MIN_REFETCH_SECONDS = 60  # a PCCS serving collateral near its nextUpdate is asked once a minute
Platform = tuple[str, str]  # (FMSPC upper-case hex, "platform" | "processor")


class TdxSourceSettings(Protocol):
    """What ``[tdx]`` says (``config.sections.TdxSettings``; the config package imports
    attestation, so this one names the fields instead of importing it)."""

    @property
    def pccs_url(self) -> str | None: ...
    @property
    def root_ca_crl_url(self) -> str | None: ...
    @property
    def collateral_dir(self) -> Path | None: ...
    @property
    def root_certificate(self) -> Path: ...
    @property
    def refresh_seconds(self) -> int: ...
    @property
    def upstream_timeout_seconds(self) -> int: ...


class CollateralSource(Protocol):
    async def collateral(self, fmspc: str, ca: str, now: datetime) -> TdxCollateral | None:
        """Collateral for the platform, or ``None`` when this source has none."""
        ...


def _unavailable(problem: str) -> UpstreamError:
    return UpstreamError(f"TDX collateral: {problem}", code=ErrorCode.TDX_COLLATERAL_UNAVAILABLE)


class FileCollateralSource:
    """Collateral JSON files (``*.json``) in one directory, matched by what they contain."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._parsed: dict[Path, tuple[tuple[int, int], TdxCollateral | None]] = {}

    async def collateral(self, fmspc: str, ca: str, now: datetime) -> TdxCollateral | None:
        found = await asyncio.to_thread(self._scan)
        matches = [c for c in found if (c.fmspc, c.ca) == (fmspc, ca)]
        fresh = [c for c in matches if c.not_before <= now < c.next_update]
        return max(fresh or matches, key=lambda c: c.next_update, default=None)

    def _scan(self) -> list[TdxCollateral]:
        try:
            paths = sorted(self._directory.glob("*.json"))[:MAX_COLLATERAL_FILES]
            found = []
            for path in paths:
                stat = path.stat()
                stamp = (stat.st_mtime_ns, stat.st_size)
                cached = self._parsed.get(path)
                if cached is None or cached[0] != stamp:
                    cached = (stamp, self._parse(path, stat.st_size))
                    self._parsed[path] = cached
                if cached[1] is not None:
                    found.append(cached[1])
            return found
        except OSError as exc:
            log.exception("TDX collateral directory %s unreadable", self._directory)
            raise _unavailable("the collateral directory cannot be read") from exc

    @staticmethod
    def _parse(path: Path, size: int) -> TdxCollateral | None:
        if size > MAX_COLLATERAL_BYTES:
            log.warning("TDX collateral %s is larger than %d bytes", path, MAX_COLLATERAL_BYTES)
            return None
        try:
            return parse_collateral_json(path.read_bytes())
        except AttestationError as exc:
            log.warning("TDX collateral %s skipped: %s", path, exc.message)
            return None


class PcsCollateralSource:
    """Intel PCS v4 (or a PCCS), cached per platform with explicit freshness."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        root_ca_crl_url: str | None,
        refresh_seconds: float,
        timeout_seconds: float,
        on_request: Callable[[], None] | None = None,
    ) -> None:
        self._base = url.rstrip("/")
        self._root_ca_crl_url = root_ca_crl_url or f"{self._base}/sgx/certification/v4/rootcacrl"
        self._session = session
        self._refresh = timedelta(seconds=refresh_seconds)
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._on_request = on_request  # told of each request that leaves the broker
        self._cache: dict[Platform, tuple[datetime, TdxCollateral]] = {}
        self._lock = asyncio.Lock()

    async def collateral(self, fmspc: str, ca: str, now: datetime) -> TdxCollateral | None:
        key = (fmspc, ca)
        async with self._lock:  # one fetch per platform at a time; hits return at once
            cached = self._cache.get(key)
            if cached is not None and not self._stale(cached, now):
                return cached[1]
            try:
                fetched = await self._fetch(fmspc, ca)
            except (aiohttp.ClientError, TimeoutError, AttestationError, _HttpStatus) as exc:
                log.warning("TDX collateral for %s/%s not fetched: %s", fmspc, ca, exc)
                if cached is not None and now < cached[1].next_update:
                    return cached[1]  # the last good answer, never at or past its nextUpdate
                raise _unavailable(f"none could be fetched for FMSPC {fmspc}") from exc
            self._cache[key] = (now, fetched)
            return fetched

    def _stale(self, cached: tuple[datetime, TdxCollateral], now: datetime) -> bool:
        fetched_at, collateral = cached
        if now - fetched_at >= self._refresh:
            return True
        near_end = now >= collateral.next_update - self._refresh
        return near_end and now - fetched_at >= timedelta(seconds=MIN_REFETCH_SECONDS)

    async def _fetch(self, fmspc: str, ca: str) -> TdxCollateral:
        tdx, sgx = f"{self._base}/tdx/certification/v4", f"{self._base}/sgx/certification/v4"
        tcb_body, tcb_headers = await self._get(f"{tdx}/tcb", {"fmspc": fmspc})
        qe_body, qe_headers = await self._get(f"{tdx}/qe/identity", {})
        crl_body, crl_headers = await self._get(f"{sgx}/pckcrl", {"ca": ca, "encoding": "der"})
        root_crl, _ = await self._get(self._root_ca_crl_url, {})
        return collateral_from_pcs(
            tcb_info_body=tcb_body,
            tcb_info_chain=_header(
                tcb_headers, "TCB-Info-Issuer-Chain", "SGX-TCB-Info-Issuer-Chain"
            ),
            qe_identity_body=qe_body,
            qe_identity_chain=_header(qe_headers, "SGX-Enclave-Identity-Issuer-Chain"),
            pck_crl=crl_body,
            pck_crl_chain=_header(crl_headers, "SGX-PCK-CRL-Issuer-Chain"),
            root_ca_crl=root_crl,
        )

    async def _get(self, url: str, params: Mapping[str, str]) -> tuple[bytes, Mapping[str, str]]:
        if self._on_request is not None:
            self._on_request()
        async with self._session.get(
            url, params=params, timeout=self._timeout, allow_redirects=False
        ) as reply:
            if reply.status != 200:
                raise _HttpStatus(f"{url} answered HTTP {reply.status}")
            body = bytearray()
            async for chunk in reply.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > MAX_COLLATERAL_BYTES:
                    raise _HttpStatus(f"{url} answered more than {MAX_COLLATERAL_BYTES} bytes")
            return bytes(body), reply.headers


class _HttpStatus(Exception):
    """An answer that is not collateral (status, size)."""


def _header(headers: Mapping[str, str], *names: str) -> str:
    for name in names:
        if name in headers:
            return headers[name]
    raise _HttpStatus(f"no {names[0]} header")


class TdxRawVerifier:
    """KBS ``tee: "tdx"``: the guest's evidence object → authenticated quote → collateral for
    its platform (files first, then the PCS) → the pure verifier."""

    tee_names: tuple[str, ...] = ("tdx",)

    def __init__(self, trust: TdxTrust, sources: Sequence[CollateralSource]) -> None:
        self._trust = trust
        self._sources = tuple(sources)

    async def verify(
        self, primary_evidence: Mapping[str, Any], *, now: datetime
    ) -> VerifiedRawEvidence:
        """Verify a guest's TDX evidence at ``now``; the caller checks the report data.

        Raises:
            AttestationError: the evidence or quote does not verify (its code).
            UpstreamError: ``tdx_collateral_unavailable``.
        """
        evidence = parse_tdx_evidence(primary_evidence)
        # chains, ECDSA and dcap-qvl are CPU work (~5 ms a quote): kept off the event loop
        authentic = await asyncio.to_thread(authenticate_quote, evidence.quote, self._trust)
        collateral = None
        for source in self._sources:
            collateral = await source.collateral(authentic.fmspc, authentic.ca, now)
            if collateral is not None:
                break
        if collateral is None:
            raise _unavailable(f"none configured for FMSPC {authentic.fmspc} ({authentic.ca})")
        verified = await asyncio.to_thread(
            verify_tdx_quote, evidence.quote, collateral, trust=self._trust, now=now
        )
        extra: dict[str, Any] = {"cc_eventlog_replayed": False}
        if evidence.cc_eventlog is not None:
            extra["cc_eventlog_sha384"] = hashlib.sha384(evidence.cc_eventlog).hexdigest()
        return dataclasses.replace(verified, claims={**verified.claims, **extra})


def load_tdx_trust(path: Path) -> TdxTrust:
    """The pinned root from ``[tdx] root_certificate`` (one PEM certificate).

    Raises:
        ConfigError: the file is missing or is not one PEM certificate.
    """
    try:
        certificates = x509.load_pem_x509_certificates(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError("tdx.root_certificate", f"{path} is not a PEM certificate") from exc
    if len(certificates) != 1:
        raise ConfigError("tdx.root_certificate", f"{path} must hold exactly one certificate")
    return TdxTrust(root=certificates[0])


async def open_tdx_verifier(
    settings: TdxSourceSettings,
    session: aiohttp.ClientSession | None,
    *,
    on_request: Callable[[], None] | None = None,
) -> TdxRawVerifier:
    """The verifier ``[tdx]`` describes (the composition root calls this at start-up).

    Raises:
        ConfigError: no collateral source, or the root is unusable.
    """
    sources: list[CollateralSource] = []
    if settings.collateral_dir is not None:
        sources.append(FileCollateralSource(settings.collateral_dir))
    if settings.pccs_url is not None:
        if session is None:
            raise ConfigError("tdx.pccs_url", "needs the broker's HTTP client session")
        sources.append(
            PcsCollateralSource(
                settings.pccs_url,
                session,
                root_ca_crl_url=settings.root_ca_crl_url,
                refresh_seconds=settings.refresh_seconds,
                timeout_seconds=settings.upstream_timeout_seconds,
                on_request=on_request,
            )
        )
    if not sources:
        raise ConfigError("tdx", "collateral_dir or pccs_url is required to verify TDX quotes")
    trust = await asyncio.to_thread(load_tdx_trust, settings.root_certificate)
    return TdxRawVerifier(trust, sources)
