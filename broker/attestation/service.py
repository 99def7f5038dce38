"""The async layer around the pure verifiers: picks trust anchors, fetches keys, RIMs and OCSP
status, then calls the verifiers with those values.

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
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509

from broker.attestation import binding, claims, gca, ita
from broker.attestation.jwks import JwksSource, TrustedKeySet
from broker.attestation.nvidia import local, nras, rim
from broker.attestation.nvidia.sources import OcspChecker, RimSource, RimUnavailable
from broker.audit.log import canonical
from broker.config import IssuerSettings
from broker.errors import AttestationError, ErrorCode, InputError

log = logging.getLogger(__name__)
CPU_KINDS = ("gca", "ita")
GPU_KINDS = ("nras", "nvidia")


@dataclass(frozen=True)
class TrustedIssuer:
    settings: IssuerSettings
    keys: JwksSource | None
    roots: Sequence[x509.Certificate] = ()


@dataclass(frozen=True)
class LocalGpuTrust:
    device_roots: Sequence[x509.Certificate]
    rim_roots: Sequence[x509.Certificate]
    rims: RimSource
    ocsp: OcspChecker


@dataclass(frozen=True)
class VerifiedEvidence:
    """Everything the release path learns from verified evidence."""

    tee: Mapping[str, Any]
    raw_claims: Mapping[str, Mapping[str, Any]]
    identity: Mapping[str, Any]  # the identity claims recorded in the decision log
    gpus: Sequence[Mapping[str, Any]] = field(default_factory=list)


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
    """Verifies the ``evidence`` member of a release request."""

    def __init__(
        self,
        issuers: Mapping[str, TrustedIssuer],
        *,
        audience: str,
        leeway: timedelta,
        local_gpu: LocalGpuTrust | None = None,
    ) -> None:
        self._issuers = dict(issuers)
        self._audience = audience
        self._leeway = leeway
        self._local_gpu = local_gpu
        self._nras = next((i for i in issuers.values() if i.settings.kind == "nras"), None)
        local = {"nvidia"} if local_gpu is not None else set()
        self._kinds = frozenset({i.settings.kind for i in issuers.values()} | local)

    @property
    def kinds(self) -> frozenset[str]:
        """The evidence kinds this broker is configured to verify."""
        return self._kinds

    async def verify(
        self, unverified_evidence: Any, *, nonce: str, thumbprint: str, now: datetime
    ) -> VerifiedEvidence:
        """Verify every piece of evidence and its binding to ``nonce`` and ``thumbprint``.

        Raises:
            InputError: ``bad_request`` or ``evidence_unsupported`` for the wrong shape.
            AttestationError: when a piece does not verify or is not bound.
            UpstreamError: when trust material cannot be fetched.
        """
        cpu_kind, gpu_kind = self._split(unverified_evidence)
        if cpu_kind == "gca":
            cpu = await self._verify_gca(unverified_evidence["gca"], nonce, thumbprint, now)
        else:
            cpu = await self._verify_ita(unverified_evidence["ita"], nonce, thumbprint, now)
        if gpu_kind is None:
            return cpu
        gpu_nonce = binding.binding_digest(nonce, thumbprint)
        cc_mode = claims.gpu_cc_mode(cpu.raw_claims)
        if gpu_kind == "nras":
            gpus, raw = await self._verify_nras(
                unverified_evidence["nras"], gpu_nonce, cc_mode, now
            )
        else:
            gpus, raw = await self._verify_local(
                unverified_evidence["nvidia"], gpu_nonce, cc_mode, now
            )
        all_gpus = [*cpu.gpus, *gpus]
        return VerifiedEvidence(
            tee=cpu.tee,
            raw_claims={**cpu.raw_claims, gpu_kind: raw},
            identity={**cpu.identity, "gpus": [g.get("ueid") for g in all_gpus]},
            gpus=all_gpus,
        )

    def _split(self, unverified_evidence: Any) -> tuple[str, str | None]:
        if not isinstance(unverified_evidence, dict) or not unverified_evidence:
            raise InputError("evidence must be a non-empty object")
        unknown = sorted(set(unverified_evidence) - self.kinds)
        if unknown:
            raise InputError(
                f"unsupported evidence kinds: {', '.join(unknown)} "
                f"(this broker accepts {', '.join(sorted(self.kinds))})",
                code=ErrorCode.EVIDENCE_UNSUPPORTED,
            )
        cpu = [k for k in CPU_KINDS if k in unverified_evidence]
        gpu = [k for k in GPU_KINDS if k in unverified_evidence]
        if len(cpu) != 1 or len(gpu) > 1:
            raise InputError(
                "evidence needs exactly one of gca/ita and at most one of nras/nvidia",
                code=ErrorCode.EVIDENCE_UNSUPPORTED,
            )
        return cpu[0], (gpu[0] if gpu else None)

    async def _verify_gca(
        self, token: Any, nonce: str, thumbprint: str, now: datetime
    ) -> VerifiedEvidence:
        issuer = self._issuer_for(token, "gca")
        keys = await self._keys_for(issuer, token)
        verified = gca.verify_gca_token(
            token,
            trust=gca.GcaTrust(
                issuer=issuer.settings.issuer,
                algorithms=issuer.settings.effective_algorithms,
                keys=keys,
                roots=issuer.roots if "pki" in issuer.settings.token_types else (),
                tolerated_jku=issuer.settings.tolerated_jku,
            ),
            audience=self._audience,
            now=now,
            leeway=self._leeway,
        )
        binding.check_eat_nonce(
            verified.claims.get("eat_nonce"), nonce=nonce, thumbprint=thumbprint
        )
        tee = claims.gca_tee(verified)
        return VerifiedEvidence(
            tee=tee, raw_claims={"gca": verified.claims}, identity=_identity(tee, verified)
        )

    async def _verify_ita(
        self, token: Any, nonce: str, thumbprint: str, now: datetime
    ) -> VerifiedEvidence:
        issuer = self._issuer_for(token, "ita")
        keys = await self._keys_for(issuer, token)
        if keys is None:
            raise AttestationError("ita issuer has no key set", code=ErrorCode.TOKEN_KEY_UNKNOWN)
        verified = ita.verify_ita_token(
            token,
            trust=ita.ItaTrust(
                issuer=issuer.settings.issuer,
                algorithms=issuer.settings.effective_algorithms,
                keys=keys,
                roots=issuer.roots,
                tolerated_jku=issuer.settings.tolerated_jku,
            ),
            audience=self._audience,
            now=now,
            leeway=self._leeway,
        )
        ita.check_ita_binding(verified.claims, nonce=nonce, thumbprint=thumbprint)
        tee = claims.ita_tee(verified)
        gpus = claims.ita_gpu_entries(
            verified.claims, cc_mode=claims.gpu_cc_mode({"ita": verified.claims})
        )
        return VerifiedEvidence(
            tee=tee,
            raw_claims={"ita": verified.claims},
            identity=_identity(tee, verified),
            gpus=gpus,
        )

    async def _verify_nras(
        self, unverified: Any, gpu_nonce: bytes, cc_mode: str, now: datetime
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if self._nras is None or self._nras.keys is None:
            raise InputError("nras evidence is not configured", code=ErrorCode.EVIDENCE_UNSUPPORTED)
        overall_token, detached = nras.parse_detached_eat(unverified)
        keys = await self._nras.keys.key_set()
        for token in (overall_token, *detached.values()):
            kid = gca.parse_gca_header(token, self._nras.settings.effective_algorithms).kid
            if not keys.has_kid(kid):
                keys = await self._nras.keys.key_set(unknown_kid=kid)
        result = nras.verify_nras(
            unverified,
            trust=nras.NrasTrust(
                issuer=self._nras.settings.issuer,
                algorithms=self._nras.settings.effective_algorithms,
                keys=keys,
                anchors=self._nras.roots,
            ),
            expected_nonce=gpu_nonce,
            now=now,
            leeway=self._leeway,
        )
        raw = {
            "overall": dict(result.overall),
            "gpus": {k: dict(v) for k, v in result.gpus.items()},
        }
        return claims.nras_gpu_entries(result, cc_mode=cc_mode), raw

    async def _verify_local(
        self, unverified: Any, gpu_nonce: bytes, cc_mode: str, now: datetime
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        trust = self._local_gpu
        if trust is None:
            raise InputError(
                "local GPU verification is not configured ([nvidia] device_root)",
                code=ErrorCode.EVIDENCE_UNSUPPORTED,
            )
        arch, items = local.parse_local_evidence(unverified)
        entries, summaries = [], []
        for index, item in enumerate(items):
            # Chains and signatures are CPU work: off the event loop.
            report = await asyncio.to_thread(
                local.verify_gpu_report,
                item,
                arch=arch,
                device_roots=trust.device_roots,
                expected_nonce=gpu_nonce,
                now=now,
            )
            measurements, problems = await self._compare(report, trust, now)
            ocsp = await trust.ocsp.status(report.chain)
            entries.append(
                claims.local_gpu_entry(
                    index,
                    report,
                    measurements=measurements,
                    problems=problems,
                    ocsp=ocsp,
                    cc_mode=cc_mode,
                )
            )
            summaries.append(dict(local.summary(report)))
        return entries, {"gpus": summaries}

    async def _compare(
        self, report: local.VerifiedGpuReport, trust: LocalGpuTrust, now: datetime
    ) -> tuple[str, list[str]]:
        """Measurements against the RIMs: ``match``, ``mismatch`` or ``unverified``."""
        try:
            driver_id, vbios_id = report.rim_ids()
            # XMLDSig verification parses, canonicalises and reads signxml's schema files.
            driver, vbios = [
                await asyncio.to_thread(
                    rim.verify_rim, await trust.rims.get(rim_id), roots=trust.rim_roots, now=now
                )
                for rim_id in (driver_id, vbios_id)
            ]
        except (RimUnavailable, AttestationError) as exc:
            log.warning("GPU %s: RIMs unusable: %s", report.ueid, exc)
            return "unverified", [f"RIMs unusable: {exc}"]
        problems = []
        if driver.version.lower() != report.report.driver_version.lower():
            problems.append(f"driver RIM version {driver.version} differs from the report")
        if vbios.version.lower() != report.report.vbios_version.lower():
            problems.append(f"VBIOS RIM version {vbios.version} differs from the report")
        comparison = local.compare_measurements(report.report, driver, vbios)
        problems.extend(comparison.problems)
        return ("match" if not problems else "mismatch"), problems

    def _issuer_for(self, token: Any, kind: str) -> TrustedIssuer:
        if not isinstance(token, str) or not token:
            raise InputError(f"evidence.{kind} must be a JWT string")
        iss = gca.unverified_issuer(token)
        if iss is None:
            raise AttestationError("token payload is not JSON with an iss claim")
        issuer = self._issuers.get(iss)
        if issuer is None or issuer.settings.kind != kind:
            raise AttestationError(
                f"token issuer is not a configured {kind} issuer", code=ErrorCode.ISSUER_UNKNOWN
            )
        return issuer

    async def _keys_for(self, issuer: TrustedIssuer, token: str) -> TrustedKeySet | None:
        if issuer.keys is None:
            return None
        header = gca.parse_gca_header(
            token,
            issuer.settings.effective_algorithms,
            tolerated_jku=issuer.settings.tolerated_jku,
        )
        if "x5c" in header.fields:
            return None
        keys = await issuer.keys.key_set()
        if not keys.has_kid(header.kid):
            keys = await issuer.keys.key_set(unknown_kid=header.kid)
        return keys


def _identity(tee: Mapping[str, Any], verified: Any) -> dict[str, Any]:
    return {
        "issuer": verified.issuer,
        "kid": verified.kid,
        "sub": verified.claims.get("sub"),
        "image_digest": tee["workload"]["image_digest"],
        "project_id": tee["platform"]["project_id"],
        "instance_id": tee["platform"]["instance_id"],
        "mrtd": tee.get("measurements", {}).get("mrtd"),
    }
