"""Normalise verified claims into the one policy input document (docs/policy.md). Pure.

Only ``Verified…`` values come in. Anything a policy could mistake for "safe" is derived fail
closed: ``debug`` is true unless Google says exactly ``disabled-since-boot``; ``secure_boot`` is
true only for the JSON boolean ``true``; an unknown ``hwmodel`` maps to technology ``unknown``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.x509.oid import NameOID

from broker.attestation.gca import VerifiedGcaToken
from broker.attestation.ita import VerifiedItaToken, tdx_claims
from broker.attestation.nvidia.local import VerifiedGpuReport
from broker.attestation.nvidia.nras import VerifiedNrasResult
from broker.core.protocol import ATTEST_KIND

SCHEMA = "broker.input/v1"

# hwmodel (docs/evidence.md) -> technology; anything else is not a hardware TEE we know.
GCA_TECHNOLOGY = {
    "GCP_INTEL_TDX": "tdx",
    "GCP_AMD_SEV_SNP": "sev-snp",
    "GCP_AMD_SEV_ES": "sev-es",
    "GCP_AMD_SEV": "sev",
    "GCP_SHIELDED_VM": "none",
}
GCA_PRODUCTION_DBGSTAT = "disabled-since-boot"


@dataclass(frozen=True)
class RequestFacts:
    """What the release request asks for, as the policy sees it."""

    key: str
    version: int
    purpose: str
    runner_key_thumbprint: str


def gca_tee(token: VerifiedGcaToken) -> dict[str, Any]:
    """The ``tee`` section for a verified Confidential Space token."""
    claims = token.claims
    submods = _obj(claims.get("submods"))
    container = _obj(submods.get("container"))
    space = _obj(submods.get("confidential_space"))
    gce = _obj(submods.get("gce"))
    tdx = claims.get("tdx")
    # Google documents tdx as an array but real tokens carry an object (docs/evidence.md).
    tdx_obj = _obj(tdx[0] if isinstance(tdx, list) and tdx else tdx)
    swversion = claims.get("swversion")
    return {
        "verifier": "gca",
        "issuer": token.issuer,
        "technology": GCA_TECHNOLOGY.get(_str(claims.get("hwmodel")), "unknown"),
        "hwmodel": _str(claims.get("hwmodel")),
        "debug": claims.get("dbgstat") != GCA_PRODUCTION_DBGSTAT,
        "secure_boot": claims.get("secboot") is True,
        "software": {
            "name": _str(claims.get("swname")),
            "version": _str(swversion[0]) if isinstance(swversion, list) and swversion else "",
            "support": _str_list(space.get("support_attributes")),
        },
        "workload": {
            "image_reference": _str(container.get("image_reference")),
            "image_digest": _str(container.get("image_digest")),
            "image_id": _str(container.get("image_id")),
            "restart_policy": _str(container.get("restart_policy")),
            "service_accounts": _str_list(claims.get("google_service_accounts")),
            "args": _str_list(container.get("args")),
            "env": _str_map(container.get("env")),
            "env_override": _str_map(container.get("env_override")),
            # cosign signatures the launcher verified: key ids and algorithms, never the bytes
            "signatures": [
                {"key_id": _str(s.get("key_id")), "algorithm": _str(s.get("signature_algorithm"))}
                for s in container.get("image_signatures", [])
                if isinstance(s, dict)
            ]
            if isinstance(container.get("image_signatures"), list)
            else [],
        },
        "platform": {
            "project_id": _str(gce.get("project_id")),
            "project_number": _str(gce.get("project_number")),
            "zone": _str(gce.get("zone")),
            "instance_id": _str(gce.get("instance_id")),
            "instance_name": _str(gce.get("instance_name")),
        },
        "tcb_status": _str(tdx_obj.get("gcp_attester_tcb_status")),
    }


def build_input(
    *,
    request: RequestFacts,
    tee: Mapping[str, Any],
    raw_claims: Mapping[str, Mapping[str, Any]],
    now: datetime,
    gpus: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Assemble the versioned policy input."""
    return {
        "schema": SCHEMA,
        "request": {
            "key": request.key,
            "version": request.version,
            "purpose": request.purpose,
            "runner_key_thumbprint": request.runner_key_thumbprint,
        },
        "tee": dict(tee),
        "gpus": [dict(gpu) for gpu in gpus],
        "claims": {name: dict(values) for name, values in raw_claims.items()},
        "time": now.isoformat(),
    }


def build_attest_input(
    *,
    runner_key_thumbprint: str,
    pop_key_thumbprint: str,
    tee: Mapping[str, Any],
    raw_claims: Mapping[str, Mapping[str, Any]],
    now: datetime,
    gpus: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The policy input of an attestation (``data.broker.attest``): the release input's shape
    without a key, with ``request.kind`` = ``attest`` and both runner keys' thumbprints."""
    return {
        "schema": SCHEMA,
        "request": {
            "kind": ATTEST_KIND,
            "runner_key_thumbprint": runner_key_thumbprint,
            "pop_key_thumbprint": pop_key_thumbprint,
        },
        "tee": dict(tee),
        "gpus": [dict(gpu) for gpu in gpus],
        "claims": {name: dict(values) for name, values in raw_claims.items()},
        "time": now.isoformat(),
    }


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, str)}


def _str_list(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def ita_tee(token: VerifiedItaToken) -> dict[str, Any]:
    """The ``tee`` section for a verified Intel Trust Authority token.

    Tokens ITA issues for Confidential Space carry Google's claim set: they are normalised as
    such, with ITA as verifier. Plain TDX tokens carry ``tdx_*`` claims (flat in v1, under
    ``tdx`` in v2).
    """
    claims = token.claims
    if "submods" in claims:
        tee = gca_tee(VerifiedGcaToken(issuer=token.issuer, kid=token.kid, claims=claims))
        tdx = _obj(claims.get("tdx"))
        tee.update(
            verifier="ita",
            technology="tdx" if claims.get("hwmodel") == "INTEL_TDX" else tee["technology"],
        )
        tee["tcb_status"] = _str(tdx.get("attester_tcb_status")) or tee["tcb_status"]
        return tee
    tdx = tdx_claims(claims)
    debug_flags = (tdx.get("tdx_td_attributes_debug"), tdx.get("tdx_is_debuggable"))
    return {
        "verifier": "ita",
        "issuer": token.issuer,
        "technology": "tdx"
        if _str(claims.get("attester_type") or tdx.get("attester_type") or "TDX").upper() == "TDX"
        else "unknown",
        "debug": debug_flags != (False, False),
        "secure_boot": claims.get("secboot") is True,
        "software": {"name": "", "version": "", "support": []},
        "workload": {
            "image_reference": "",
            "image_digest": "",
            "image_id": "",
            "restart_policy": "",
            "service_accounts": [],
        },
        "platform": {
            "project_id": "",
            "project_number": "",
            "zone": "",
            "instance_id": "",
            "instance_name": "",
        },
        "measurements": {
            "mrtd": _str(tdx.get("tdx_mrtd")),
            "rtmr": [_str(tdx.get(f"tdx_rtmr{i}")) for i in range(4)],
            "mrseam": _str(tdx.get("tdx_mrseam")),
            "mrsignerseam": _str(tdx.get("tdx_mrsignerseam")),
            "mrconfigid": _str(tdx.get("tdx_mrconfigid")),
            "mrowner": _str(tdx.get("tdx_mrowner")),
            "report_data": _str(tdx.get("tdx_report_data")),
        },
        "tcb_status": _str(claims.get("attester_tcb_status") or tdx.get("attester_tcb_status")),
        "advisory_ids": _str_list(claims.get("attester_advisory_ids")),
    }


def gpu_cc_mode(raw_claims: Mapping[str, Mapping[str, Any]]) -> str:
    """CC mode as the CPU evidence states it (Confidential Space ``submods.nvidia_gpu``).

    GPU evidence itself does not say whether confidential computing is on, so without a CPU
    claim the mode is ``unknown``.
    """
    for claims in raw_claims.values():
        mode = _obj(_obj(claims.get("submods")).get("nvidia_gpu")).get("cc_mode")
        if isinstance(mode, str):
            return mode.lower()
    return "unknown"


def nras_gpu_entries(result: VerifiedNrasResult, *, cc_mode: str) -> list[dict[str, Any]]:
    """One ``gpus[]`` entry per detached NRAS token."""
    entries = []
    for name, claims in sorted(result.gpus.items()):
        chain = _obj(claims.get("x-nvidia-gpu-attestation-report-cert-chain"))
        validated = claims.get("x-nvidia-gpu-attestation-report-cert-chain-validated")
        cert_status = _str(chain.get("x-nvidia-cert-status")) or (
            "valid" if validated is True else "invalid"
        )
        hwmodel = _str(claims.get("hwmodel"))
        entries.append(
            {
                "id": name,
                "verifier": "nras",
                "mode": "unknown",  # NRAS results do not state it
                "arch": _arch(hwmodel),
                "hwmodel": hwmodel,
                "cc_mode": cc_mode,
                "debug": claims.get("dbgstat") != "disabled",
                "secure_boot": claims.get("secboot") is True,
                "measurements": "match" if claims.get("measres") == "success" else "mismatch",
                "overall_result": result.overall.get("x-nvidia-overall-att-result") is True,
                "driver_version": _str(claims.get("x-nvidia-gpu-driver-version")),
                "vbios_version": _str(claims.get("x-nvidia-gpu-vbios-version")),
                "ueid": _str(claims.get("ueid")),
                "cert_chain": cert_status,
                "ocsp": _str(chain.get("x-nvidia-cert-ocsp-status")) or "unknown",
            }
        )
    return entries


def ita_gpu_entries(claims: Mapping[str, Any], *, cc_mode: str) -> list[dict[str, Any]]:
    """``gpus[]`` entries from the ``nvgpu`` section of an Intel Trust Authority token.

    ITA appraises GPU evidence through NRAS and copies the result in one of two documented
    shapes (docs/evidence.md): the 2024 form (NRAS claims with
    ``x-nvidia-attestation-detailed-result``) or the newer ``{"x-nvidia-overall-att-result",
    "claim_details": {"GPU-0": {…}}}``. Both normalise to the same fields. A result the token
    does not state (the certificate chain's, the overall one) is left out of the entry, never
    defaulted to success: a policy that requires it then denies.
    """
    nvgpu = _obj(claims.get("nvgpu"))
    if not nvgpu:
        return []
    details = _obj(nvgpu.get("claim_details"))
    overall = nvgpu.get("x-nvidia-overall-att-result")
    per_gpu = details or {"GPU-0": nvgpu}
    entries = []
    for name, gpu_claims in sorted(per_gpu.items()):
        gpu = _obj(gpu_claims)
        detailed = _obj(gpu.get("x-nvidia-attestation-detailed-result"))
        matched = gpu.get("measres") == "success" or (
            detailed.get("x-nvidia-gpu-measurements-match") is True
        )
        hwmodel = _str(gpu.get("hwmodel"))
        entry: dict[str, Any] = {
            "id": str(name),
            "verifier": "ita",
            "mode": "unknown",  # ITA's nvgpu results do not state it
            "arch": _arch(hwmodel),
            "hwmodel": hwmodel,
            "cc_mode": cc_mode,
            "debug": gpu.get("dbgstat") != "disabled",
            "secure_boot": gpu.get("secboot") is True,
            "measurements": "match" if matched and overall is not False else "mismatch",
            "driver_version": _str(gpu.get("x-nvidia-gpu-driver-version")),
            "vbios_version": _str(gpu.get("x-nvidia-gpu-vbios-version")),
            "ueid": _str(gpu.get("ueid")),
            "ocsp": "unknown",
        }
        if isinstance(overall, bool):
            entry["overall_result"] = overall
        chain_validated = _ita_chain_validated(gpu, detailed)
        if chain_validated is not None:
            entry["cert_chain"] = "valid" if chain_validated else "invalid"
        entries.append(entry)
    return entries


ITA_CHAIN_CLAIM = "x-nvidia-gpu-attestation-report-cert-chain-validated"


def _ita_chain_validated(gpu: Mapping[str, Any], detailed: Mapping[str, Any]) -> bool | None:
    """The GPU's certificate-chain result as the token states it; ``None`` when it does not
    (only the JSON boolean ``true`` is a valid chain)."""
    for source in (detailed, gpu):
        if ITA_CHAIN_CLAIM in source:
            return source[ITA_CHAIN_CLAIM] is True
    return None


def local_gpu_entry(
    index: int,
    report: VerifiedGpuReport,
    *,
    measurements: str,
    problems: list[str],
    ocsp: str,
    cc_mode: str,
) -> dict[str, Any]:
    """The ``gpus[]`` entry for a GPU whose raw evidence the broker verified itself."""
    return {
        "id": f"GPU-{index}",
        "verifier": "local",
        "arch": report.arch,
        "mode": report.mode,  # spt | mpt | ppcie | unknown (FEATURE_FLAG)
        "hwmodel": _common_name(report.chain[1]) if len(report.chain) > 1 else "",
        "cc_mode": cc_mode,
        # Debug state is not in the SPDM report; RIM-matching firmware is the production image.
        "debug": measurements != "match",
        "secure_boot": measurements == "match",
        "measurements": measurements,
        "problems": problems,
        "driver_version": report.report.driver_version,
        "vbios_version": report.report.vbios_version,
        "ueid": report.ueid,
        "cert_chain": "valid",
        "ocsp": ocsp,
    }


def _common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _arch(hwmodel: str) -> str:
    if hwmodel.startswith("GH100"):
        return "HOPPER"
    if hwmodel.startswith(("GB100", "GB2")):
        return "BLACKWELL"
    return "unknown"
