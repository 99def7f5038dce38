"""An attestation result never outlives what it was made from (issue 19): the first ``exp`` of
any verified token, and for local GPU evidence the first certificate or OCSP answer to lapse."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from broker.attestation.gpu_pipeline import collateral_until
from broker.attestation.pipeline import VerifiedEvidence
from broker.decisions.attest import earliest_expiry
from tests.vectors.gpu import RimAuthority, SimulatedGpu

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def evidence(**raw: object) -> VerifiedEvidence:
    return VerifiedEvidence(tee={}, raw_claims=raw, identity={})  # type: ignore[arg-type]


def at(minutes: int) -> datetime:
    return NOW + timedelta(minutes=minutes)


def test_the_first_token_or_collateral_to_lapse_bounds_the_result() -> None:
    gca = {"exp": at(60).timestamp()}
    assert earliest_expiry(evidence(gca=gca)) == at(60)
    nras = {"overall": {"exp": at(30).timestamp()}, "gpus": {"GPU-0": {"exp": at(20).timestamp()}}}
    assert earliest_expiry(evidence(gca=gca, nras=nras)) == at(20)  # a per-GPU NRAS token
    local = {
        "gpus": [{"collateral_until": at(5).isoformat()}, {"collateral_until": at(9).isoformat()}]
    }
    assert earliest_expiry(evidence(gca=gca, nvidia=local)) == at(5)
    assert earliest_expiry(evidence()) is None


def test_collateral_is_the_first_certificate_or_ocsp_update_to_lapse() -> None:
    gpu, rims = SimulatedGpu(NOW), RimAuthority(NOW)
    chains = [gpu.chain, rims.chain]
    first_cert = min(c.not_valid_after_utc for chain in chains for c in chain)
    assert collateral_until(chains, [None, None]) == first_cert
    soon = NOW + timedelta(hours=1)
    assert soon < first_cert
    assert collateral_until(chains, [None, soon]) == soon  # an OCSP answer due for an update
