"""Normalise verified claims into the one policy input document (DESIGN.md §3). Pure.

Only ``Verified…`` values come in. Anything a policy could mistake for "safe" is derived fail
closed: ``debug`` is true unless Google says exactly ``disabled-since-boot``; ``secure_boot`` is
true only for the JSON boolean ``true``; an unknown ``hwmodel`` maps to technology ``unknown``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker.attestation.gca import VerifiedGcaToken

SCHEMA = "broker.input/v1"

# hwmodel (EVIDENCE.md §1.3) -> technology; anything else is not a hardware TEE we know.
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
    # Google documents tdx as an array but real tokens carry an object (EVIDENCE.md §1.3).
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
        "gpus": [],
        "claims": {name: dict(values) for name, values in raw_claims.items()},
        "time": now.isoformat(),
    }


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _str_list(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []
