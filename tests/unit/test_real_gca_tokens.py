"""Real Confidential Space tokens (tests/fixtures/real/gca, see PROVENANCE.md)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from broker.attestation.claims import gca_tee
from broker.attestation.gca import GcaTrust, VerifiedGcaToken, verify_gca_token
from broker.core import binding
from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.jwks import parse_jwks

REAL = Path(__file__).parents[1] / "fixtures" / "real" / "gca"
SAMPLES = json.loads((REAL / "cs_oidc_samples_2025-12-02.json").read_text())
JWKS = parse_jwks((REAL / "google_cs_jwks_2025-12-02.json").read_bytes())
GOOGLE = "https://confidentialcomputing.googleapis.com"
TODAY = datetime(2026, 11, 30, tzinfo=UTC)
OIDC = GcaTrust(issuer=GOOGLE, algorithms=("RS256",), keys=JWKS)


def at_issue(sample: dict[str, object]) -> datetime:
    return datetime.fromtimestamp(int(str(sample["captured_at"])), tz=UTC) + timedelta(seconds=5)


def verify(sample: dict[str, object], now: datetime) -> VerifiedGcaToken:
    return verify_gca_token(
        str(sample["raw_token"]), trust=OIDC, audience=str(sample["audience"]), now=now
    )


@pytest.mark.parametrize("index", [0, 1])
def test_real_oidc_token_verifies_at_issue_time(index: int) -> None:
    sample = SAMPLES["samples"][index]
    verified = verify(sample, at_issue(sample))
    assert verified.kid == "d6d5071ab75246a42acfa46d29316311cdab51f7"
    tee = gca_tee(verified)
    assert tee["technology"] == "sev"
    assert tee["hwmodel"] == "GCP_AMD_SEV"
    assert tee["debug"] is True  # dbgstat "enabled": a debug image
    assert tee["secure_boot"] is True
    assert tee["software"] == {"name": "CONFIDENTIAL_SPACE", "version": "251001", "support": []}
    assert tee["workload"]["image_digest"] == (
        "sha256:57c5946e1067c9c019d82554416a2fa98438858f5ab8033a2575abfdcd24fb32"
    )
    assert tee["platform"]["project_id"] == "synd-db-testing"
    assert tee["platform"]["instance_id"] == "6549194765718711860"


@pytest.mark.parametrize("index", [0, 1])
def test_real_oidc_token_rejected_as_expired_today(index: int) -> None:
    with pytest.raises(AttestationError) as caught:
        verify(SAMPLES["samples"][index], TODAY)
    assert caught.value.code is ErrorCode.TOKEN_EXPIRED


def test_real_token_rejected_for_another_audience() -> None:
    sample = dict(SAMPLES["samples"][0], audience="https://broker.example")
    with pytest.raises(AttestationError) as caught:
        verify(sample, at_issue(sample))
    assert caught.value.code is ErrorCode.AUDIENCE_MISMATCH


def test_real_token_with_single_string_nonce_has_no_key_binding() -> None:
    sample = SAMPLES["samples"][1]
    verified = verify(sample, at_issue(sample))
    assert verified.claims["eat_nonce"] == "sp1-test-nonce-1764708636"
    binding.eat_nonce_values(verified.claims["eat_nonce"])  # a plain string is accepted
    with pytest.raises(AttestationError) as caught:
        binding.check_eat_nonce(
            verified.claims["eat_nonce"], nonce="sp1-test-nonce-1764708636", thumbprint="t" * 43
        )
    assert caught.value.code is ErrorCode.KEY_BINDING_MISMATCH


def test_real_token_without_nonce_is_a_bearer_token_and_refused() -> None:
    sample = SAMPLES["samples"][0]
    verified = verify(sample, at_issue(sample))
    with pytest.raises(AttestationError) as caught:
        binding.check_eat_nonce(verified.claims.get("eat_nonce"), nonce="n" * 43, thumbprint="t")
    assert caught.value.code is ErrorCode.NONCE_MISSING


@pytest.mark.parametrize("part", [0, 1, 2])
def test_real_token_single_byte_mutation_rejected(part: int) -> None:
    sample = SAMPLES["samples"][0]
    pieces = str(sample["raw_token"]).split(".")
    raw = bytearray(b64url_decode(pieces[part]))
    raw[len(raw) // 2] ^= 0x01
    pieces[part] = b64url_encode(bytes(raw))
    with pytest.raises(AttestationError):
        verify(dict(sample, raw_token=".".join(pieces)), at_issue(sample))


def test_rotated_key_token_rejected_as_unknown_kid() -> None:
    token = (REAL / "cs_oidc_token_tdx_2025-02.jwt").read_text().strip()
    with pytest.raises(AttestationError) as caught:
        verify_gca_token(
            token,
            trust=OIDC,
            audience="https://sts.google.com",
            now=datetime(2025, 2, 10, 10, 15, tzinfo=UTC),
        )
    assert caught.value.code is ErrorCode.TOKEN_KEY_UNKNOWN


def test_tdx_claim_shape_normalises() -> None:
    # Signature not checkable offline (key rotated away): claim shape only.
    token = (REAL / "cs_oidc_token_tdx_2025-02.jwt").read_text().strip()
    claims = json.loads(b64url_decode(token.split(".")[1]))
    tee = gca_tee(VerifiedGcaToken(issuer=GOOGLE, kid="k", claims=claims))
    assert tee["technology"] == "tdx"
    assert tee["debug"] is True
    assert tee["software"]["support"] == []
    assert tee["workload"]["image_digest"].startswith("sha256:091c5534")


def test_pki_token_refused_by_oidc_issuer_entry() -> None:
    token = (REAL / "cs_pki_token_tdx_2025-04.jwt").read_text().strip()
    with pytest.raises(AttestationError) as caught:
        verify_gca_token(
            token,
            trust=OIDC,
            audience="x",
            now=datetime(2025, 4, 23, tzinfo=UTC),
        )
    assert caught.value.code is ErrorCode.TOKEN_HEADER_FORBIDDEN


def test_real_token_workload_fields_reach_the_policy_input() -> None:
    from broker.attestation.claims import gca_tee  # noqa: PLC0415

    sample = SAMPLES["samples"][0]
    tee = gca_tee(verify(sample, at_issue(sample)))
    workload, platform = tee["workload"], tee["platform"]
    assert workload["args"] == ["/app/cs-attestation-sample"]
    assert workload["env"]["HOSTNAME"] == "cs-attestation-vm"
    assert workload["env_override"] == {
        "ATTESTATION_AUDIENCE": "https://synddb-sequencer.example.com",
        "OUTPUT_BUCKET": "synd-db-testing-cs-attestation-samples",
    }
    assert workload["restart_policy"] == "Never"
    assert workload["signatures"] == []  # this image was not cosign-signed
    assert (platform["project_id"], platform["zone"]) == ("synd-db-testing", "us-central1-a")
    assert tee["debug"] is True  # a debug Confidential Space image ...
    assert tee["software"]["support"] == []  # ... carries no support attributes


def test_cosign_signatures_are_normalised_without_their_bytes() -> None:
    from broker.attestation.claims import gca_tee  # noqa: PLC0415

    signatures = [
        {"key_id": "projects/p/locations/global/keyRings/r/cryptoKeys/k/cryptoKeyVersions/1",
         "signature": "MEUCIQ…", "signature_algorithm": "ECDSA_P256_SHA256"},
        {"key_id": 7, "signature_algorithm": None},
        "not an object",
    ]  # fmt: skip
    token = VerifiedGcaToken(
        "https://confidentialcomputing.googleapis.com",
        "kid",
        {"submods": {"container": {"image_signatures": signatures}}},
    )
    assert gca_tee(token)["workload"]["signatures"] == [
        {
            "key_id": "projects/p/locations/global/keyRings/r/cryptoKeys/k/cryptoKeyVersions/1",
            "algorithm": "ECDSA_P256_SHA256",
        },
        {"key_id": "", "algorithm": ""},
    ]
