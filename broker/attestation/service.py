"""The async layer around the evidence pipeline: fetches key sets, RIMs and OCSP answers, then
hands them to ``pipeline.verify_evidence`` (pure), which ``broker verify`` calls too.

A release carries exactly one piece of CPU evidence (``gca`` or ``ita``) and at most one piece
of GPU evidence (``nras`` or ``nvidia``). Every piece must be bound to the same broker nonce and
runner key: CPU tokens through ``eat_nonce`` or held data, GPU evidence through its nonce,
``SHA-256(nonce || thumbprint)`` (``binding.binding_digest``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker.attestation import pipeline
from broker.attestation.jwks import TrustedKeySet
from broker.attestation.jwks_sources import JwksSource
from broker.attestation.nvidia.ocsp import CertKey
from broker.attestation.nvidia.sources import OcspSource, RimSource, RimUnavailable
from broker.attestation.pipeline import Binding, Material, Trust, VerifiedEvidence
from broker.core.encoding import canonical
from broker.core.errors import BrokerError

log = logging.getLogger(__name__)
__all__ = ["EvidenceVerifier", "GpuSources", "VerifiedEvidence", "evidence_digests"]


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
        """Fetch what the evidence needs, then verify it with the pure pipeline.

        Raises:
            InputError: ``bad_request`` or ``evidence_unsupported`` for the wrong shape.
            AttestationError: when a piece does not verify or is not bound.
            UpstreamError: when trust material cannot be fetched.
        """
        needs = pipeline.requirements(unverified_evidence, self._trust)
        material = await self._gather(needs, now)
        bound_to = Binding(nonce=nonce, thumbprint=thumbprint)
        if not needs.rim_ids:
            verified = pipeline.verify_evidence(
                unverified_evidence, self._trust, material, bound_to=bound_to, now=now
            )
        else:
            # Raw GPU evidence: chains, XMLDSig and ECDSA are CPU work, kept off the event loop.
            verified = await asyncio.to_thread(
                pipeline.verify_evidence,
                unverified_evidence,
                self._trust,
                material,
                bound_to=bound_to,
                now=now,
            )
        return require_complete(verified)

    async def _gather(self, needs: pipeline.Requirements, now: datetime) -> Material:
        key_sets: dict[str, TrustedKeySet] = {}
        for issuer, kids in needs.kids.items():
            source = self._key_sources.get(issuer)
            if source is None:
                continue
            keys = await source.key_set()
            for kid in sorted(kids):
                if not keys.has_kid(kid):
                    keys = await source.key_set(unknown_kid=kid)
            key_sets[issuer] = keys
        if self._gpu is None or not (needs.rim_ids or needs.ocsp_chains):
            return Material(key_sets=key_sets)
        rims: dict[str, bytes] = {}
        problems: dict[str, str] = {}
        for rim_id in sorted(needs.rim_ids):
            try:
                rims[rim_id] = await self._gpu.rims.get(rim_id)
            except RimUnavailable as exc:
                log.warning("RIM %s unavailable: %s", rim_id, exc)
                problems[rim_id] = str(exc)
        partial = Material(key_sets=key_sets, rims=rims, rim_problems=problems)
        ocsp: dict[CertKey, bytes] = {}
        for chain, include_leaf in needs.ocsp_chains:
            ocsp.update(await self._gpu.ocsp.responses(chain, now, include_leaf=include_leaf))
        rim_chains = await asyncio.to_thread(pipeline.rim_ocsp_chains, partial, self._trust, now)
        for chain in rim_chains:
            ocsp.update(await self._gpu.ocsp.responses(chain, now, include_leaf=True))
        return Material(key_sets=key_sets, rims=rims, rim_problems=problems, ocsp=ocsp)


def require_complete(verified: VerifiedEvidence) -> VerifiedEvidence:
    """The service's evidence is verified in full: a check the pipeline reports as skipped
    (possible only for the offline CLI's partial inputs) fails the request closed.

    Raises:
        BrokerError: ``internal_error`` (500, generic to the client) naming the skipped checks.
    """
    if verified.skipped:
        raise BrokerError(f"verification skipped checks: {', '.join(verified.skipped)}")
    return verified
