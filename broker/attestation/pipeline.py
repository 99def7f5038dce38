"""The one evidence pipeline: bytes + trust material + binding + ``now`` → verified, normalised
evidence. Pure. The service (``attestation.service``) and ``broker verify`` (``offline``) both
call it; they differ only in where trust material comes from (HTTP and caches, or files).

Modelled on python-tuf's ``TrustedMetadataSet``: the I/O layer asks ``requirements`` what to
fetch for a piece of evidence (key sets by ``kid``, RIMs by id, OCSP answers for chains),
fetches it into ``Material``, and hands it back to ``verify_evidence``, which trusts nothing it
did not verify itself.

Checklist of ``verify_evidence`` (docs/api.md, docs/evidence.md):

1. Shape: exactly one CPU piece (``gca`` | ``ita``) and at most one GPU piece (``nras`` |
   ``nvidia``) among the configured kinds (``require_cpu=False``: offline, any one piece).
2. CPU token: issuer chosen by ``iss`` from configuration only, then the issuer's verifier
   (signature, times, lifetime, issuer, audience), then its binding to nonce and runner key.
3. GPU evidence: NRAS results (``nras.verify_nras``) or raw reports (``gpu_pipeline``): chain,
   signature, FWID, nonce = SHA-256(nonce || thumbprint), architecture inferred from the
   certificate; measurements against the RIMs named by the report (version equal to the
   report's, XMLDSig, signer chain); OCSP of the device chain and of both RIM signer chains.
4. Normalise claims (``claims``) into the policy input's ``tee`` and ``gpus``; every GPU entry
   must be a distinct device (UEID; for raw reports also the leaf certificate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509

from broker.attestation import claims, gca, ita
from broker.attestation.gpu_pipeline import verify_local
from broker.attestation.issuers import IssuerSettings
from broker.attestation.nvidia import local, nras
from broker.attestation.nvidia.ocsp import CertKey
from broker.core import binding
from broker.core.errors import AttestationError, ErrorCode, InputError
from broker.crypto import jose
from broker.crypto.jwks import TrustedKeySet

CPU_KINDS = ("gca", "ita")
GPU_KINDS = ("nras", "nvidia")


@dataclass(frozen=True)
class IssuerTrust:
    """A configured issuer: its settings and pinned roots (key sets are fetched material)."""

    settings: IssuerSettings
    roots: Sequence[x509.Certificate] = ()

    @property
    def max_lifetime(self) -> timedelta:
        return timedelta(seconds=self.settings.max_token_lifetime_seconds)


@dataclass(frozen=True)
class Trust:
    """Everything configuration says to trust. Built once at start-up (or from CLI files)."""

    issuers: Mapping[str, IssuerTrust]  # by ``iss``
    audience: str | None  # None: offline, audience not checked (reported as skipped)
    leeway: timedelta = jose.DEFAULT_LEEWAY
    device_roots: Sequence[x509.Certificate] = ()
    rim_roots: Sequence[x509.Certificate] = ()
    local_gpu: bool = False

    @property
    def kinds(self) -> frozenset[str]:
        local_kind = {"nvidia"} if self.local_gpu else set()
        return frozenset({i.settings.kind for i in self.issuers.values()} | local_kind)

    def issuer_of_kind(self, kind: str) -> IssuerTrust | None:
        return next((i for i in self.issuers.values() if i.settings.kind == kind), None)


@dataclass(frozen=True)
class Binding:
    """What the evidence must be bound to. The service sets all of it; the CLI what it is given."""

    nonce: str | None = None
    thumbprint: str | None = None
    gpu_nonce: bytes | None = None  # default: SHA-256(nonce || thumbprint)

    @property
    def expected_gpu_nonce(self) -> bytes | None:
        if self.gpu_nonce is not None:
            return self.gpu_nonce
        if self.nonce is not None and self.thumbprint is not None:
            return binding.binding_digest(self.nonce, self.thumbprint)
        return None


@dataclass(frozen=True)
class Requirements:
    """What the I/O layer must fetch before ``verify_evidence`` can run."""

    kids: Mapping[str, frozenset[str]]  # issuer -> key ids its tokens name
    rim_ids: frozenset[str]
    ocsp_chains: tuple[tuple[tuple[x509.Certificate, ...], bool], ...]  # (chain, include_leaf)


@dataclass(frozen=True)
class Material:
    """Fetched trust material. Anything absent reads as unavailable, never as trusted."""

    key_sets: Mapping[str, TrustedKeySet] = field(default_factory=dict)
    rims: Mapping[str, bytes] = field(default_factory=dict)
    rim_problems: Mapping[str, str] = field(default_factory=dict)
    ocsp: Mapping[CertKey, bytes] = field(default_factory=dict)  # DER responses, judged here


@dataclass(frozen=True)
class VerifiedEvidence:
    """Everything the release path learns from verified evidence."""

    tee: Mapping[str, Any]
    raw_claims: Mapping[str, Mapping[str, Any]]
    identity: Mapping[str, Any]  # the identity claims recorded in the decision log
    gpus: Sequence[Mapping[str, Any]] = ()
    skipped: Sequence[str] = ()  # checks not made for lack of input (offline CLI only)


def split_kinds(unverified_evidence: Any, trust: Trust, *, require_cpu: bool) -> list[str]:
    """Step 1. Returns the kinds present, CPU first.

    Raises:
        InputError: ``bad_request`` (not an object) or ``evidence_unsupported``.
    """
    if not isinstance(unverified_evidence, dict) or not unverified_evidence:
        raise InputError("evidence must be a non-empty object")
    unknown = sorted(str(k)[:32] for k in set(unverified_evidence) - trust.kinds)
    if unknown:
        raise InputError(
            f"unsupported evidence kinds: {', '.join(unknown)} "
            f"(this broker accepts {', '.join(sorted(trust.kinds))})",
            code=ErrorCode.EVIDENCE_UNSUPPORTED,
        )
    cpu = [k for k in CPU_KINDS if k in unverified_evidence]
    gpu = [k for k in GPU_KINDS if k in unverified_evidence]
    if len(cpu) > 1 or len(gpu) > 1 or (require_cpu and not cpu):
        raise InputError(
            "evidence needs exactly one of gca/ita and at most one of nras/nvidia",
            code=ErrorCode.EVIDENCE_UNSUPPORTED,
        )
    return cpu + gpu


def key_ids(
    unverified_evidence: Any, trust: Trust, kinds: Sequence[str]
) -> dict[str, frozenset[str]]:
    """The key ids (by issuer) the tokens of ``kinds`` name: what to fetch key sets for, read
    from the *unverified* headers. The service asks this for the CPU token first and for NRAS
    only once the CPU token verified."""
    kids: dict[str, set[str]] = {}
    for kind in kinds:
        piece = unverified_evidence[kind]
        if kind in CPU_KINDS:
            issuer = _issuer_for(piece, kind, trust)
            header = _header(piece, issuer)
            if "x5c" not in header.fields and issuer.settings.uses_jwks:
                kids.setdefault(issuer.settings.issuer, set()).add(str(header.kid))
        elif kind == "nras":
            issuer = _nras_issuer(trust)
            overall, detached = nras.parse_detached_eat(piece)
            for token in (overall, *detached.values()):
                kids.setdefault(issuer.settings.issuer, set()).add(str(_header(token, issuer).kid))
    return {issuer: frozenset(ids) for issuer, ids in kids.items()}


def requirements(
    unverified_evidence: Any, trust: Trust, *, require_cpu: bool = True
) -> Requirements:
    """What to fetch for this evidence: read from its *unverified* structure, used only to
    decide what to ask for (the offline CLI, whose material is files). The service fetches in
    stages instead, each after the checks before it passed (``service.EvidenceVerifier``).
    Raises the same shape errors as ``verify_evidence``."""
    kinds = split_kinds(unverified_evidence, trust, require_cpu=require_cpu)
    kids = key_ids(unverified_evidence, trust, [k for k in kinds if k != "nvidia"])
    rim_ids: set[str] = set()
    chains: list[tuple[tuple[x509.Certificate, ...], bool]] = []
    for kind in kinds:
        piece = unverified_evidence[kind]
        if kind == "nvidia":
            _, items = local.parse_local_evidence(piece)
            for item in items:
                report = local.parse_unverified(item)
                rim_ids.update(report.rim_ids())
                chains.append((tuple(report.chain), False))
    return Requirements(kids=kids, rim_ids=frozenset(rim_ids), ocsp_chains=tuple(chains))


def verify_cpu_piece(
    unverified_evidence: Any,
    trust: Trust,
    material: Material,
    *,
    bound_to: Binding,
    now: datetime,
) -> VerifiedEvidence:
    """Steps 1 and 2 alone: the shape, then the CPU token (signature, times, issuer, audience,
    binding). The service runs this before it fetches anything for the GPU piece.

    Raises:
        InputError: ``bad_request`` / ``evidence_unsupported`` for the wrong shape.
        AttestationError: the specific code of the first check that failed.
    """
    kinds = split_kinds(unverified_evidence, trust, require_cpu=True)
    return _verify_cpu(
        kinds[0],
        unverified_evidence[kinds[0]],
        trust=trust,
        material=material,
        bound_to=bound_to,
        now=now,
        skipped=[],
    )


def verify_evidence(
    unverified_evidence: Any,
    trust: Trust,
    material: Material,
    *,
    bound_to: Binding,
    now: datetime,
    require_cpu: bool = True,
) -> VerifiedEvidence:
    """Steps 1-4 of the module checklist.

    Raises:
        InputError: ``bad_request`` / ``evidence_unsupported`` for the wrong shape.
        AttestationError: the specific code of the first check that failed.
    """
    kinds = split_kinds(unverified_evidence, trust, require_cpu=require_cpu)
    skipped: list[str] = []
    cpu: VerifiedEvidence | None = None
    if kinds[0] in CPU_KINDS:
        cpu = _verify_cpu(
            kinds[0],
            unverified_evidence[kinds[0]],
            trust=trust,
            material=material,
            bound_to=bound_to,
            now=now,
            skipped=skipped,
        )
    gpu_kind = next((k for k in kinds if k in GPU_KINDS), None)
    if gpu_kind is None:
        assert cpu is not None  # noqa: S101 - split_kinds returned at least one kind
        require_distinct_devices(cpu.gpus)
        return VerifiedEvidence(cpu.tee, cpu.raw_claims, cpu.identity, cpu.gpus, tuple(skipped))
    gpu_nonce = bound_to.expected_gpu_nonce
    if gpu_nonce is None:
        skipped.append("gpu nonce")
    cc_mode = claims.gpu_cc_mode(cpu.raw_claims) if cpu else "unknown"
    verify_gpu = _verify_nras if gpu_kind == "nras" else verify_local
    gpus, raw = verify_gpu(
        unverified_evidence[gpu_kind],
        trust=trust,
        material=material,
        gpu_nonce=gpu_nonce,
        cc_mode=cc_mode,
        now=now,
    )
    all_gpus = [*(cpu.gpus if cpu else ()), *gpus]
    require_distinct_devices(all_gpus)
    return VerifiedEvidence(
        tee=cpu.tee if cpu else {},
        raw_claims={**(cpu.raw_claims if cpu else {}), gpu_kind: raw},
        identity={**(cpu.identity if cpu else {}), "gpus": [g.get("ueid") for g in all_gpus]},
        gpus=all_gpus,
        skipped=tuple(skipped),
    )


def require_distinct_devices(gpus: Sequence[Mapping[str, Any]]) -> None:
    """Step 4a. Every GPU entry is a different device: one GPU's evidence sent twice must not
    meet a policy's ``min_gpus: 2``. Devices are told apart by UEID (the serial number of the
    GPU's leaf certificate); with two or more GPUs, an entry without one cannot be told apart
    and is refused too.

    Raises:
        AttestationError: ``gpu_evidence_duplicate``.
    """
    if len(gpus) < 2:
        return
    ueids = [gpu.get("ueid") for gpu in gpus]
    if not all(isinstance(ueid, str) and ueid for ueid in ueids):
        raise AttestationError(
            "GPU evidence without a device identity (ueid) cannot be counted as a distinct GPU",
            code=ErrorCode.GPU_EVIDENCE_DUPLICATE,
        )
    if len(set(ueids)) != len(ueids):
        raise AttestationError(
            "the same GPU's evidence is listed more than once",
            code=ErrorCode.GPU_EVIDENCE_DUPLICATE,
        )


def _verify_cpu(
    kind: str,
    token: Any,
    *,
    trust: Trust,
    material: Material,
    bound_to: Binding,
    now: datetime,
    skipped: list[str],
) -> VerifiedEvidence:
    issuer = _issuer_for(token, kind, trust)
    keys = material.key_sets.get(issuer.settings.issuer)
    settings = issuer.settings
    if trust.audience is None:
        skipped.append("audience")
    verified: gca.VerifiedGcaToken | ita.VerifiedItaToken
    if kind == "gca":
        verified = gca.verify_gca_token(
            token,
            trust=gca.GcaTrust(
                issuer=settings.issuer,
                algorithms=settings.effective_algorithms,
                keys=keys if settings.uses_jwks else None,
                roots=issuer.roots if "pki" in settings.token_types else (),
                tolerated_jku=settings.tolerated_jku,
                max_lifetime=issuer.max_lifetime,
            ),
            audience=trust.audience,
            now=now,
            leeway=trust.leeway,
        )
        tee = claims.gca_tee(verified)
        gpus: list[dict[str, Any]] = []
    else:
        if keys is None:
            raise AttestationError("ita issuer has no key set", code=ErrorCode.TOKEN_KEY_UNKNOWN)
        verified = ita.verify_ita_token(
            token,
            trust=ita.ItaTrust(
                issuer=settings.issuer,
                algorithms=settings.effective_algorithms,
                keys=keys,
                roots=issuer.roots,
                tolerated_jku=settings.tolerated_jku,
                max_lifetime=issuer.max_lifetime,
            ),
            audience=trust.audience,
            now=now,
            leeway=trust.leeway,
        )
        tee = claims.ita_tee(verified)
        gpus = claims.ita_gpu_entries(
            verified.claims, cc_mode=claims.gpu_cc_mode({"ita": verified.claims})
        )
    _check_cpu_binding(kind, verified.claims, bound_to, skipped)
    return VerifiedEvidence(
        tee=tee,
        raw_claims={kind: verified.claims},
        identity=_identity(tee, verified),
        gpus=gpus,
    )


def _check_cpu_binding(
    kind: str, token_claims: Mapping[str, Any], bound_to: Binding, skipped: list[str]
) -> None:
    if bound_to.nonce is None:
        skipped.append("nonce")
        return
    if bound_to.thumbprint is not None:
        if kind == "gca":
            binding.check_eat_nonce(
                token_claims.get("eat_nonce"), nonce=bound_to.nonce, thumbprint=bound_to.thumbprint
            )
        else:
            ita.check_ita_binding(
                token_claims, nonce=bound_to.nonce, thumbprint=bound_to.thumbprint
            )
        return
    skipped.append("runner key binding")  # offline: only "the nonce is among the token's"
    if kind == "ita" and "eat_nonce" not in token_claims:
        held = ita.held_data(token_claims)
        ita.check_report_data(token_claims, held)
        if not binding.same_bytes(held, bytes.fromhex(bound_to.nonce)):
            raise AttestationError(
                "held data differs from the nonce", code=ErrorCode.NONCE_MISMATCH
            )
        return
    if bound_to.nonce not in binding.eat_nonce_values(token_claims.get("eat_nonce")):
        raise AttestationError(
            "eat_nonce does not contain the nonce", code=ErrorCode.NONCE_MISMATCH
        )


def _verify_nras(
    unverified: Any,
    *,
    trust: Trust,
    material: Material,
    gpu_nonce: bytes | None,
    cc_mode: str,
    now: datetime,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    issuer = _nras_issuer(trust)
    keys = material.key_sets.get(issuer.settings.issuer)
    if keys is None:
        raise AttestationError("nras issuer has no key set", code=ErrorCode.TOKEN_KEY_UNKNOWN)
    result = nras.verify_nras(
        unverified,
        trust=nras.NrasTrust(
            issuer=issuer.settings.issuer,
            algorithms=issuer.settings.effective_algorithms,
            keys=keys,
            anchors=issuer.roots,
            max_lifetime=issuer.max_lifetime,
        ),
        expected_nonce=gpu_nonce,
        now=now,
        leeway=trust.leeway,
    )
    raw = {"overall": dict(result.overall), "gpus": {k: dict(v) for k, v in result.gpus.items()}}
    return claims.nras_gpu_entries(result, cc_mode=cc_mode), raw


def _issuer_for(token: Any, kind: str, trust: Trust) -> IssuerTrust:
    if not isinstance(token, str) or not token:
        raise InputError(f"evidence.{kind} must be a JWT string")
    if len(token) > jose.MAX_TOKEN_BYTES:
        raise AttestationError("token exceeds the size limit", code=ErrorCode.TOKEN_TOO_LARGE)
    iss = jose.unverified_claim(token, "iss")
    if iss is None:
        raise AttestationError("token payload is not JSON with an iss claim")
    issuer = trust.issuers.get(iss)
    if issuer is None or issuer.settings.kind != kind:
        raise AttestationError(
            f"token issuer is not a configured {kind} issuer", code=ErrorCode.ISSUER_UNKNOWN
        )
    return issuer


def _nras_issuer(trust: Trust) -> IssuerTrust:
    issuer = trust.issuer_of_kind("nras")
    if issuer is None:
        raise InputError("nras evidence is not configured", code=ErrorCode.EVIDENCE_UNSUPPORTED)
    return issuer


def _header(token: str, issuer: IssuerTrust) -> jose.UnverifiedHeader:
    return jose.parse_header_with_kid(
        token,
        issuer.settings.effective_algorithms,
        tolerated_jku=issuer.settings.tolerated_jku,
    )


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
