"""What a KBS guest sends, parsed strictly (``decisions/kbs_request.py``): kbs-types' shapes,
Trustee's version-mismatch words, tee-pubkeys the guest can be answered to (points on their
curve), resource paths of three short names."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from broker.core.errors import BrokerError, ErrorCode
from broker.decisions.kbs_request import (
    KbsArrival,
    parse_attest,
    parse_auth,
    parse_resource_path,
    parse_tee_pubkey,
)
from tests.support.kbs_client import tee_key

INIT_DATA = 'algorithm = "sha384"\nversion = "0.1.0"\n\n[data]\n"aa.toml" = "x"\n'


def _arrival(body: Any) -> KbsArrival:
    return KbsArrival(body=json.dumps(body).encode())


def _code(call: Any, *args: Any) -> ErrorCode:
    with pytest.raises(BrokerError) as caught:
        call(*args)
    return caught.value.code


def test_the_guests_handshake_parses() -> None:
    body = {
        "version": "0.4.0",
        "tee": "az-tdx-vtpm",
        "extra-params": {"supported-hash-algorithms": ["sha384"]},
    }
    assert parse_auth(_arrival(body)).tee == "az-tdx-vtpm"
    assert (
        parse_auth(_arrival({"version": "0.4.0", "tee": "sample", "extra-params": ""})).tee
        == "sample"
    )


def test_version_0_3_0_rejected_in_trustees_words() -> None:
    with pytest.raises(BrokerError) as caught:
        parse_auth(_arrival({"version": "0.3.0", "tee": "tdx", "extra-params": {}}))
    assert caught.value.code is ErrorCode.KBS_VERSION_MISMATCH
    assert caught.value.message == (
        "Attestation error: RCAR handshake Auth failed: "
        "KBS Client Protocol Version Mismatch: expect =0.4.0 while the request is 0.3.0"
    )
    assert parse_auth(_arrival({"version": "0.4.0+build.1", "tee": "tdx"})).tee == "tdx"
    assert parse_auth(_arrival({"version": "0.4.0", "tee": "nvidiadpu"})).tee == "nvidia-dpu"
    hostile = _arrival({"version": "\x1b[31m" + "9" * 500, "tee": "tdx"})
    with pytest.raises(BrokerError) as echoed:
        parse_auth(hostile)
    assert "\x1b" not in echoed.value.message  # a hostile version is not echoed


@pytest.mark.parametrize("kind", ["P-256", "P-521", "RSA"])
def test_every_key_the_guest_makes_is_accepted(kind: str) -> None:
    _, jwk = tee_key(kind)
    parsed = parse_tee_pubkey({**jwk, "ext": True})  # a member TeePubKey does not keep: dropped
    assert parsed.jwk == jwk
    assert len(parsed.thumbprint) == 43


def test_invalid_curve_point_rejected() -> None:
    _, jwk = tee_key("P-256")
    assert _code(parse_tee_pubkey, {**jwk, "y": jwk["x"]}) is ErrorCode.TEE_PUBKEY_INVALID


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"d": "AAAA"}, ErrorCode.TEE_PUBKEY_INVALID),  # a private member
        ({"x": 3}, ErrorCode.TEE_PUBKEY_INVALID),
        ({"alg": "RSA-OAEP-256"}, ErrorCode.TEE_PUBKEY_UNSUPPORTED),  # EC for another algorithm
        ({"crv": "P-384"}, ErrorCode.TEE_PUBKEY_UNSUPPORTED),  # guests make P-256 and P-521
        ({"kty": "OKP"}, ErrorCode.TEE_PUBKEY_UNSUPPORTED),
    ],
)
def test_malformed_tee_pubkey_rejected(change: dict[str, Any], code: ErrorCode) -> None:
    _, jwk = tee_key("P-256")
    assert _code(parse_tee_pubkey, {**jwk, **change}) is code


def test_short_rsa_tee_pubkey_rejected() -> None:
    _, jwk = tee_key("RSA")
    assert _code(parse_tee_pubkey, {**jwk, "n": jwk["n"][:170]}) is ErrorCode.TEE_PUBKEY_INVALID


def test_the_guests_attestation_parses_outer_kebab_inner_snake() -> None:
    _, jwk = tee_key()
    body = {
        "init-data": {"format": "toml", "body": INIT_DATA},
        "runtime-data": {"nonce": "n", "tee-pubkey": jwk},
        "tee-evidence": {"primary_evidence": {"quote": "q"}, "additional_evidence": ""},
    }
    parsed = parse_attest(_arrival(body))
    assert (parsed.nonce, parsed.additional_evidence) == ("n", "")
    assert parsed.unverified_init_data is not None
    assert parsed.unverified_init_data.algorithm == "sha384"
    assert parsed.unverified_init_data.digest == hashlib.sha384(INIT_DATA.encode()).digest()
    snake = {**body, "tee_evidence": body["tee-evidence"]}
    del snake["tee-evidence"]
    assert _code(parse_attest, _arrival(snake)) is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "path",
    ["a/b", "a/b/c/d", "a/../c", "../b/c", "a//c", "a/b/c d", "a/b/" + "c" * 129, None],
)
def test_resource_path_outside_the_protocol_is_not_found(path: str | None) -> None:
    assert _code(parse_resource_path, path, "") is ErrorCode.KBS_RESOURCE_NOT_FOUND


def test_resource_path_with_a_query_is_not_found() -> None:
    assert str(parse_resource_path("default/key/1", "")) == "default/key/1"
    assert _code(parse_resource_path, "default/key/1", "x=1") is ErrorCode.KBS_RESOURCE_NOT_FOUND


@pytest.mark.parametrize("where", ["additional_evidence", "nonce"])
def test_lone_surrogate_in_the_report_datas_strings_rejected_at_parse(where: str) -> None:
    """JSON's ``"\\ud800"`` parses to a str with no UTF-8 form: the report data's JCS cannot be
    computed over it, so it is a malformed request (400-class), not a bug (500)."""
    _, jwk = tee_key()
    runtime = {"nonce": "n", "tee-pubkey": jwk}
    evidence = {"primary_evidence": {"quote": "q"}, "additional_evidence": ""}
    (runtime if where == "nonce" else evidence)[where] = "ok\ud800"
    body = {"runtime-data": runtime, "tee-evidence": evidence}
    assert _code(parse_attest, _arrival(body)) is ErrorCode.BAD_REQUEST
