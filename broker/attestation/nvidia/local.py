"""Raw NVIDIA GPU evidence verified locally. Pure.

Checklist per GPU (docs/evidence.md-3.5; NVIDIA nvtrust local verifier, minus its gaps):

1. Parse the SPDM report from its structure (``spdm.parse_report``).
2. The certificate chain (NVML gives 5 PEM certificates, leaf first) validates at ``now`` to the
   pinned NVIDIA Device Identity root.
3. The report's ECDSA P-384 signature verifies with the leaf (``GSP FMC LF``) key.
4. FWID: the opaque FWID (48 bytes) equals the leaf's TCG DICE TcbInfo FWID (Hopper: the last 48
   bytes of extension 2.23.133.5.4.1; Blackwell: contained in it).
5. The SPDM request nonce equals the expected nonce (SHA-256(broker nonce || thumbprint)).
   NVIDIA's verifier can be run without this; ours cannot.
6. Driver and VBIOS versions and the RIM ids come from the opaque data.
7. ``compare_measurements``: active golden values from the driver and VBIOS RIMs (verified by
   ``rim.verify_rim``) against the report's blocks (RIM index k = SPDM block k+1); a match needs
   the size and one of the alternatives to agree; an index claimed by both RIMs is a conflict.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.nvidia import spdm
from broker.attestation.nvidia.rim import VerifiedRim
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.x509chain import load_pem_chain, verify_chain

ARCHES = {"HOPPER": "GH100", "BLACKWELL": "GB100"}
# The attestation (FMC leaf) certificate's CN names the chip: "GH100 A01 GSP FMC LF",
# "GB100 A01 GSP FMC LF" (docs/evidence.md); GB2xx parts are Blackwell too.
CHIP_PREFIXES = (("GH100", "HOPPER"), ("GB1", "BLACKWELL"), ("GB2", "BLACKWELL"))
GPU_MODES = {0: "spt", 1: "mpt", 2: "ppcie"}  # opaque FEATURE_FLAG (36)
TCB_INFO_OIDS = ("2.23.133.5.4.1", "2.23.133.5.4.1.1")
MAX_GPUS = 8
MAX_CHAIN_BYTES = 64 * 1024
GPU_CHAIN_LENGTH = 5


@dataclass(frozen=True)
class GpuEvidence:
    report: bytes
    chain_pem: bytes


@dataclass(frozen=True)
class UnverifiedGpuReport:
    """A parsed report and chain, nothing verified: tells the I/O layer what to fetch."""

    arch: str
    report: spdm.SpdmReport
    chain: Sequence[x509.Certificate]

    def rim_ids(self) -> tuple[str, str]:
        return rim_ids_for(self.arch, self.report)


@dataclass(frozen=True)
class VerifiedGpuReport:
    """A report whose chain, signature, FWID and nonce verified; measurements not yet compared."""

    arch: str
    report: spdm.SpdmReport
    chain: Sequence[x509.Certificate]

    @property
    def ueid(self) -> str:
        return str(self.chain[0].serial_number)

    @property
    def mode(self) -> str:
        """``spt`` | ``mpt`` | ``ppcie`` from the report's FEATURE_FLAG; ``unknown`` on
        reports that predate the field (OPAQUE_DATA_VERSION < 1)."""
        raw = self.report.opaque.get(spdm.OPAQUE_FEATURE_FLAG, b"")
        return (
            GPU_MODES.get(int.from_bytes(raw, "little"), "unknown") if len(raw) == 2 else "unknown"
        )

    def rim_ids(self) -> tuple[str, str]:
        return rim_ids_for(self.arch, self.report)


def rim_ids_for(arch: str, report: spdm.SpdmReport) -> tuple[str, str]:
    """(driver RIM id, VBIOS RIM id) as NVIDIA's RIM service names them."""
    driver = report.driver_version
    if arch == "HOPPER":
        driver_id = f"NV_GPU_DRIVER_GH100_{driver}"
    else:
        driver_id = f"NV_GPU_CC_DRIVER_{report.ascii_field(spdm.OPAQUE_CHIP_INFO)}_{driver}"
    vbios = report.vbios_version.replace(".", "").upper()
    project = report.ascii_field(spdm.OPAQUE_PROJECT)
    sku = report.ascii_field(spdm.OPAQUE_PROJECT_SKU)
    chip = report.ascii_field(spdm.OPAQUE_CHIP_SKU)
    return driver_id, f"NV_GPU_VBIOS_{project}_{sku}_{chip}_{vbios}"


@dataclass(frozen=True)
class MeasurementComparison:
    result: str  # "match" | "mismatch"
    mismatched_indexes: tuple[int, ...]
    problems: tuple[str, ...]


def parse_local_evidence(unverified: Any) -> tuple[str | None, list[GpuEvidence]]:
    """``{"arch"?: "HOPPER"|"BLACKWELL", "evidence_list": [{"evidence", "certificate"}, …]}``
    with base64 report and base64 PEM chain (NVIDIA's NRAS request shape). ``arch`` is optional:
    the architecture is inferred from each GPU's certificate; a declared one must agree.

    Raises:
        AttestationError: ``evidence_malformed``.
    """
    if not isinstance(unverified, dict) or set(unverified) - {"arch", "evidence_list", "nonce"}:
        raise _malformed('expected {"arch", "evidence_list"}')
    arch = unverified.get("arch")
    items = unverified.get("evidence_list")
    if arch is not None and (not isinstance(arch, str) or arch not in ARCHES):
        raise _malformed("arch must be HOPPER or BLACKWELL (or absent: inferred)")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_GPUS:
        raise _malformed(f"evidence_list must have 1..{MAX_GPUS} entries")
    evidence = []
    for item in items:
        if not isinstance(item, dict):
            raise _malformed("evidence entries must be objects")
        if set(item) - {"evidence", "certificate"} or not all(
            isinstance(item.get(k), str) for k in ("evidence", "certificate")
        ):
            raise _malformed("evidence entries are {evidence, certificate} base64 strings")
        try:
            report = base64.b64decode(item["evidence"], validate=True)
            chain = base64.b64decode(item["certificate"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _malformed("evidence and certificate must be base64") from exc
        if len(chain) > MAX_CHAIN_BYTES:
            raise _malformed("certificate chain too large")
        evidence.append(GpuEvidence(report=report, chain_pem=chain))
    return arch, evidence


def infer_arch(leaf: x509.Certificate, declared: str | None) -> str:
    """The GPU architecture the attestation certificate names.

    Raises:
        AttestationError: ``gpu_arch_mismatch`` when ``declared`` contradicts it (naming
            both), ``evidence_malformed`` when the certificate names no known chip.
    """
    names = leaf.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    common_name = str(names[0].value) if names else ""
    inferred = next((a for prefix, a in CHIP_PREFIXES if common_name.startswith(prefix)), None)
    if inferred is None:
        raise _malformed(f"attestation certificate names no known GPU chip ({common_name[:40]!r})")
    if declared is not None and declared != inferred:
        raise AttestationError(
            f"declared arch {declared} contradicts the evidence, whose certificate names "
            f"{inferred} ({common_name[:5]})",
            code=ErrorCode.GPU_ARCH_MISMATCH,
        )
    return inferred


def parse_unverified(
    evidence: GpuEvidence, declared_arch: str | None = None
) -> UnverifiedGpuReport:
    """Parse report and chain (nothing verified), for the I/O layer to know what to fetch.

    Raises:
        AttestationError: ``evidence_malformed``, ``cert_chain_invalid``, ``gpu_arch_mismatch``.
    """
    report = spdm.parse_report(evidence.report)
    chain = load_pem_chain(evidence.chain_pem)
    if not chain:
        raise AttestationError("GPU certificate chain is empty", code=ErrorCode.CERT_CHAIN_INVALID)
    return UnverifiedGpuReport(infer_arch(chain[0], declared_arch), report, chain)


def verify_gpu_report(
    evidence: GpuEvidence,
    *,
    arch: str | None,
    device_roots: Sequence[x509.Certificate],
    expected_nonce: bytes | None,
    now: datetime,
) -> VerifiedGpuReport:
    """Steps 1-5 above. ``arch=None`` infers it from the certificate; a declared one must
    agree. ``expected_nonce=None`` skips step 5 (offline CLI only).

    Raises:
        AttestationError: ``evidence_malformed``, ``cert_chain_invalid``, ``gpu_arch_mismatch``,
            ``evidence_signature_invalid``, ``fwid_mismatch`` or ``nonce_mismatch``.
    """
    parsed = parse_unverified(evidence, arch)
    report, chain, arch = parsed.report, list(parsed.chain), parsed.arch
    if len(chain) != GPU_CHAIN_LENGTH:
        raise AttestationError(
            f"GPU certificate chain must have {GPU_CHAIN_LENGTH} certificates",
            code=ErrorCode.CERT_CHAIN_INVALID,
        )
    validated = verify_chain(
        chain[0], [c for c in chain[1:] if c not in device_roots], device_roots, now=now
    )
    leaf_key = chain[0].public_key()
    if not isinstance(leaf_key, ec.EllipticCurvePublicKey):
        raise AttestationError("GPU leaf key is not ECDSA", code=ErrorCode.CERT_CHAIN_INVALID)
    spdm.verify_signature(report, leaf_key)
    _check_fwid(chain[0], report.fwid, arch)
    if expected_nonce is not None and report.request_nonce != expected_nonce:
        raise AttestationError(
            "GPU report nonce is not SHA-256(nonce || runner key thumbprint)",
            code=ErrorCode.NONCE_MISMATCH,
        )
    return VerifiedGpuReport(arch=arch, report=report, chain=validated)


def _check_fwid(leaf: x509.Certificate, fwid: bytes, arch: str) -> None:
    values = [e.value for e in leaf.extensions if e.oid.dotted_string in TCB_INFO_OIDS]
    raw = [v.value for v in values if isinstance(v, x509.UnrecognizedExtension)]
    if len(fwid) != 48 or not any(fwid):
        raise AttestationError("GPU report has no FWID", code=ErrorCode.FWID_MISMATCH)
    found = any(value.endswith(fwid) if arch == "HOPPER" else fwid in value for value in raw)
    if not found:
        raise AttestationError(
            "GPU report FWID differs from the attestation certificate's FWID",
            code=ErrorCode.FWID_MISMATCH,
        )


def compare_measurements(
    report: spdm.SpdmReport, driver: VerifiedRim, vbios: VerifiedRim
) -> MeasurementComparison:
    """Step 7 above."""
    problems: list[str] = []
    conflicts = sorted(set(driver.measurements) & set(vbios.measurements))
    if conflicts:
        problems.append(f"indexes claimed by both RIMs: {conflicts}")
    golden = {**driver.measurements, **vbios.measurements}
    mismatched = []
    for index, expected in sorted(golden.items()):
        value = report.measurements.get(index + 1)
        if value is None or len(value) != expected.size or value not in expected.alternatives:
            mismatched.append(index)
    if mismatched:
        problems.append(f"measurement indexes that differ from the RIMs: {mismatched}")
    return MeasurementComparison(
        result="mismatch" if problems else "match",
        mismatched_indexes=tuple(mismatched),
        problems=tuple(problems),
    )


def _malformed(message: str) -> AttestationError:
    return AttestationError(f"GPU evidence: {message}", code=ErrorCode.EVIDENCE_MALFORMED)


def summary(verified: VerifiedGpuReport) -> Mapping[str, Any]:
    return {
        "arch": verified.arch,
        "driver_version": verified.report.driver_version,
        "vbios_version": verified.report.vbios_version,
        "ueid": verified.ueid,
        "rim_ids": list(verified.rim_ids()),
    }
