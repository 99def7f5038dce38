"""The KBS branch's policy data is held to its shape (``policy/kbs_data.py``, one of the structure
rules): a ``kbs_guests`` reference without measurements would match every guest of its
technology, a typo (``measurement``) silently the same, a TCB minimum missing an SPL would not
judge it. Each is refused naming the member; the shipped data passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.policy.kbs_data import check_kbs_data
from broker.policy.wasm import PolicyLoadError

SHIPPED = json.loads(
    (Path(__file__).parents[2] / "policies" / "broker" / "data.json").read_text(encoding="utf-8")
)
TDX = {"technology": "tdx", "measurements": {"mrtd": "aa", "mrconfigid": "cc"}}
MILAN = {"bootloader": 4, "tee": 0, "snp": 22, "microcode": 219}


def _refused(broker: dict[str, Any]) -> str:
    with pytest.raises(PolicyLoadError) as caught:
        check_kbs_data("broker/data.json", broker)
    return caught.value.message


def test_the_shipped_data_and_full_references_pass() -> None:
    check_kbs_data("broker/data.json", SHIPPED)
    assert SHIPPED["kbs_tcb_statuses"] == ["UpToDate"]  # the shipped defaults are strict
    assert set(SHIPPED["kbs_snp_min_tcb"]) == {"Milan"}  # other products: set them, else denied
    full = {
        **TDX,
        "tcb_statuses": ["UpToDate", "SWHardeningNeeded"],
        "snp_min_tcb": {**MILAN, "fmc": 1},
    }
    check_kbs_data("d", {"kbs_guests": {"models/llama": [TDX, full]}})
    check_kbs_data("d", {"kbs_snp_min_tcb": {"Turin": {**MILAN, "fmc": 1}, "Genoa": MILAN}})
    check_kbs_data("d", {})  # nothing to check: no KBS guest gets anything


@pytest.mark.parametrize(
    ("reference", "says"),
    [
        ({"technology": "tdx"}, "needs measurements, a non-empty object"),
        ({"technology": "tdx", "measurements": {}}, "needs measurements"),
        ({"technology": "tdx", "measurements": []}, "needs measurements"),
        ({"technology": "tdx", "measurement": {"mrtd": "aa"}}, "unknown members ['measurement']"),
        ({**TDX, "tcb_status": ["UpToDate"]}, "unknown members ['tcb_status']"),
        ({"measurements": {"mrtd": "aa"}}, "needs a technology"),
        ("tdx", "is an object"),
        ({**TDX, "tcb_statuses": []}, "tcb_statuses is a non-empty list"),
        ({**TDX, "tcb_statuses": ["UptoDate"]}, "tcb_statuses is a non-empty list"),
        ({**TDX, "snp_min_tcb": {"bootloader": 4}}, "snp_min_tcb names"),
        ({**TDX, "snp_min_tcb": {**MILAN, "micrcode": 1}}, "snp_min_tcb names"),
        ({**TDX, "snp_min_tcb": {**MILAN, "snp": "22"}}, "snp_min_tcb.snp is an integer"),
        ({**TDX, "snp_min_tcb": {**MILAN, "snp": True}}, "snp_min_tcb.snp is an integer"),
        ({**TDX, "snp_min_tcb": {**MILAN, "snp": 256}}, "snp_min_tcb.snp is an integer"),
    ],
)
def test_malformed_reference_refused(reference: Any, says: str) -> None:
    message = _refused({"kbs_guests": {"models/llama": [TDX, reference]}})
    assert "data.broker.kbs_guests['models/llama'][1]" in message
    assert says in message


@pytest.mark.parametrize(
    ("broker", "says"),
    [
        ({"kbs_guests": []}, "kbs_guests is an object"),
        ({"kbs_guests": {"models/llama": []}}, "is a non-empty list of references"),
        ({"kbs_guests": {"models/llama": TDX}}, "is a non-empty list of references"),
        ({"kbs_tcb_statuses": "UpToDate"}, "kbs_tcb_statuses is a non-empty list"),
        ({"kbs_tcb_statuses": []}, "kbs_tcb_statuses is a non-empty list"),
        ({"kbs_snp_min_tcb": {"Rome": MILAN}}, "names none of"),
        ({"kbs_snp_min_tcb": {"Turin": MILAN}}, "fmc"),  # Turin's FMC is required
        ({"kbs_snp_min_tcb": {"Milan": {}}}, "kbs_snp_min_tcb['Milan'] names"),
        ({"kbs_snp_min_tcb": []}, "kbs_snp_min_tcb is an object"),
    ],
)
def test_malformed_defaults_refused(broker: dict[str, Any], says: str) -> None:
    assert says in _refused(broker)
