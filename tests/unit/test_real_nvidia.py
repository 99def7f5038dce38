"""Real NVIDIA evidence: NRAS detached EAT, SPDM reports, device chains, signed RIMs."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from broker.attestation.claims import nras_gpu_entries
from broker.attestation.nvidia import local, spdm
from broker.attestation.nvidia.nras import NrasTrust, verify_nras
from broker.attestation.nvidia.rim import verify_rim
from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.jwks import parse_jwks
from tests.vectors.gpu import SimulatedGpu

NV = Path(__file__).parents[1] / "fixtures" / "real" / "nvidia"
TODAY = datetime(2026, 11, 30, tzinfo=UTC)
NRAS_RESPONSE = json.loads((NV / "nras_response_2026-09-16.json").read_text())
NRAS_EVIDENCE = json.loads((NV / "nras_gpu_evidence_2026-09-16.json").read_text())
NRAS_NONCE = bytes.fromhex(NRAS_EVIDENCE["nonce"])
NRAS_AT = datetime(2026, 9, 16, 20, 51, 44, tzinfo=UTC)  # iat + 100 s
NRAS = NrasTrust(
    issuer="https://nras.attestation.nvidia.com",
    algorithms=("ES384",),
    keys=parse_jwks((NV / "nras_jwks_subset_2026-09-16.json").read_bytes()),
    anchors=[x509.load_pem_x509_certificate((NV / "nras_gpu_intermediate_004.pem").read_bytes())],
)
DEVICE_ROOT = x509.load_pem_x509_certificate((NV / "verifier_device_root.pem").read_bytes())
RIM_ROOT = x509.load_pem_x509_certificate((NV / "verifier_RIM_root.pem").read_bytes())
# Inside the validity of both matching RIM signers (driver to 2026-06-01, VBIOS from 2026-01-07).
RIM_AT = datetime(2026, 3, 1, tzinfo=UTC)
TEST_RIM_AT = datetime(2025, 1, 1, tzinfo=UTC)  # the NVIDIA test RIMs' signers expired 2025-06
HOPPER = local.GpuEvidence(
    report=bytes.fromhex((NV / "hopperAttestationReport.txt").read_text().strip()),
    chain_pem=(NV / "hopperCertChain.txt").read_bytes(),
)
COCO = local.GpuEvidence(
    report=bytes.fromhex((NV / "hopper_coco_report1.txt").read_text().strip()),
    chain_pem=(NV / "hopper_coco_certs1.txt").read_bytes(),
)


def rim(name: str, at: datetime = RIM_AT) -> object:
    return verify_rim((NV / name).read_bytes(), roots=[RIM_ROOT], now=at)


def flip(data: bytes, at: int) -> bytes:
    mutable = bytearray(data)
    mutable[at] ^= 0x01
    return bytes(mutable)


# --- NRAS ----------------------------------------------------------------------------------


def test_real_nras_result_verifies_and_normalises() -> None:
    result = verify_nras(NRAS_RESPONSE, trust=NRAS, expected_nonce=NRAS_NONCE, now=NRAS_AT)
    assert result.overall["x-nvidia-overall-att-result"] is True
    (gpu,) = nras_gpu_entries(result, cc_mode="on")
    assert gpu["verifier"] == "nras"
    assert gpu["arch"] == "HOPPER"
    assert gpu["driver_version"] == "595.71.05"
    assert gpu["vbios_version"] == "96.00.9F.00.04"
    assert gpu["measurements"] == "match"
    assert gpu["debug"] is False
    assert gpu["cert_chain"] == "valid"
    assert gpu["ueid"] == "622721942297844926908041030373242648900055531445"


def test_real_nras_result_rejected_today() -> None:
    with pytest.raises(AttestationError) as caught:
        verify_nras(NRAS_RESPONSE, trust=NRAS, expected_nonce=NRAS_NONCE, now=TODAY)
    assert caught.value.code in {ErrorCode.TOKEN_EXPIRED, ErrorCode.CERT_CHAIN_INVALID}


def test_nras_result_for_another_nonce_rejected() -> None:
    with pytest.raises(AttestationError) as caught:
        verify_nras(NRAS_RESPONSE, trust=NRAS, expected_nonce=bytes(32), now=NRAS_AT)
    assert caught.value.code is ErrorCode.NONCE_MISMATCH


@pytest.mark.parametrize(
    ("which", "part"), [("overall", 1), ("overall", 2), ("gpu", 1), ("gpu", 2), ("gpu", 0)]
)
def test_real_nras_single_byte_mutations_rejected(which: str, part: int) -> None:
    overall, gpus = NRAS_RESPONSE[0][1], dict(NRAS_RESPONSE[1])
    token = overall if which == "overall" else gpus["GPU-0"]
    pieces = token.split(".")
    pieces[part] = b64url_encode(flip(b64url_decode(pieces[part]), 5))
    mutated = ".".join(pieces)
    if which == "overall":
        response = [["JWT", mutated], gpus]
    else:
        response = [["JWT", overall], {"GPU-0": mutated}]
    with pytest.raises(AttestationError):
        verify_nras(response, trust=NRAS, expected_nonce=NRAS_NONCE, now=NRAS_AT)


def test_detached_token_not_named_by_overall_digest_rejected() -> None:
    overall, gpus = NRAS_RESPONSE[0][1], NRAS_RESPONSE[1]
    response = [["JWT", overall], {"GPU-1": gpus["GPU-0"]}]
    with pytest.raises(AttestationError) as caught:
        verify_nras(response, trust=NRAS, expected_nonce=NRAS_NONCE, now=NRAS_AT)
    assert caught.value.code is ErrorCode.SUBMOD_DIGEST_MISMATCH


def test_nras_key_not_chaining_to_pinned_intermediate_rejected() -> None:
    trust = NrasTrust(
        issuer=NRAS.issuer, algorithms=("ES384",), keys=NRAS.keys, anchors=[DEVICE_ROOT]
    )
    with pytest.raises(AttestationError) as caught:
        verify_nras(NRAS_RESPONSE, trust=trust, expected_nonce=NRAS_NONCE, now=NRAS_AT)
    assert caught.value.code is ErrorCode.CERT_CHAIN_INVALID


@pytest.mark.parametrize(
    "shape", [[], {"a": 1}, [["JWT"], {}], [["JWS", "x"], {"GPU-0": "y"}], "not json"]
)
def test_malformed_nras_results_rejected(shape: object) -> None:
    with pytest.raises(AttestationError) as caught:
        verify_nras(shape, trust=NRAS, expected_nonce=NRAS_NONCE, now=NRAS_AT)
    assert caught.value.code is ErrorCode.EVIDENCE_MALFORMED


def test_nras_evidence_file_report_is_the_one_nras_attested() -> None:
    items = NRAS_EVIDENCE["evidence_list"]
    arch, (gpu,) = local.parse_local_evidence({"arch": "HOPPER", "evidence_list": items})
    verified = local.verify_gpu_report(
        gpu, arch=arch, device_roots=[DEVICE_ROOT], expected_nonce=NRAS_NONCE, now=NRAS_AT
    )
    assert verified.report.driver_version == "595.71.05"
    assert verified.ueid == "622721942297844926908041030373242648900055531445"


# --- local: SPDM report, chain, signature, FWID, nonce, RIMs -------------------------------


def test_real_hopper_report_verifies_with_versions() -> None:
    verified = local.verify_gpu_report(
        HOPPER, arch="HOPPER", device_roots=[DEVICE_ROOT], expected_nonce=None, now=TODAY
    )
    assert verified.report.driver_version == "550.90.07"
    assert verified.report.vbios_version == "96.00.9F.00.01"
    assert len(verified.report.measurements) == 64
    assert verified.rim_ids() == (
        "NV_GPU_DRIVER_GH100_550.90.07",
        "NV_GPU_VBIOS_1010_0200_882_96009F0001",
    )


def test_real_hopper_measurements_match_the_matching_rims() -> None:
    verified = local.verify_gpu_report(
        HOPPER, arch="HOPPER", device_roots=[DEVICE_ROOT], expected_nonce=None, now=RIM_AT
    )
    driver = rim("NV_GPU_DRIVER_GH100_550.90.07.swidtag")
    vbios = rim("NV_GPU_VBIOS_1010_0200_882_96009F0001.swidtag")
    assert driver.version == "550.90.07"  # type: ignore[attr-defined]
    assert vbios.version == "96.00.9F.00.01"  # type: ignore[attr-defined]
    comparison = local.compare_measurements(verified.report, driver, vbios)  # type: ignore[arg-type]
    assert comparison.result == "match"
    golden = len(driver.measurements) + len(vbios.measurements)  # type: ignore[attr-defined]
    assert golden == 33


def test_real_hopper_measurements_mismatch_the_test_rims() -> None:
    verified = local.verify_gpu_report(
        HOPPER, arch="HOPPER", device_roots=[DEVICE_ROOT], expected_nonce=None, now=TEST_RIM_AT
    )
    driver = rim("Driver_RIM_test_no_gpu.swidtag", TEST_RIM_AT)
    vbios = rim("1010_0200_882_96005E0001_test_no_gpu.swidtag", TEST_RIM_AT)
    comparison = local.compare_measurements(verified.report, driver, vbios)  # type: ignore[arg-type]
    assert comparison.result == "mismatch"
    assert comparison.mismatched_indexes


def test_report_with_trailing_byte_parsed_from_structure() -> None:
    assert COCO.report[-1] == 0  # the real Trustee sample ends with one extra byte
    verified = local.verify_gpu_report(
        COCO, arch="HOPPER", device_roots=[DEVICE_ROOT], expected_nonce=None, now=TODAY
    )
    assert verified.report.driver_version == "580.95.05"


def test_report_nonce_checked() -> None:
    report = spdm.parse_report(HOPPER.report)
    local.verify_gpu_report(
        HOPPER,
        arch="HOPPER",
        device_roots=[DEVICE_ROOT],
        expected_nonce=report.request_nonce,
        now=TODAY,
    )
    with pytest.raises(AttestationError) as caught:
        local.verify_gpu_report(
            HOPPER, arch="HOPPER", device_roots=[DEVICE_ROOT], expected_nonce=bytes(32), now=TODAY
        )
    assert caught.value.code is ErrorCode.NONCE_MISMATCH


@pytest.mark.parametrize(
    "offset",
    [4, 40, 500, -100, -50],  # request nonce, a measurement, deeper record, opaque data, signature
)
def test_real_report_single_byte_mutations_rejected(offset: int) -> None:
    evidence = local.GpuEvidence(report=flip(HOPPER.report, offset), chain_pem=HOPPER.chain_pem)
    with pytest.raises(AttestationError) as caught:
        local.verify_gpu_report(
            evidence, arch="HOPPER", device_roots=[DEVICE_ROOT], expected_nonce=None, now=TODAY
        )
    assert caught.value.code in {ErrorCode.EVIDENCE_SIGNATURE_INVALID, ErrorCode.EVIDENCE_MALFORMED}


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_real_chain_single_byte_mutations_rejected(index: int) -> None:
    certs = x509.load_pem_x509_certificates(HOPPER.chain_pem)
    ders = [c.public_bytes(Encoding.DER) for c in certs]
    ders[index] = flip(ders[index], len(ders[index]) - 20)  # inside the signature
    pem = b"".join(
        b"-----BEGIN CERTIFICATE-----\n" + base64.encodebytes(d) + b"-----END CERTIFICATE-----\n"
        for d in ders
    )
    with pytest.raises(AttestationError):
        local.verify_gpu_report(
            local.GpuEvidence(report=HOPPER.report, chain_pem=pem),
            arch="HOPPER",
            device_roots=[DEVICE_ROOT],
            expected_nonce=None,
            now=TODAY,
        )


def test_chain_to_an_unpinned_root_rejected() -> None:
    with pytest.raises(AttestationError) as caught:
        local.verify_gpu_report(
            HOPPER, arch="HOPPER", device_roots=[RIM_ROOT], expected_nonce=None, now=TODAY
        )
    assert caught.value.code is ErrorCode.CERT_CHAIN_INVALID


def test_report_signed_by_another_gpu_rejected() -> None:
    swapped = local.GpuEvidence(report=HOPPER.report, chain_pem=COCO.chain_pem)
    with pytest.raises(AttestationError) as caught:
        local.verify_gpu_report(
            swapped, arch="HOPPER", device_roots=[DEVICE_ROOT], expected_nonce=None, now=TODAY
        )
    assert caught.value.code is ErrorCode.EVIDENCE_SIGNATURE_INVALID


def test_fwid_of_another_gpu_rejected() -> None:
    leaf = x509.load_pem_x509_certificates(COCO.chain_pem)[0]
    report = spdm.parse_report(HOPPER.report)
    with pytest.raises(AttestationError) as caught:
        local._check_fwid(leaf, report.fwid, "HOPPER")
    assert caught.value.code is ErrorCode.FWID_MISMATCH


def test_tampered_rim_rejected() -> None:
    data = (NV / "NV_GPU_DRIVER_GH100_550.90.07.swidtag").read_bytes()
    at = data.index(b'Hash0="') + 10
    with pytest.raises(AttestationError) as caught:
        verify_rim(
            data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :],
            roots=[RIM_ROOT],
            now=RIM_AT,
        )
    assert caught.value.code is ErrorCode.RIM_INVALID


def test_rim_with_expired_signer_rejected_today() -> None:
    with pytest.raises(AttestationError) as caught:
        rim("NV_GPU_DRIVER_GH100_550.90.07.swidtag", TODAY)
    assert caught.value.code is ErrorCode.CERT_CHAIN_INVALID


def test_rim_chained_to_another_root_rejected() -> None:
    with pytest.raises(AttestationError) as caught:
        verify_rim(
            (NV / "NV_GPU_DRIVER_GH100_550.90.07.swidtag").read_bytes(),
            roots=[DEVICE_ROOT],
            now=RIM_AT,
        )
    assert caught.value.code is ErrorCode.CERT_CHAIN_INVALID


@pytest.mark.parametrize(
    "evidence",
    [
        None,
        {},
        {"arch": "AMPERE", "evidence_list": []},
        {"arch": "HOPPER", "evidence_list": [{"evidence": "!!"}]},
    ],
)
def test_malformed_local_evidence_rejected(evidence: object) -> None:
    with pytest.raises(AttestationError) as caught:
        local.parse_local_evidence(evidence)
    assert caught.value.code is ErrorCode.EVIDENCE_MALFORMED


# --- Blackwell: no public signed sample exists; the simulated GPU uses the documented layout ---


@pytest.mark.parametrize("arch", ["HOPPER", "BLACKWELL"])
def test_simulated_gpu_verifies_for_each_architecture(arch: str) -> None:
    gpu = SimulatedGpu(TODAY, arch=arch)
    nonce = bytes(range(32))
    parsed_arch, (evidence,) = local.parse_local_evidence(gpu.evidence(nonce))
    verified = local.verify_gpu_report(
        evidence, arch=parsed_arch, device_roots=[gpu.root], expected_nonce=nonce, now=TODAY
    )
    driver_id, vbios_id = verified.rim_ids()
    expected_driver = {
        "HOPPER": "NV_GPU_DRIVER_GH100_550.90.07",
        "BLACKWELL": "NV_GPU_CC_DRIVER_GB100_550.90.07",
    }[arch]
    assert (driver_id, vbios_id) == (expected_driver, "NV_GPU_VBIOS_1010_0200_882_96009F0001")


def test_blackwell_fwid_must_be_inside_tcb_info() -> None:
    gpu = SimulatedGpu(TODAY, arch="BLACKWELL")
    # Hopper's rule (FWID ends the extension) does not hold for this certificate …
    with pytest.raises(AttestationError):
        local._check_fwid(gpu.chain[0], gpu.fwid, "HOPPER")
    local._check_fwid(gpu.chain[0], gpu.fwid, "BLACKWELL")  # … Blackwell's does
    with pytest.raises(AttestationError) as caught:
        local._check_fwid(gpu.chain[0], bytes(48), "BLACKWELL")
    assert caught.value.code is ErrorCode.FWID_MISMATCH
