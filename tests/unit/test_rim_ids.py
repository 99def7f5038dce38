"""RIM ids of a known form only (issue 27, item 4): an id is read from a GPU report, and the
broker asks NVIDIA's RIM service only for ids of the forms that service names RIMs by."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.attestation.nvidia import local
from broker.attestation.nvidia.rim import is_known_rim_id
from broker.attestation.nvidia.sources import CachingRimSource, RimUnavailable

NV = Path(__file__).parents[1] / "fixtures" / "real" / "nvidia"
REAL_REPORTS = [
    ("hopperAttestationReport.txt", "hopperCertChain.txt"),
    ("hopper_coco_report1.txt", "hopper_coco_certs1.txt"),
]


@pytest.mark.parametrize(("report", "chain"), REAL_REPORTS)
def test_real_reports_name_rims_of_a_known_form(report: str, chain: str) -> None:
    evidence = local.GpuEvidence(
        report=bytes.fromhex((NV / report).read_text().strip()), chain_pem=(NV / chain).read_bytes()
    )
    driver, vbios = local.parse_unverified(evidence).rim_ids()
    assert is_known_rim_id(driver), driver
    assert is_known_rim_id(vbios), vbios


@pytest.mark.parametrize(
    "rim_id",
    [
        "NV_GPU_DRIVER_GH100_550.90.07",  # real RIM files in fixtures/real/nvidia
        "NV_GPU_VBIOS_1010_0200_882_96009F0001",
        "NV_GPU_DRIVER_GH100_595.71.05",  # the NRAS sample of 2026-09
        "NV_GPU_VBIOS_1010_0210_886_96009F0004",
        "NV_GPU_CC_DRIVER_GB100_570.124.06",  # Blackwell's form
    ],
)
def test_known_forms_accepted(rim_id: str) -> None:
    assert is_known_rim_id(rim_id)


@pytest.mark.parametrize(
    "rim_id",
    [
        "",
        "../../v1/admin",
        "NV_GPU_DRIVER_GH100_550.90.07/../../x",
        "NV_GPU_DRIVER_GH100_550.90.07\n",
        "NV_GPU_DRIVER_GH100_x" * 10,
        "NV_GPU_DRIVER_GH100_550.90.07?a=b",
        "NV_GPU_VBIOS_1010_0200_882_96009f0001",  # lower-case version
        "NV_GPU_VBIOS_1010_0200_882_96009F00010",  # one digit too many
        "NV_GPU_CC_DRIVER_ATTACKER_550.90.07",
        "nv_gpu_driver_gh100_550.90.07",
    ],
)
async def test_an_attacker_chosen_rim_id_is_never_fetched(rim_id: str) -> None:
    assert not is_known_rim_id(rim_id)
    source = CachingRimSource(
        directory=None,
        url="http://127.0.0.1:9/never-asked",  # nothing listens: a request would fail otherwise
        session=None,
        cache_seconds=60,
        timeout_seconds=1,
        on_request=lambda: pytest.fail("an outbound request was made"),
    )
    with pytest.raises(RimUnavailable, match="not of a form"):
        await source.get(rim_id)
