"""Intel Trust Authority tokens end to end: held-data binding, x5c-pinned keys, nvgpu claims."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClientError
from broker.core.binding import binding_digest
from tests.integration.conftest import RunningBroker
from tests.support.constants import GPU_KEY, KEY
from tests.vectors.gpu import SimulatedIta, pem

ITA_POLICY = """package broker.release

import rego.v1

default allow := false

allow if {
	input.tee.verifier == "ita"
	input.tee.technology == "tdx"
	input.tee.debug == false
	input.tee.measurements.mrtd in data.broker.mrtds
	every gpu in input.gpus {
		gpu.measurements == "match"
		gpu.debug == false
	}
}

reasons contains "not an allowed TD" if not allow
"""
GOOD_MRTD = "ab" * 48
NVGPU = {
    "x-nvidia-overall-att-result": True,
    "claim_details": {
        "GPU-0": {
            "hwmodel": "GH100",
            "dbgstat": "disabled",
            "secboot": True,
            "measres": "success",
            "x-nvidia-gpu-driver-version": "550.90.07",
        }
    },
}


class ItaTokens:
    evidence_kind = "ita"

    def __init__(self, ita: SimulatedIta, *, bind: bool = True, **token: Any) -> None:
        self.ita, self.bind, self.options = ita, bind, token

    async def token(self, audience: str, nonces: Sequence[str]) -> str:
        nonce, thumbprint = nonces
        held = binding_digest(nonce, thumbprint) if self.bind else b"\x00" * 32
        return self.ita.token(held, **self.options)


@pytest.fixture
async def ita_broker(start_broker: Any) -> tuple[RunningBroker, SimulatedIta]:
    ita = SimulatedIta(datetime.now(UTC))

    def setup(workdir: Path) -> None:
        (workdir / "ita_root.pem").write_bytes(pem([ita.root]))
        (workdir / "ita_jwks.json").write_text(json.dumps(ita.jwks()))
        (workdir / "policies" / "broker" / "release.rego").write_text(ITA_POLICY)
        data = json.loads((workdir / "policies" / "broker" / "data.json").read_text())
        data["mrtds"] = [GOOD_MRTD]
        (workdir / "policies" / "broker" / "data.json").write_text(json.dumps(data))

    extra = f"""
[[issuers]]
kind = "ita"
issuer = "{ita.issuer}"
jwks_file = "ita_jwks.json"
root_cert = "ita_root.pem"
tolerated_jku = ["https://portal.trustauthority.intel.com/certs"]
"""
    broker = await start_broker(extra_toml=extra, workdir_setup=setup)
    return broker, ita


async def test_ita_token_bound_through_held_data_releases(
    ita_broker: tuple[RunningBroker, SimulatedIta],
) -> None:
    broker, ita = ita_broker
    async with broker.client() as client:
        released = await client.release(KEY, ItaTokens(ita))
    assert len(released.dek) == 32
    record = broker.records()[-1]
    assert record["identity"]["mrtd"] == GOOD_MRTD


async def test_ita_token_with_other_held_data_rejected(
    ita_broker: tuple[RunningBroker, SimulatedIta],
) -> None:
    broker, ita = ita_broker
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, ItaTokens(ita, bind=False))
    assert (caught.value.status, caught.value.code) == (401, "key_binding_mismatch")


async def test_ita_debug_td_denied(ita_broker: tuple[RunningBroker, SimulatedIta]) -> None:
    broker, ita = ita_broker
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, ItaTokens(ita, debug=True))
    assert caught.value.code == "policy_denied"


async def test_ita_nvgpu_claims_become_gpu_entries(
    ita_broker: tuple[RunningBroker, SimulatedIta],
) -> None:
    broker, ita = ita_broker
    async with broker.client() as client:
        await client.release(GPU_KEY, ItaTokens(ita, nvgpu=NVGPU))
        failing = json.loads(json.dumps(NVGPU))
        failing["claim_details"]["GPU-0"]["measres"] = "fail"
        with pytest.raises(BrokerClientError) as caught:
            await client.release(GPU_KEY, ItaTokens(ita, nvgpu=failing))
    assert caught.value.code == "policy_denied"


async def test_ita_key_from_an_untrusted_root_rejected(
    start_broker: Any, ita_broker: tuple[RunningBroker, SimulatedIta]
) -> None:
    broker, _ = ita_broker
    stranger = SimulatedIta(datetime.now(UTC), issuer=broker.settings.issuers[1].issuer)
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, ItaTokens(stranger))
    assert caught.value.code in {"token_key_unknown", "cert_chain_invalid"}
