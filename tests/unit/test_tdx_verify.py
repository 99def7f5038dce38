"""Raw TDX quotes (issue 33): the public dcap-qvl samples and quotes forged under a test PKI,
through the pure verifier (``attestation/raw/tdx.py``)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from broker.attestation.claims import ita_tee
from broker.attestation.ita import VerifiedItaToken
from broker.attestation.raw.tdx import TdxTrust, authenticate_quote, tdx_tee, verify_tdx_quote
from broker.attestation.raw.tdx_collateral import TdxCollateral, check_fresh, parse_collateral_json
from broker.attestation.raw.tdx_dcap import DcapVerdict, dcap_verify
from broker.attestation.raw.tdx_quote import parse_quote
from broker.core.errors import AttestationError, ErrorCode
from tests.support.tdx_forge import (
    DEBUG_TD,
    INSIDE,
    SEPT_VE_DISABLE,
    CollateralSpec,
    ForgedPki,
    QuoteSpec,
    forge_collateral,
    forge_pki,
    forge_quote,
)
from tests.support.tdx_samples import INTEL_TRUST, V4_INSIDE, V5_INSIDE, sample


@pytest.fixture(scope="module")
def pki() -> ForgedPki:
    return forge_pki()


def forged(
    pki: ForgedPki, quote: QuoteSpec | None = None, collateral: CollateralSpec | None = None
) -> tuple[bytes, TdxCollateral]:
    document = forge_collateral(pki, collateral or CollateralSpec())
    return forge_quote(pki, quote or QuoteSpec()), parse_collateral_json(json.dumps(document))


def refused(raw: bytes, collateral: TdxCollateral, trust: TdxTrust, **kw: Any) -> ErrorCode:
    with pytest.raises(AttestationError) as caught:
        verify_tdx_quote(raw, collateral, trust=trust, now=kw.get("now", INSIDE))
    return caught.value.code


def test_public_v4_sample_verifies_inside_its_collateral_window() -> None:
    raw, collateral = sample("tdx_quote")
    verified = verify_tdx_quote(raw, collateral, trust=INTEL_TRUST, now=V4_INSIDE)
    tee = verified.tee
    assert (tee["verifier"], tee["technology"], tee["debug"]) == ("local", "tdx", False)
    assert (tee["tcb_status"], tee["advisory_ids"], tee["quote_version"]) == ("UpToDate", [], 4)
    assert tee["measurements"]["mrtd"].startswith("91eb2b44d141d4ec")
    assert tee["measurements"]["rtmr"][3] == "00" * 48
    assert verified.report_data == parse_quote(raw).report_data
    assert verified.claims["fmspc"] == "B0C06F000000"
    assert verified.claims["pck_ca"] == "platform"


def test_public_outdated_sample_is_below_every_tcb_level() -> None:
    """Named "outdated" upstream, but its CPU SVN is below every level its collateral lists:
    dcap-qvl (like Intel's QVL, TCB_NOT_SUPPORTED) refuses it outright."""
    raw, collateral = sample("tdx_quote_outdated")
    assert parse_quote(raw).version == 5
    assert refused(raw, collateral, INTEL_TRUST, now=V5_INSIDE) == ErrorCode.TDX_TCB_UNSUPPORTED


@pytest.mark.parametrize(
    ("late", "part"),
    [(timedelta(0), "PCK CRL"), (timedelta(minutes=16), "tcbInfo")],
)
def test_collateral_past_next_update_is_refused_with_its_code(late: timedelta, part: str) -> None:
    raw, collateral = sample("tdx_quote")
    past_crl = collateral.next_update + timedelta(seconds=1)
    assert verify_tdx_quote(raw, collateral, trust=INTEL_TRUST, now=past_crl - timedelta(seconds=2))
    with pytest.raises(AttestationError) as caught:
        verify_tdx_quote(raw, collateral, trust=INTEL_TRUST, now=past_crl + late)
    assert caught.value.code == ErrorCode.TDX_COLLATERAL_EXPIRED
    assert f"{part} nextUpdate" in caught.value.message


def test_collateral_at_its_next_update_instant_is_expired() -> None:
    """At ``nextUpdate`` exactly the collateral has no time left to vouch for anything (a token
    judged with it would expire as it is issued): expired, like a second later, not a pass
    that fails further on."""
    raw, collateral = sample("tdx_quote")
    with pytest.raises(AttestationError) as caught:  # the broker's own check, not dcap-qvl's
        check_fresh(collateral, collateral.next_update)
    assert caught.value.code == ErrorCode.TDX_COLLATERAL_EXPIRED
    assert "PCK CRL nextUpdate" in caught.value.message
    assert refused(raw, collateral, INTEL_TRUST, now=collateral.next_update) == (
        ErrorCode.TDX_COLLATERAL_EXPIRED
    )


def test_collateral_dated_after_now_is_refused() -> None:
    raw, collateral = sample("tdx_quote")
    early = collateral.not_before - timedelta(seconds=1)
    assert refused(raw, collateral, INTEL_TRUST, now=early) == ErrorCode.TDX_COLLATERAL_INVALID


def test_forged_quote_accepted_only_under_its_own_pinned_root(pki: ForgedPki) -> None:
    raw, collateral = forged(pki)
    verified = verify_tdx_quote(raw, collateral, trust=TdxTrust(pki.root), now=INSIDE)
    assert verified.tee["tcb_status"] == "UpToDate"
    # the same quote against Intel's root: a quote from another root
    assert refused(raw, collateral, INTEL_TRUST) == ErrorCode.CERT_CHAIN_INVALID


def test_real_quote_refused_under_another_pinned_root(pki: ForgedPki) -> None:
    raw, collateral = sample("tdx_quote")
    code = refused(raw, collateral, TdxTrust(pki.root), now=V4_INSIDE)
    assert code == ErrorCode.CERT_CHAIN_INVALID


def test_dcap_qvl_uses_the_root_passed_not_its_embedded_copy(pki: ForgedPki) -> None:
    """Below our own anchor checks: dcap-qvl embeds Intel's root, yet accepts a forged quote
    with the forged root passed and refuses the real one with it."""
    raw, collateral = forged(pki)
    forged_root = TdxTrust(pki.root).root_der
    assert dcap_verify(raw, collateral, forged_root, INSIDE).tcb_status == "UpToDate"
    with pytest.raises(AttestationError):
        dcap_verify(raw, collateral, INTEL_TRUST.root_der, INSIDE)
    real, real_collateral = sample("tdx_quote")
    with pytest.raises(AttestationError):
        dcap_verify(real, real_collateral, forged_root, V4_INSIDE)


@pytest.mark.parametrize(
    ("status", "advisories"),
    [
        ("OutOfDate", ("INTEL-SA-01036", "INTEL-SA-01099")),
        ("SWHardeningNeeded", ("INTEL-SA-00615",)),
    ],
)
def test_tcb_status_and_advisories_reach_the_policy(
    pki: ForgedPki, status: str, advisories: tuple[str, ...]
) -> None:
    raw, collateral = forged(
        pki, collateral=CollateralSpec(tcb_status=status, advisory_ids=advisories)
    )
    verified = verify_tdx_quote(raw, collateral, trust=TdxTrust(pki.root), now=INSIDE)
    assert verified.tee["tcb_status"] == status
    assert verified.tee["advisory_ids"] == list(advisories)


@pytest.mark.parametrize(
    ("quote", "collateral", "code"),
    [
        (None, CollateralSpec(tcb_status="Revoked"), ErrorCode.TDX_TCB_REVOKED),
        (QuoteSpec(td_attributes=DEBUG_TD), None, ErrorCode.TDX_TD_ATTRIBUTES_REFUSED),
        (None, CollateralSpec(revoked_serials=(3,)), ErrorCode.CERT_CHAIN_INVALID),  # PCK leaf
        (None, CollateralSpec(fmspc="00906EA10001"), ErrorCode.TDX_COLLATERAL_INVALID),
        (None, CollateralSpec(crl_next_update=INSIDE), ErrorCode.TDX_COLLATERAL_EXPIRED),
    ],
    ids=["revoked-tcb", "debug-td", "revoked-pck", "other-fmspc", "crl-past"],
)
def test_refusals_have_their_codes(
    pki: ForgedPki,
    quote: QuoteSpec | None,
    collateral: CollateralSpec | None,
    code: ErrorCode,
) -> None:
    raw, document = forged(pki, quote, collateral)
    now = INSIDE + timedelta(seconds=1)
    assert refused(raw, document, TdxTrust(pki.root), now=now) == code


def attributes(bit: int) -> bytes:
    value = int.from_bytes(SEPT_VE_DISABLE, "little") ^ (1 << bit)
    return value.to_bytes(8, "little")


LATER = datetime(2041, 1, 15, tzinfo=UTC)  # after the forged certificates' notAfter (2040)
LATER_COLLATERAL = CollateralSpec(
    issued=LATER - timedelta(days=7),
    next_update=LATER + timedelta(days=7),
    crl_next_update=LATER + timedelta(days=7),
)


@pytest.mark.parametrize(
    ("quote", "collateral", "now", "code"),
    [
        (QuoteSpec(td_attributes=attributes(1)), None, INSIDE, "tdx_td_attributes_refused"),
        (QuoteSpec(td_attributes=attributes(4)), None, INSIDE, "tdx_td_attributes_refused"),
        (QuoteSpec(td_attributes=attributes(28)), None, INSIDE, "tdx_td_attributes_refused"),
        (QuoteSpec(td_attributes=attributes(29)), None, INSIDE, "tdx_td_attributes_refused"),
        (QuoteSpec(tee_tcb_svn=bytes([6, 1, 2, *[0] * 13])), None, INSIDE, "tdx_tcb_unsupported"),
        (QuoteSpec(tee_tcb_svn=bytes([3, 1, 3, *[0] * 13])), None, INSIDE, "tdx_tcb_unsupported"),
        (QuoteSpec(tee_tcb_svn=bytes([6, 2, 3, *[0] * 13])), None, INSIDE, "tdx_tcb_unsupported"),
        (None, LATER_COLLATERAL, LATER, "cert_chain_invalid"),
    ],
    ids=[
        "reserved-bit",
        "profiling",
        "sept-ve-disable-off",
        "migratable",
        "tee-tcb-below",
        "module-isvsvn-below",
        "module-version-unknown",
        "certificate-expired",
    ],
)
def test_library_refusals_map_to_their_codes(
    pki: ForgedPki,
    quote: QuoteSpec | None,
    collateral: CollateralSpec | None,
    now: datetime,
    code: str,
) -> None:
    """Each of these is refused by dcap-qvl (not by the broker's own checks): its error text
    maps to the code (``tdx_dcap.DCAP_REFUSALS``), pinned with the library's version."""
    raw, document = forged(pki, quote, collateral)
    assert refused(raw, document, TdxTrust(pki.root), now=now) == code
    with pytest.raises(AttestationError) as caught:
        dcap_verify(raw, document, TdxTrust(pki.root).root_der, now)
    assert caught.value.code == code


def test_sgx_collateral_for_a_tdx_quote_is_refused(pki: ForgedPki) -> None:
    document = forge_collateral(pki, CollateralSpec(extra={"id": "SGX"}))
    with pytest.raises(AttestationError) as caught:
        parse_collateral_json(json.dumps(document))
    assert caught.value.code == ErrorCode.TDX_COLLATERAL_INVALID


def test_tampered_collateral_signature_is_refused(pki: ForgedPki) -> None:
    raw, collateral = forged(pki)
    tcb_info = collateral.tcb_info.replace(
        '"tcbEvaluationDataNumber":17', '"tcbEvaluationDataNumber":18'
    )
    bad = replace(collateral, tcb_info=tcb_info)
    assert refused(raw, bad, TdxTrust(pki.root)) == ErrorCode.TDX_COLLATERAL_INVALID


@pytest.mark.parametrize(("version", "body_type"), [(5, 2), (5, 3)])
def test_v5_quotes_verify(pki: ForgedPki, version: int, body_type: int) -> None:
    raw, collateral = forged(pki, QuoteSpec(version=version, body_type=body_type))
    verified = verify_tdx_quote(raw, collateral, trust=TdxTrust(pki.root), now=INSIDE)
    assert verified.tee["quote_version"] == 5
    assert verified.claims["body_type"] == body_type
    assert ("tee_tcb_svn2" in verified.claims) == (body_type == 3)


def test_report_data_is_what_the_attestation_key_signed(pki: ForgedPki) -> None:
    report_data = bytes(range(64))
    raw, collateral = forged(pki, QuoteSpec(report_data=report_data))
    verified = verify_tdx_quote(raw, collateral, trust=TdxTrust(pki.root), now=INSIDE)
    assert verified.report_data == report_data
    assert verified.tee["measurements"]["report_data"] == report_data.hex()


def test_debug_bit_normalises_to_debug_true(pki: ForgedPki) -> None:
    """dcap-qvl 0.7.0 refuses debug TDs before a policy sees them (above); the normalisation
    still reads TUD.DEBUG, so a library that let one through could not hide it."""
    quote = parse_quote(forge_quote(pki, QuoteSpec(td_attributes=DEBUG_TD)))
    assert tdx_tee(quote, DcapVerdict("UpToDate", ()))["debug"] is True
    assert tdx_tee(parse_quote(forge_quote(pki)), DcapVerdict("UpToDate", ()))["debug"] is False


def test_tee_section_has_the_shape_ita_tokens_give() -> None:
    """One policy reads every kind: every member of an ITA TDX ``tee`` exists here, with the
    same type, nested members included."""
    raw, collateral = sample("tdx_quote")
    ours = verify_tdx_quote(raw, collateral, trust=INTEL_TRUST, now=V4_INSIDE).tee
    theirs = ita_tee(VerifiedItaToken(issuer="https://x.invalid", kid="k", claims={}))

    def shape(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: shape(v) for k, v in value.items()}
        return type(value).__name__

    ita_shape, our_shape = shape(theirs), shape(ours)
    for key, kind in ita_shape.items():
        if isinstance(kind, dict):
            assert set(kind) <= set(our_shape[key]), key
        else:
            assert our_shape[key] == kind, key
    assert len(ours["measurements"]["rtmr"]) == 4


def test_authentication_needs_no_collateral_and_names_the_platform() -> None:
    raw, _ = sample("tdx_quote")
    authentic = authenticate_quote(raw, INTEL_TRUST)
    assert (authentic.fmspc, authentic.ca) == ("B0C06F000000", "platform")
