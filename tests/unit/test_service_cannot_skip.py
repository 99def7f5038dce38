"""The service path verifies evidence in full: what the offline CLI may skip (no nonce, no runner
key, no audience) fails a service request closed instead of passing unchecked."""

from __future__ import annotations

import pytest

from broker.attestation.pipeline import Trust, VerifiedEvidence
from broker.attestation.service import EvidenceVerifier, require_complete
from broker.core.errors import BrokerError


def evidence(skipped: tuple[str, ...]) -> VerifiedEvidence:
    return VerifiedEvidence(tee={}, raw_claims={}, identity={}, gpus=(), skipped=skipped)


@pytest.mark.parametrize(
    "skipped", [("nonce",), ("audience",), ("runner key binding", "gpu nonce")]
)
def test_a_skipped_check_fails_the_service_closed(skipped: tuple[str, ...]) -> None:
    with pytest.raises(BrokerError) as caught:
        require_complete(evidence(skipped))
    assert caught.value.status == 500
    assert all(name in caught.value.message for name in skipped)


def test_complete_evidence_passes_through() -> None:
    verified = evidence(())
    assert require_complete(verified) is verified


def test_the_service_refuses_a_trust_without_an_audience() -> None:
    with pytest.raises(ValueError, match="audience"):
        EvidenceVerifier(Trust(issuers={}, audience=None), key_sources={})
