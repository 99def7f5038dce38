"""The TDX parsers (issue 33) take anything and answer their object or their coded error: the
quote structure (``raw/tdx_quote.py``), DCAP collateral in both forms (``raw/tdx_collateral.py``)
and the guest's evidence object (``raw/tdx_guest.py``)."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any
from urllib.parse import quote as url_quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.attestation.raw.tdx_collateral import (
    collateral_from_pcs,
    crl_der,
    parse_collateral_json,
)
from broker.attestation.raw.tdx_guest import parse_tdx_evidence
from broker.attestation.raw.tdx_quote import parse_quote
from broker.core.errors import AttestationError, ErrorCode
from tests.support.tdx_samples import TDX_FIXTURES

V4 = (TDX_FIXTURES / "tdx_quote").read_bytes()
V5 = (TDX_FIXTURES / "tdx_quote_outdated").read_bytes()
COLLATERAL = json.loads((TDX_FIXTURES / "tdx_quote_collateral.json").read_bytes())
PROPERTY = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def code_of(call: Any, *args: Any) -> ErrorCode:
    with pytest.raises(AttestationError) as caught:
        call(*args)
    return caught.value.code


def test_samples_parse_to_their_layouts() -> None:
    v4, v5 = parse_quote(V4), parse_quote(V5)
    assert (v4.version, v4.body_type, len(v4.signed)) == (4, 2, 632)
    assert (v5.version, v5.body_type, len(v5.signed)) == (5, 3, 702)
    assert len(v5.body["tee_tcb_svn2"]) == 16
    assert len(v5.body["mrservicetd"]) == 48
    assert v4.pck_chain_pem.count(b"BEGIN CERTIFICATE") == 3


def test_every_truncation_is_malformed() -> None:
    end = len(V4.rstrip(b"\x00"))  # the sample is zero-padded past its signature data
    for size in range(end):
        assert code_of(parse_quote, V4[:size]) == ErrorCode.TDX_QUOTE_MALFORMED, size


@pytest.mark.parametrize(
    ("offset", "value", "why"),
    [
        (0, struct.pack("<H", 3), "version 3"),
        (2, struct.pack("<H", 3), "key type"),
        (4, struct.pack("<I", 0), "SGX TEE type"),
        (12, bytes(16), "QE vendor"),
        (632, struct.pack("<I", 0xFFFFFFFF), "signature data length"),
        (4936, b"\x01", "non-zero padding"),
    ],
)
def test_header_and_sizes_are_checked(offset: int, value: bytes, why: str) -> None:
    mutant = V4[:offset] + value + V4[offset + len(value) :]
    assert code_of(parse_quote, mutant) == ErrorCode.TDX_QUOTE_MALFORMED, why


def test_v5_body_type_and_size_must_agree() -> None:
    for body_type, size in ((1, 384), (4, 648), (2, 648), (3, 584)):
        mutant = V5[:48] + struct.pack("<HI", body_type, size) + V5[54:]
        assert code_of(parse_quote, mutant) == ErrorCode.TDX_QUOTE_MALFORMED


def test_oversized_quote_is_refused_before_parsing() -> None:
    assert code_of(parse_quote, V4 + bytes(40_000)) == ErrorCode.TDX_QUOTE_MALFORMED


@PROPERTY
@given(
    st.one_of(
        st.tuples(st.integers(0, len(V4) - 1), st.integers(1, 255)).map(
            lambda t: V4[: t[0]] + bytes([V4[t[0]] ^ t[1]]) + V4[t[0] + 1 :]
        ),
        st.tuples(st.integers(0, len(V5)), st.binary(max_size=64)).map(
            lambda t: V5[: t[0]] + t[1] + V5[t[0] :]
        ),
        st.binary(max_size=2048),
    )
)
def test_quote_parser_takes_any_bytes(data: bytes) -> None:
    code = ErrorCode.TDX_QUOTE_MALFORMED
    try:
        parse_quote(data)
    except AttestationError as exc:
        code = exc.code
    assert code == ErrorCode.TDX_QUOTE_MALFORMED


def test_collateral_json_members_are_checked() -> None:
    for broken in (
        {**COLLATERAL, "tcb_info": "{"},
        {**COLLATERAL, "pck_crl": "zz"},
        {**COLLATERAL, "extra": "x"},
        {k: v for k, v in COLLATERAL.items() if k != "qe_identity"},
        {**COLLATERAL, "root_ca_crl": COLLATERAL["pck_crl_issuer_chain"].encode().hex()},
    ):
        assert (
            code_of(parse_collateral_json, json.dumps(broken)) == ErrorCode.TDX_COLLATERAL_INVALID
        )
    written_by_dcap = {**COLLATERAL, "pck_certificate_chain": None}
    assert parse_collateral_json(json.dumps(written_by_dcap)).fmspc == "B0C06F000000"


@PROPERTY
@given(st.binary(max_size=4096) | st.text(max_size=200).map(str.encode))
def test_collateral_parser_takes_any_bytes(data: bytes) -> None:
    code = ErrorCode.TDX_COLLATERAL_INVALID
    try:
        parse_collateral_json(data)
    except AttestationError as exc:
        code = exc.code
    assert code == ErrorCode.TDX_COLLATERAL_INVALID


def test_pcs_answers_keep_the_signed_bytes_as_served() -> None:
    """PCS signs the ``tcbInfo`` text it serves; re-serialising would change spacing or order
    and break the signature, so the member's source text is kept, whitespace and all."""
    tcb_info = COLLATERAL["tcb_info"].replace(',"', ', "', 3)  # spacing a re-dump would lose
    tcb_body = f'{{"tcbInfo": {tcb_info} ,\n "signature":"{COLLATERAL["tcb_info_signature"]}"}}'
    qe_body = f'{{"enclaveIdentity":{COLLATERAL["qe_identity"]},"signature":"ab"}}'
    collateral = collateral_from_pcs(
        tcb_info_body=tcb_body.encode(),
        tcb_info_chain=url_quote(COLLATERAL["tcb_info_issuer_chain"]),
        qe_identity_body=qe_body.encode(),
        qe_identity_chain=url_quote(COLLATERAL["qe_identity_issuer_chain"]),
        pck_crl=bytes.fromhex(COLLATERAL["pck_crl"]),
        pck_crl_chain=url_quote(COLLATERAL["pck_crl_issuer_chain"]),
        root_ca_crl=COLLATERAL["root_ca_crl"].encode(),  # a PCCS answers rootcacrl in hex
    )
    assert collateral.tcb_info == tcb_info
    assert collateral.tcb_info_issuer_chain == COLLATERAL["tcb_info_issuer_chain"]
    assert collateral.qe_identity_signature == b"\xab"
    assert collateral.root_ca_crl == bytes.fromhex(COLLATERAL["root_ca_crl"])


@pytest.mark.parametrize("body", [b"[]", b'{"tcbInfo":{}}', b'{"tcbInfo":{},"signature":1}', b"{"])
def test_pcs_answers_of_the_wrong_shape_are_refused(body: bytes) -> None:
    def build() -> object:
        return collateral_from_pcs(
            tcb_info_body=body,
            tcb_info_chain="",
            qe_identity_body=body,
            qe_identity_chain="",
            pck_crl=b"",
            pck_crl_chain="",
            root_ca_crl=b"",
        )

    assert code_of(build) == ErrorCode.TDX_COLLATERAL_INVALID


def test_crls_come_as_der_pem_or_hex() -> None:
    der = bytes.fromhex(COLLATERAL["pck_crl"])
    pem = b"-----BEGIN X509 CRL-----\n" + base64.encodebytes(der) + b"-----END X509 CRL-----\n"
    assert crl_der(der, "x") == crl_der(pem, "x") == crl_der(der.hex().encode(), "x") == der
    assert code_of(crl_der, b"not a crl", "x") == ErrorCode.TDX_COLLATERAL_INVALID


def test_guest_evidence_as_guest_components_writes_it() -> None:
    encoded = base64.b64encode(V4).decode()
    assert parse_tdx_evidence({"quote": encoded, "cc_eventlog": None}).quote == V4
    with_log = parse_tdx_evidence({"quote": encoded, "cc_eventlog": "AAEC", "future": 1})
    assert with_log.cc_eventlog == b"\x00\x01\x02"
    older = parse_tdx_evidence({"quote": encoded, "aa_eventlog": "INIT sha384/00"})
    assert older.aa_eventlog == "INIT sha384/00"


@pytest.mark.parametrize(
    "evidence",
    [
        {},
        {"quote": ""},
        {"quote": 5},
        {"quote": "not base64!"},
        {"quote": "AAEC", "cc_eventlog": 3},
        {"quote": "AAEC", "aa_eventlog": []},
        {"quote": "A" * 50_000},
        {f"m{i}": 1 for i in range(20)},
        ["quote"],
    ],
)
def test_guest_evidence_of_the_wrong_shape_is_refused(evidence: Any) -> None:
    assert code_of(parse_tdx_evidence, evidence) == ErrorCode.EVIDENCE_MALFORMED
