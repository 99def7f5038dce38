"""The development-only ``sample`` verifier reads guest-components' sample quote exactly: two
members, standard base64 report data of at most 64 bytes, padded as hardware holds it."""

from __future__ import annotations

import asyncio
import base64
from datetime import UTC, datetime
from typing import Any

import pytest

from broker.attestation.claims import ita_tee
from broker.attestation.ita import VerifiedItaToken
from broker.attestation.raw.sample import SampleVerifier
from broker.core.errors import AttestationError, ErrorCode

NOW = datetime(2026, 12, 7, tzinfo=UTC)


def test_the_sample_quote_verifies_to_padded_report_data() -> None:
    digest = bytes(range(48))
    verified = asyncio.run(
        SampleVerifier().verify(
            {"svn": "1", "report_data": base64.b64encode(digest).decode()}, now=NOW
        )
    )
    assert verified.report_data == digest + bytes(16)
    assert (verified.technology, verified.tee["verifier"], verified.tee["measurements"]) == (
        "sample",
        "local",
        {"svn": "1"},
    )
    # the token verifiers' shape, every section there with empty values (a rule on a
    # Confidential Space field reads "" or [], never a missing field)
    token = ita_tee(VerifiedItaToken(issuer="i", kid="k", claims={}))
    assert set(token) <= set(verified.tee)
    for section in ("software", "workload", "platform"):
        assert set(token[section]) == set(verified.tee[section])
    assert verified.tee["platform"]["project_id"] == ""
    assert verified.tee["workload"]["image_digest"] == ""
    assert (verified.tee["tcb_status"], verified.tee["advisory_ids"]) == ("", [])


@pytest.mark.parametrize(
    "evidence",
    [
        {"svn": "1"},
        {"svn": "1", "report_data": "AA==", "extra": 1},
        {"svn": 1, "report_data": "AA=="},
        {"svn": "\x00", "report_data": "AA=="},
        {"svn": "1", "report_data": "not base64!"},
        {"svn": "1", "report_data": base64.b64encode(bytes(65)).decode()},
        {"svn": "1", "report_data": ["AA=="]},
    ],
)
def test_a_malformed_sample_quote_is_refused(evidence: dict[str, Any]) -> None:
    with pytest.raises(AttestationError) as caught:
        asyncio.run(SampleVerifier().verify(evidence, now=NOW))
    assert caught.value.code is ErrorCode.EVIDENCE_MALFORMED
