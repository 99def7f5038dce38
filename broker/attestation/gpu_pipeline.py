"""Raw NVIDIA GPU evidence in the evidence pipeline (``pipeline``): the checks that need nothing
fetched (``authenticate_gpu_reports``: the service runs them before it asks for any RIM or OCSP
answer), then measurements against the RIMs and OCSP of device and RIM signer chains. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from broker.attestation import claims
from broker.attestation.nvidia import local, rim
from broker.attestation.nvidia.ocsp import chain_answer, combine_ocsp
from broker.core.errors import AttestationError, ErrorCode, InputError

if TYPE_CHECKING:  # the pipeline's types; it imports this module
    from broker.attestation.pipeline import Material, Trust


def authenticate_gpu_reports(
    unverified: Any, trust: Trust, *, gpu_nonce: bytes | None, now: datetime
) -> list[local.VerifiedGpuReport]:
    """Step 3's checks that need nothing fetched, for every raw GPU report: the chain's length,
    the chain to the pinned device root, the SPDM signature, the FWID and the nonce. The service
    asks for RIMs and OCSP answers only for reports that pass (``local.verify_gpu_report``).

    Raises:
        InputError: ``evidence_unsupported`` when local GPU verification is not configured.
        AttestationError: the specific code of the first check that failed.
    """
    if not trust.local_gpu:
        raise InputError(
            "local GPU verification is not configured ([nvidia] device_root)",
            code=ErrorCode.EVIDENCE_UNSUPPORTED,
        )
    declared_arch, items = local.parse_local_evidence(unverified)
    return [
        local.verify_gpu_report(
            item,
            arch=declared_arch,
            device_roots=trust.device_roots,
            expected_nonce=gpu_nonce,
            now=now,
        )
        for item in items
    ]


def rim_ocsp_chains(
    material: Material, trust: Trust, now: datetime
) -> list[tuple[x509.Certificate, ...]]:
    """The validated signer chains of the fetched RIMs (their OCSP is asked for too)."""
    result = []
    for data in material.rims.values():
        try:
            result.append(tuple(rim.verify_rim(data, roots=trust.rim_roots, now=now).chain))
        except AttestationError:
            continue  # it will be reported by verify_evidence
    return result


def verify_local(
    unverified: Any,
    *,
    trust: Trust,
    material: Material,
    gpu_nonce: bytes | None,
    cc_mode: str,
    now: datetime,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    entries, summaries = [], []
    leaves: set[bytes] = set()
    reports = authenticate_gpu_reports(unverified, trust, gpu_nonce=gpu_nonce, now=now)
    for index, report in enumerate(reports):
        leaf = report.chain[0].fingerprint(hashes.SHA256())
        if leaf in leaves:
            raise AttestationError(
                "the same GPU's report is listed more than once (one leaf certificate)",
                code=ErrorCode.GPU_EVIDENCE_DUPLICATE,
            )
        leaves.add(leaf)
        measurements, problems, rim_chains = judge_measurements(report, trust, material, now)
        answers = [chain_answer(report.chain, material.ocsp, now, include_leaf=False)]
        answers += [
            chain_answer(chain, material.ocsp, now, include_leaf=True) for chain in rim_chains
        ]
        statuses = [answer.status for answer in answers]
        device, rim_statuses = statuses[0], statuses[1:]
        entries.append(
            claims.local_gpu_entry(
                index,
                report,
                measurements=measurements,
                problems=problems,
                ocsp=combine_ocsp(statuses) if rim_chains else "unknown",
                cc_mode=cc_mode,
            )
        )
        summary = dict(local.summary(report))
        # what OCSP said is revoked, by name: attestation results that used it are revoked too
        summary["collateral_until"] = collateral_until(
            [report.chain, *rim_chains], [a.next_update for a in answers]
        ).isoformat()
        summary["ocsp_revoked"] = {
            "device": device == "revoked",
            "rims": [
                rim_id
                for rim_id, status in zip(report.rim_ids(), rim_statuses, strict=False)
                if status == "revoked"
            ],
        }
        summaries.append(summary)
    return entries, {"gpus": summaries}


def collateral_until(
    chains: Sequence[Sequence[x509.Certificate]], next_updates: Sequence[datetime | None]
) -> datetime:
    """When what a GPU's verification rested on stops being good: the first certificate
    (device and RIM signer chains) to expire, or the first OCSP answer due for an update."""
    ends = [cert.not_valid_after_utc for chain in chains for cert in chain]
    ends += [update for update in next_updates if update is not None]
    return min(ends)


def judge_measurements(
    report: local.VerifiedGpuReport, trust: Trust, material: Material, now: datetime
) -> tuple[str, list[str], list[tuple[x509.Certificate, ...]]]:
    """Measurements against the RIMs the report names: ``match``, ``mismatch`` or
    ``unverified`` (a RIM could not be had or did not verify), with the problems found and the
    RIM signer chains. A RIM whose version differs from the report's driver/VBIOS version is a
    ``mismatch``, as NVIDIA's verifier fails the attestation on it."""
    verified: list[rim.VerifiedRim] = []
    for rim_id in report.rim_ids():
        data = material.rims.get(rim_id)
        if data is None:
            why = material.rim_problems.get(rim_id, "not available")
            return "unverified", [f"RIM {rim_id}: {why}"], []
        try:
            verified.append(rim.verify_rim(data, roots=trust.rim_roots, now=now))
        except AttestationError as exc:
            return "unverified", [f"RIM {rim_id} does not verify: {exc.message}"], []
    driver, vbios = verified
    problems = []
    if driver.version.lower() != report.report.driver_version.lower():
        problems.append(f"driver RIM version {driver.version} differs from the report")
    if vbios.version.lower() != report.report.vbios_version.lower():
        problems.append(f"VBIOS RIM version {vbios.version} differs from the report")
    comparison = local.compare_measurements(report.report, driver, vbios)
    problems.extend(comparison.problems)
    return (
        ("match" if not problems else "mismatch"),
        problems,
        [tuple(driver.chain), tuple(vbios.chain)],
    )
