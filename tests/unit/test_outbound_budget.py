"""Outbound lookups per request are bounded and asked once each (issue 27, item 4)."""

from __future__ import annotations

from datetime import UTC, datetime

from broker.attestation.service import MAX_OUTBOUND_PER_REQUEST, OutboundBudget, distinct_pairs
from tests.vectors.gpu import RimAuthority, SimulatedGpu

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def test_a_request_never_takes_more_than_its_budget() -> None:
    budget = OutboundBudget(MAX_OUTBOUND_PER_REQUEST)
    assert budget.take_up_to(1000) == MAX_OUTBOUND_PER_REQUEST
    assert not budget.take(1)
    assert budget.take_up_to(5) == 0


def test_a_budget_takes_all_or_nothing_for_one_lookup_set() -> None:
    budget = OutboundBudget(3)
    assert not budget.take(4)
    assert budget.take(3)
    assert budget.left == 0


def test_every_certificate_is_asked_about_once_per_request() -> None:
    """Eight reports of GPUs that share their upper chain, and two RIMs that share a signer:
    each (certificate, issuer) pair once."""
    gpu, authority = SimulatedGpu(NOW), RimAuthority(NOW)
    device = [(tuple(gpu.chain), False)] * 8
    rims = [(tuple(authority.chain), True)] * 2
    pairs = distinct_pairs([*device, *rims])
    assert len(pairs) == 3 + 3  # below each root: BROM, ICA, Identity; signer, L3, CA
    assert MAX_OUTBOUND_PER_REQUEST >= 2 + 9 + 10 + 27  # a genuine 8-GPU request fits
