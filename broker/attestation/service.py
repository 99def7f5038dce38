"""The async layer around the evidence pipeline: fetches key sets, RIMs and OCSP answers, then
hands them to ``pipeline.verify_evidence`` (pure), which ``broker verify`` calls too. It fetches
in stages, each after the pure checks that need nothing fetched passed (``verify``), so evidence
an attacker made alone sends nothing out.

A release carries exactly one piece of CPU evidence (``gca`` or ``ita``) and at most one piece
of GPU evidence (``nras`` or ``nvidia``). Every piece must be bound to the same broker nonce and
runner key: CPU tokens through ``eat_nonce`` or held data, GPU evidence through its nonce,
``SHA-256(nonce || thumbprint)`` (``binding.binding_digest``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509

from broker.attestation import gpu_pipeline, pipeline
from broker.attestation.jwks_sources import JwksSource
from broker.attestation.nvidia.local import VerifiedGpuReport
from broker.attestation.nvidia.ocsp import CertKey, cert_key, ocsp_pairs
from broker.attestation.nvidia.rim import is_known_rim_id
from broker.attestation.nvidia.sources import OcspSource, RimSource, RimUnavailable
from broker.attestation.pipeline import Binding, Material, Trust, VerifiedEvidence
from broker.core.encoding import canonical
from broker.core.errors import BrokerError
from broker.crypto.jwks import TrustedKeySet

log = logging.getLogger(__name__)
__all__ = ["EvidenceVerifier", "GpuSources", "VerifiedEvidence", "evidence_digests"]
# Lookups (key sets, RIMs, OCSP answers) one request may make. A genuine request needs far
# fewer: with 8 GPUs (pipeline's MAX_GPUS) of one host (one driver, up to 8 VBIOS versions):
# 2 key-set lookups, 9 RIMs, 8 + 2 device-chain OCSP answers (the upper chain is shared) and
# 3 for each RIM signer chain (27): 48.
MAX_OUTBOUND_PER_REQUEST = 64


@dataclass(frozen=True)
class GpuSources:
    """Where local GPU verification fetches RIMs and OCSP answers."""

    rims: RimSource
    ocsp: OcspSource


def evidence_digests(unverified_evidence: Any) -> dict[str, str]:
    """SHA-256 of each piece of evidence as sent, for the decision log (never the evidence).

    A string (a token) is hashed as its UTF-8 bytes; any other JSON value as its canonical JSON
    (sorted keys, no spaces, UTF-8), so the digest does not depend on how the runner formatted
    it. Evidence that is not an object is digested whole under ``"evidence"``. Total.
    """
    pieces = (
        unverified_evidence
        if isinstance(unverified_evidence, dict)
        else {"evidence": unverified_evidence}
    )
    digests = {}
    for kind, value in sorted(pieces.items()):
        data = (
            value.encode("utf-8", "backslashreplace")
            if isinstance(value, str)
            else canonical(value)
        )
        digests[str(kind)[:64]] = "sha256:" + hashlib.sha256(data).hexdigest()
    return digests


class EvidenceVerifier:
    """Verifies the ``evidence`` member of a release request (I/O here, decisions in the
    pipeline)."""

    def __init__(
        self,
        trust: Trust,
        *,
        key_sources: Mapping[str, JwksSource],
        gpu: GpuSources | None = None,
    ) -> None:
        if trust.audience is None:
            raise ValueError("the service verifies audiences: Trust.audience is required")
        self._trust = trust
        self._key_sources = dict(key_sources)
        self._gpu = gpu

    @property
    def kinds(self) -> frozenset[str]:
        """The evidence kinds this broker is configured to verify."""
        return self._trust.kinds

    async def verify(
        self, unverified_evidence: Any, *, nonce: str, thumbprint: str, now: datetime
    ) -> VerifiedEvidence:
        """Fetch what the evidence needs, stage by stage, then verify it with the pure pipeline.

        Nothing is fetched for a piece before the checks that need nothing fetched passed:

        1. the CPU token's key set (the issuer's, by ``kid``), then the CPU token is verified
           (signature, times, issuer, audience, binding to nonce and runner key);
        2. NRAS: its key set, once the CPU token verified; raw GPU reports: each report's chain
           length, chain to the pinned device root, SPDM signature, FWID and nonce are checked
           (``gpu_pipeline.authenticate_gpu_reports``) before any RIM or OCSP request for it;
        3. RIMs (ids of a known form only), then OCSP for the verified device chains and for
           the signer chains of the RIMs that verified; at most ``MAX_OUTBOUND_PER_REQUEST``
           lookups in all (past it, what was not asked reads unavailable: never a pass);
        4. everything, once more and pure, with what was fetched (``pipeline.verify_evidence``).

        Raises:
            InputError: ``bad_request`` or ``evidence_unsupported`` for the wrong shape.
            AttestationError: when a piece does not verify or is not bound.
            UpstreamError: when trust material cannot be fetched.
        """
        trust = self._trust
        kinds = pipeline.split_kinds(unverified_evidence, trust, require_cpu=True)
        bound_to = Binding(nonce=nonce, thumbprint=thumbprint)
        budget = OutboundBudget(MAX_OUTBOUND_PER_REQUEST)
        cpu = [kind for kind in kinds if kind in pipeline.CPU_KINDS]
        key_sets = await self._key_sets(pipeline.key_ids(unverified_evidence, trust, cpu), budget)
        material = Material(key_sets=key_sets)
        pipeline.verify_cpu_piece(unverified_evidence, trust, material, bound_to=bound_to, now=now)
        if "nras" in kinds:
            nras_kids = pipeline.key_ids(unverified_evidence, trust, ["nras"])
            key_sets.update(await self._key_sets(nras_kids, budget))
            material = Material(key_sets=key_sets)
        if "nvidia" not in kinds:
            verified = pipeline.verify_evidence(
                unverified_evidence, trust, material, bound_to=bound_to, now=now
            )
            return require_complete(verified)
        # Raw GPU evidence: chains, XMLDSig and ECDSA are CPU work, kept off the event loop.
        reports = await asyncio.to_thread(
            gpu_pipeline.authenticate_gpu_reports,
            unverified_evidence["nvidia"],
            trust,
            gpu_nonce=bound_to.expected_gpu_nonce,
            now=now,
        )
        material = await self._gpu_material(reports, key_sets, budget, now)
        verified = await asyncio.to_thread(
            pipeline.verify_evidence,
            unverified_evidence,
            trust,
            material,
            bound_to=bound_to,
            now=now,
        )
        return require_complete(verified)

    async def _key_sets(
        self, kids: Mapping[str, frozenset[str]], budget: OutboundBudget
    ) -> dict[str, TrustedKeySet]:
        key_sets: dict[str, TrustedKeySet] = {}
        for issuer, wanted in kids.items():
            source = self._key_sources.get(issuer)
            if source is None or not budget.take(1):
                continue  # no key set: the token reads "key unknown", never trusted
            keys = await source.key_set()
            for kid in sorted(wanted):
                if not keys.has_kid(kid) and budget.take(1):
                    keys = await source.key_set(unknown_kid=kid)
            key_sets[issuer] = keys
        return key_sets

    async def _gpu_material(
        self,
        reports: Sequence[VerifiedGpuReport],
        key_sets: dict[str, TrustedKeySet],
        budget: OutboundBudget,
        now: datetime,
    ) -> Material:
        """RIMs and OCSP answers for reports that verified (step 3 of ``verify``)."""
        if self._gpu is None:
            return Material(key_sets=key_sets)
        rims: dict[str, bytes] = {}
        problems: dict[str, str] = {}
        for rim_id in sorted({rim_id for report in reports for rim_id in report.rim_ids()}):
            if not is_known_rim_id(rim_id):
                problems[rim_id] = "the report names a RIM id of no known form"
            elif not budget.take(1):
                problems[rim_id] = "not fetched: the request's outbound budget is spent"
            else:
                try:
                    rims[rim_id] = await self._gpu.rims.get(rim_id)
                except RimUnavailable as exc:
                    log.warning("RIM %s unavailable: %s", rim_id, exc)
                    problems[rim_id] = str(exc)
        partial = Material(key_sets=key_sets, rims=rims, rim_problems=problems)
        rim_chains = await asyncio.to_thread(
            gpu_pipeline.rim_ocsp_chains, partial, self._trust, now
        )
        pairs = distinct_pairs(
            [(tuple(report.chain), False) for report in reports]
            + [(chain, True) for chain in rim_chains]
        )
        asked = pairs[: budget.take_up_to(len(pairs))]
        ocsp = await self._gpu.ocsp.answers(asked, now) if asked else {}
        return Material(key_sets=key_sets, rims=rims, rim_problems=problems, ocsp=ocsp)


class OutboundBudget:
    """How many more lookups (key sets, RIMs, OCSP answers) one request may make. A lookup
    served from a cache costs the same: the bound holds whatever the caches hold."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, count: int) -> bool:
        """Take ``count`` lookups if that many are left."""
        if count > self.left:
            return False
        self.left -= count
        return True

    def take_up_to(self, count: int) -> int:
        """Take as many of ``count`` lookups as are left; how many."""
        granted = min(count, self.left)
        self.left -= granted
        return granted


def distinct_pairs(
    chains: Sequence[tuple[Sequence[x509.Certificate], bool]],
) -> list[tuple[x509.Certificate, x509.Certificate]]:
    """The (certificate, issuer) pairs OCSP is asked about for these (chain, include_leaf),
    each once: GPUs of one model share their upper chain, RIMs their signer CA."""
    seen: set[CertKey] = set()
    pairs = []
    for chain, include_leaf in chains:
        for cert, issuer in ocsp_pairs(chain, include_leaf=include_leaf):
            if cert_key(cert, issuer) not in seen:
                seen.add(cert_key(cert, issuer))
                pairs.append((cert, issuer))
    return pairs


def require_complete(verified: VerifiedEvidence) -> VerifiedEvidence:
    """The service's evidence is verified in full: a check the pipeline reports as skipped
    (possible only for the offline CLI's partial inputs) fails the request closed.

    Raises:
        BrokerError: ``internal_error`` (500, generic to the client) naming the skipped checks.
    """
    if verified.skipped:
        raise BrokerError(f"verification skipped checks: {', '.join(verified.skipped)}")
    return verified
