"""Real Confidential Space PKI and Intel Trust Authority tokens (tests/fixtures/real)."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509

from broker.attestation.claims import gca_tee, ita_gpu_entries, ita_tee
from broker.attestation.gca import GcaTrust, verify_gca_token
from broker.attestation.ita import (
    ItaTrust,
    VerifiedItaToken,
    check_gpu_nonce,
    check_ita_binding,
    check_report_data,
    verify_ita_token,
)
from broker.core import binding
from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.jwks import parse_jwks

REAL = Path(__file__).parents[1] / "fixtures" / "real"
GOOGLE = "https://confidentialcomputing.googleapis.com"
CS_ROOT = x509.load_pem_x509_certificate(
    (REAL / "gca" / "google_confidential_space_root.crt").read_bytes()
)
PKI_TOKEN = (REAL / "gca" / "cs_pki_token_tdx_2025-04.jwt").read_text().strip()
PKI_AT = datetime(2025, 4, 23, 16, 27, 20, tzinfo=UTC)
PKI = GcaTrust(issuer=GOOGLE, algorithms=("RS256",), roots=[CS_ROOT])
ITA_ROOT = x509.load_pem_x509_certificate(
    (REAL / "ita" / "intel_trust_authority_root_ca.pem").read_bytes()
)
ITA_KEYS = parse_jwks((REAL / "ita" / "ita_certs_jwks_2023-09.json").read_bytes())
ITA_TOKEN = (REAL / "ita" / "ita_tdx_token_2023-12.jwt").read_text().strip()
ITA_AT = datetime(2023, 12, 5, 0, 10, tzinfo=UTC)
ITA = ItaTrust(
    issuer="Intel Trust Authority", algorithms=("PS384", "RS256"), keys=ITA_KEYS, roots=[ITA_ROOT]
)
TODAY = datetime(2026, 11, 30, tzinfo=UTC)


def claims_of(token: str) -> dict[str, object]:
    return json.loads(b64url_decode(token.split(".")[1]))  # type: ignore[no-any-return]


def mutate(token: str, part: int, *, x5c_index: int | None = None) -> str:
    pieces = token.split(".")
    if x5c_index is not None:
        header = json.loads(b64url_decode(pieces[0]))
        der = bytearray(base64.b64decode(header["x5c"][x5c_index]))
        der[len(der) // 2] ^= 0x01
        header["x5c"][x5c_index] = base64.b64encode(bytes(der)).decode()
        pieces[0] = b64url_encode(json.dumps(header).encode())
    else:
        raw = bytearray(b64url_decode(pieces[part]))
        raw[len(raw) // 2] ^= 0x01
        pieces[part] = b64url_encode(bytes(raw))
    return ".".join(pieces)


def test_real_pki_token_verifies_at_issue_time() -> None:
    audience = str(claims_of(PKI_TOKEN)["aud"])
    verified = verify_gca_token(PKI_TOKEN, trust=PKI, audience=audience, now=PKI_AT)
    assert verified.token_type == "pki"
    assert verified.kid == "cCJ0JjV9pk-tKt9M5bu-b8s42vVsD3Od75bLL_9JEsw"
    tee = gca_tee(verified)
    assert (tee["technology"], tee["debug"]) == ("tdx", True)
    assert tee["software"]["version"] == "250301"


def test_real_pki_token_rejected_today() -> None:
    with pytest.raises(AttestationError) as caught:
        verify_gca_token(PKI_TOKEN, trust=PKI, audience="https://sts.google.com", now=TODAY)
    # The leaf certificate (60 days) has expired as well as the token.
    assert caught.value.code in {ErrorCode.CERT_CHAIN_INVALID, ErrorCode.TOKEN_EXPIRED}


@pytest.mark.parametrize(("part", "x5c_index"), [(2, None), (1, None), (0, 0), (0, 1), (0, 2)])
def test_real_pki_token_single_byte_mutations_rejected(part: int, x5c_index: int | None) -> None:
    with pytest.raises(AttestationError):
        verify_gca_token(
            mutate(PKI_TOKEN, part, x5c_index=x5c_index),
            trust=PKI,
            audience="https://sts.google.com",
            now=PKI_AT,
        )


def test_pki_token_chained_to_another_root_rejected() -> None:
    with pytest.raises(AttestationError) as caught:
        verify_gca_token(
            PKI_TOKEN,
            trust=GcaTrust(issuer=GOOGLE, algorithms=("RS256",), roots=[ITA_ROOT]),
            audience="https://sts.google.com",
            now=PKI_AT,
        )
    assert caught.value.code is ErrorCode.CERT_CHAIN_INVALID


def test_pki_token_with_rewritten_kid_rejected() -> None:
    header, payload, signature = PKI_TOKEN.split(".")
    fields = json.loads(b64url_decode(header))
    fields["kid"] = "another-kid"
    forged = f"{b64url_encode(json.dumps(fields).encode())}.{payload}.{signature}"
    with pytest.raises(AttestationError) as caught:
        verify_gca_token(forged, trust=PKI, audience="https://sts.google.com", now=PKI_AT)
    assert caught.value.code is ErrorCode.KID_MISMATCH


def test_real_ita_token_verifies_at_issue_time() -> None:
    verified = verify_ita_token(ITA_TOKEN, trust=ITA, audience="https://broker.example", now=ITA_AT)
    tee = ita_tee(verified)
    assert tee["verifier"] == "ita"
    assert tee["technology"] == "tdx"
    assert tee["debug"] is False
    assert tee["tcb_status"] == "OutOfDate"
    assert tee["measurements"]["mrtd"].startswith("5f53c3881242a5b4")
    assert tee["measurements"]["mrseam"].startswith("2fd279c16164a93d")
    assert tee["advisory_ids"] == ["INTEL-SA-00837"]


def test_real_ita_report_data_binds_its_held_data() -> None:
    claims = claims_of(ITA_TOKEN)
    held = base64.b64decode(str(claims["attester_held_data"]))
    check_report_data(claims, held)  # Intel's REPORTDATA formula holds on the real token
    with pytest.raises(AttestationError) as caught:
        check_report_data(claims, held + b"x")
    assert caught.value.code is ErrorCode.KEY_BINDING_MISMATCH


def test_real_ita_token_is_not_bound_to_our_nonce() -> None:
    with pytest.raises(AttestationError) as caught:
        check_ita_binding(claims_of(ITA_TOKEN), nonce="n" * 43, thumbprint="t" * 43)
    assert caught.value.code is ErrorCode.KEY_BINDING_MISMATCH


def test_real_ita_token_rejected_today() -> None:
    with pytest.raises(AttestationError) as caught:
        verify_ita_token(ITA_TOKEN, trust=ITA, audience="a", now=TODAY)
    assert caught.value.code in {ErrorCode.CERT_CHAIN_INVALID, ErrorCode.TOKEN_EXPIRED}


@pytest.mark.parametrize("part", [0, 1, 2])
def test_real_ita_token_single_byte_mutations_rejected(part: int) -> None:
    with pytest.raises(AttestationError):
        verify_ita_token(mutate(ITA_TOKEN, part), trust=ITA, audience="a", now=ITA_AT)


def test_ita_key_with_tampered_certificate_rejected() -> None:
    document = json.loads((REAL / "ita" / "ita_certs_jwks_2023-09.json").read_text())
    for key in document["keys"]:
        der = bytearray(base64.b64decode(key["x5c"][1]))
        der[len(der) // 2] ^= 0x01
        key["x5c"][1] = base64.b64encode(bytes(der)).decode()
    keys = parse_jwks(json.dumps(document).encode())
    trust = ItaTrust(
        issuer="Intel Trust Authority", algorithms=("PS384",), keys=keys, roots=[ITA_ROOT]
    )
    with pytest.raises(AttestationError) as caught:
        verify_ita_token(ITA_TOKEN, trust=trust, audience="a", now=ITA_AT)
    assert caught.value.code is ErrorCode.CERT_CHAIN_INVALID


def test_ita_key_not_chaining_to_pinned_root_rejected() -> None:
    trust = ItaTrust(
        issuer="Intel Trust Authority", algorithms=("PS384",), keys=ITA_KEYS, roots=[CS_ROOT]
    )
    with pytest.raises(AttestationError) as caught:
        verify_ita_token(ITA_TOKEN, trust=trust, audience="a", now=ITA_AT)
    assert caught.value.code is ErrorCode.CERT_CHAIN_INVALID


def test_ita_jku_other_than_configured_rejected() -> None:
    trust = ItaTrust(
        issuer="Intel Trust Authority",
        algorithms=("PS384",),
        keys=ITA_KEYS,
        roots=[ITA_ROOT],
        tolerated_jku=("https://elsewhere.invalid/certs",),
    )
    with pytest.raises(AttestationError) as caught:
        verify_ita_token(ITA_TOKEN, trust=trust, audience="a", now=ITA_AT)
    assert caught.value.code is ErrorCode.TOKEN_HEADER_FORBIDDEN


def test_ita_binding_accepts_the_documented_encoding() -> None:
    nonce, thumbprint = "N" * 43, "T" * 43
    held = binding.binding_digest(nonce, thumbprint)
    val, iat = b"verifier-nonce", b"2026-11-30"
    claims = {
        "attester_held_data": base64.b64encode(held).decode(),
        "verifier_nonce": {
            "val": base64.b64encode(val).decode(),
            "iat": base64.b64encode(iat).decode(),
        },
        "tdx_report_data": hashlib.sha512(val + iat + held).hexdigest(),
    }
    check_ita_binding(claims, nonce=nonce, thumbprint=thumbprint)
    with pytest.raises(AttestationError):
        check_ita_binding(claims, nonce=nonce, thumbprint="U" * 43)


def test_ita_via_confidential_space_claim_shape_normalises() -> None:
    # Signature not checkable offline (key set not archived): claim shape only.
    token = (REAL / "ita" / "ita_token_via_confidential_space_tdx_2025-10.jwt").read_text().strip()
    tee = ita_tee(
        VerifiedItaToken(
            issuer="https://portal.trustauthority.intel.com", kid="k", claims=claims_of(token)
        )
    )
    assert tee["verifier"] == "ita"
    assert tee["technology"] == "tdx"
    assert tee["debug"] is False
    assert tee["tcb_status"] == "OutOfDate"
    assert tee["software"]["support"] == ["EXPERIMENTAL"]
    assert tee["workload"]["image_digest"].startswith("sha256:18930d05")


def test_ita_issue_time_plus_token_lifetime_is_the_edge() -> None:
    end = datetime.fromtimestamp(int(str(claims_of(ITA_TOKEN)["exp"])), tz=UTC)
    verify_ita_token(ITA_TOKEN, trust=ITA, audience="a", now=end + timedelta(seconds=29))
    with pytest.raises(AttestationError):
        verify_ita_token(ITA_TOKEN, trust=ITA, audience="a", now=end + timedelta(seconds=31))


def test_ita_nvgpu_2024_shape_normalises() -> None:
    nvgpu = {
        "sub": "NVIDIA-GPU-ATTESTATION",
        "hwmodel": "GH100 A01 GSP BROM",
        "dbgstat": "disabled",
        "secboot": True,
        "x-nvidia-gpu-driver-version": "550.90.07",
        "x-nvidia-attestation-detailed-result": {
            "x-nvidia-gpu-measurements-match": True,
            "x-nvidia-gpu-attestation-report-cert-chain-validated": True,
        },
    }
    (gpu,) = ita_gpu_entries({"nvgpu": nvgpu}, cc_mode="unknown")
    assert (gpu["verifier"], gpu["arch"], gpu["measurements"], gpu["debug"]) == (
        "ita",
        "HOPPER",
        "match",
        False,
    )
    nvgpu["x-nvidia-attestation-detailed-result"]["x-nvidia-gpu-measurements-match"] = False  # type: ignore[index]
    (failing,) = ita_gpu_entries({"nvgpu": nvgpu}, cc_mode="unknown")
    assert failing["measurements"] == "mismatch"


def test_ita_overall_result_false_means_mismatch() -> None:
    nvgpu = {
        "x-nvidia-overall-att-result": False,
        "claim_details": {"GPU-0": {"measres": "success", "dbgstat": "disabled"}},
    }
    (gpu,) = ita_gpu_entries({"nvgpu": nvgpu}, cc_mode="unknown")
    assert gpu["measurements"] == "mismatch"


def test_ita_gpu_results_not_stated_are_absent_not_success() -> None:
    """A token that omits the chain and overall results must not read as a valid chain."""
    nvgpu = {"claim_details": {"GPU-0": {"measres": "success", "dbgstat": "disabled"}}}
    (gpu,) = ita_gpu_entries({"nvgpu": nvgpu}, cc_mode="on")
    assert "cert_chain" not in gpu
    assert "overall_result" not in gpu
    nvgpu["x-nvidia-overall-att-result"] = True  # type: ignore[assignment]
    nvgpu["claim_details"]["GPU-0"]["x-nvidia-gpu-attestation-report-cert-chain-validated"] = (
        "true"  # a string is not the boolean true
    )
    (gpu,) = ita_gpu_entries({"nvgpu": nvgpu}, cc_mode="on")
    assert (gpu["cert_chain"], gpu["overall_result"]) == ("invalid", True)


def test_ita_gpu_result_from_another_appraisal_rejected() -> None:
    claims = {"verifier_nonce": {"val": "dmFs", "iat": "aWF0"}, "nvgpu": {"eat_nonce": "00" * 32}}
    with pytest.raises(AttestationError) as caught:
        check_gpu_nonce(claims)
    assert caught.value.code is ErrorCode.NONCE_MISMATCH
    claims["nvgpu"] = {"eat_nonce": hashlib.sha256(b"val" + b"iat").hexdigest()}
    check_gpu_nonce(claims)
