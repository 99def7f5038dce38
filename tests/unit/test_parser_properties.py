"""Property tests: every parser of attacker-controlled input takes *anything* and returns its
verified object or raises its module's error type — never another exception (which would be a
500, a lost decision record, or worse). Deterministic (derandomised) so CI is stable; run with
``--hypothesis-seed`` and a higher ``max_examples`` locally to search further."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.attestation import gca, pipeline
from broker.attestation.issuers import IssuerSettings
from broker.attestation.nvidia import local, nras, rim, spdm
from broker.attestation.pipeline import Binding, IssuerTrust, Material, Trust
from broker.core.encoding import b64url_encode
from broker.core.errors import AttestationError, BrokerError, InputError
from broker.core.jsonsafe import loads_bounded
from broker.crypto import jose
from broker.crypto.jwk import parse_runner_key
from broker.crypto.jwks import JwksError, parse_jwks
from broker.decisions.release import parse_release_request

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
HOPPER_REPORT = bytes.fromhex((REAL / "nvidia" / "hopperAttestationReport.txt").read_text().strip())
HOPPER_CHAIN = (REAL / "nvidia" / "hopperCertChain.txt").read_bytes()
DRIVER_RIM = (REAL / "nvidia" / "NV_GPU_DRIVER_GH100_550.90.07.swidtag").read_bytes()
RIM_ROOT = (REAL / "nvidia" / "verifier_RIM_root.pem").read_bytes()
OIDC = (REAL / "gca" / "cs_oidc_token_tdx_2025-02.jwt").read_text().strip()
NOW = datetime(2026, 3, 1, tzinfo=UTC)

PROPERTY = settings(
    max_examples=250,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=25,
)


def mutations(data: bytes) -> st.SearchStrategy[bytes]:
    """Truncations, bit flips and splices of a real artifact: parsers meet near-valid input."""
    size = len(data)
    flips = st.tuples(st.integers(0, size - 1), st.integers(1, 255)).map(
        lambda t: data[: t[0]] + bytes([data[t[0]] ^ t[1]]) + data[t[0] + 1 :]
    )
    cuts = st.integers(0, size).map(lambda n: data[:n])
    splices = st.tuples(st.integers(0, size), st.binary(max_size=64)).map(
        lambda t: data[: t[0]] + t[1] + data[t[0] :]
    )
    return flips | cuts | splices | st.binary(max_size=512)


@PROPERTY
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_jose_header_parser_takes_any_text(token: str) -> None:
    try:
        header = jose.parse_header(token, ("RS256",))
    except AttestationError:
        return
    assert header.alg == "RS256"


@PROPERTY
@given(st.sampled_from(OIDC.split(".")[:2]), json_values, st.integers(0, 2))
def test_token_verifier_takes_any_header_or_claims(part: str, value: Any, where: int) -> None:
    parts = OIDC.split(".")
    parts[where] = b64url_encode(json.dumps(value).encode()) if where < 2 else part
    trust = gca.GcaTrust(
        issuer="https://confidentialcomputing.googleapis.com", algorithms=("RS256",)
    )
    with pytest.raises(AttestationError):
        gca.verify_gca_token(".".join(parts), trust=trust, audience="a", now=NOW)


@PROPERTY
@given(json_values | st.text(max_size=100))
def test_evidence_pipeline_takes_any_json(evidence: Any) -> None:
    settings_ = IssuerSettings(kind="gca", issuer="https://iss.test", jwks_file=Path("x"))
    trust = Trust(issuers={"https://iss.test": IssuerTrust(settings_)}, audience="aud")
    for body in (evidence, {"gca": evidence}, {"gca": OIDC, "nras": evidence}):
        try:
            pipeline.verify_evidence(body, trust, Material(), bound_to=Binding(), now=NOW)
        except BrokerError:
            continue


@PROPERTY
@given(mutations(HOPPER_REPORT))
def test_spdm_parser_takes_any_bytes(report: bytes) -> None:
    try:
        parsed = spdm.parse_report(report)
    except AttestationError:
        return
    assert len(parsed.signature) == spdm.SIGNATURE_BYTES


@PROPERTY
@given(mutations(HOPPER_REPORT))
def test_gpu_report_verifier_accepts_only_the_untouched_report(report: bytes) -> None:
    from cryptography import x509  # noqa: PLC0415

    roots = x509.load_pem_x509_certificates(
        (REAL / "nvidia" / "verifier_device_root.pem").read_bytes()
    )
    evidence = local.GpuEvidence(report=report, chain_pem=HOPPER_CHAIN)
    try:
        local.verify_gpu_report(
            evidence, arch=None, device_roots=roots, expected_nonce=None, now=NOW
        )
    except AttestationError:
        return
    # Only a report that parses to the same signed bytes can verify (a trailing zero byte is
    # tolerated by the format: EVIDENCE.md §3.2).
    assert spdm.parse_report(report).signed_bytes == spdm.parse_report(HOPPER_REPORT).signed_bytes


@settings(max_examples=60, derandomize=True, deadline=None)
@given(mutations(DRIVER_RIM))
def test_rim_verifier_takes_any_bytes(data: bytes) -> None:
    from cryptography import x509  # noqa: PLC0415

    roots = x509.load_pem_x509_certificates(RIM_ROOT)
    try:
        verified = rim.verify_rim(data, roots=roots, now=NOW)
    except AttestationError:
        return
    assert verified.version == "550.90.07"


@PROPERTY
@given(
    json_values
    | st.fixed_dictionaries(
        {"kty": st.sampled_from(["EC", "RSA", "OKP", "HPKE", "oct"])},
        optional={
            "crv": st.sampled_from(["P-256", "P-384", "X25519", "Ed25519", "P-521"]),
            "x": st.binary(max_size=70).map(b64url_encode) | st.text(max_size=50),
            "y": st.binary(max_size=70).map(b64url_encode) | json_values,
            "n": st.binary(min_size=1, max_size=600).map(b64url_encode),
            "e": st.binary(min_size=1, max_size=5).map(b64url_encode),
            "kem": st.just("MLKEM768-X25519"),
            "pk": st.binary(max_size=1300).map(b64url_encode),
            "d": st.text(max_size=5),
        },
    )
)
def test_runner_key_parser_takes_any_json(value: Any) -> None:
    try:
        key = parse_runner_key(value)
    except InputError as exc:
        assert exc.code.value == "runner_key_invalid"  # noqa: PT017 - the code is the property
        return
    assert key.thumbprint


@PROPERTY
@given(st.binary(max_size=400) | json_values.map(lambda v: json.dumps(v).encode()))
def test_body_parser_takes_any_bytes(data: bytes) -> None:
    try:
        body = loads_bounded(data)
    except ValueError:
        return
    if isinstance(body, dict):
        try:
            parse_release_request(body)
        except InputError:
            return


@PROPERTY
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "key": json_values,
            "nonce": json_values,
            "evidence": json_values,
            "runner_key": json_values,
            "version": json_values,
            "wrap": json_values,
        },
    )
)
def test_release_fields_take_any_json(body: dict[str, Any]) -> None:
    try:
        parse_release_request(body)
    except InputError:
        return


@PROPERTY
@given(json_values | st.text(max_size=200))
def test_gpu_evidence_shapes_take_any_json(value: Any) -> None:
    for parse in (nras.parse_detached_eat, local.parse_local_evidence):
        try:
            parse(value)
        except AttestationError:
            continue


@PROPERTY
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps({"keys": [v]}).encode()))
def test_jwks_parser_takes_any_bytes(data: bytes) -> None:
    try:
        parse_jwks(data)
    except JwksError:
        return


def test_properties_see_the_real_artifacts_verify() -> None:
    """The control: the unmutated artifacts pass the same verifiers (so the properties above
    are not vacuous)."""
    from cryptography import x509  # noqa: PLC0415

    roots = x509.load_pem_x509_certificates(RIM_ROOT)
    assert rim.verify_rim(DRIVER_RIM, roots=roots, now=NOW).version == "550.90.07"
    assert spdm.parse_report(HOPPER_REPORT).driver_version == "550.90.07"
    assert base64.b64encode(HOPPER_REPORT)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@PROPERTY
@given(json_values, st.integers(0, 6), st.text(alphabet="[]{}", max_size=8))
def test_depth_bound_matches_the_nesting(value: Any, limit: int, noise: str) -> None:
    """``loads_bounded`` skips its walk when the text has few brackets; brackets inside strings
    (``noise``) must not change the answer: refused exactly when nested deeper than the limit."""
    document = [value, noise]
    text = json.dumps(document)
    if _depth(document) <= limit:
        assert loads_bounded(text, max_depth=limit) == document
    else:
        with pytest.raises(ValueError, match="nested deeper"):
            loads_bounded(text, max_depth=limit)
