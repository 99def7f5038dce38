"""The one module that calls ``dcap-qvl`` (Phala Network's DCAP quote verification library,
pinned in pyproject.toml), with typed results and our error codes. Pure: no collateral is
fetched here (its ``get_collateral`` is never called).

``dcap-qvl`` raises ``ValueError`` with text for every refusal; ``DCAP_REFUSALS`` maps that text
to stable codes. The text is the library's, so the version is pinned exactly and
tests/unit/test_tdx_verify.py checks each mapping on evidence that triggers it; an unlisted text
is ``tdx_quote_invalid`` (a refusal either way, never a pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import dcap_qvl

from broker.attestation.raw.tdx_collateral import TdxCollateral
from broker.attestation.raw.tdx_quote import TdxQuote
from broker.core.errors import AttestationError, ErrorCode
from broker.core.protocol import TDX_TCB_STATUSES

TCB_STATUSES = TDX_TCB_STATUSES  # Revoked is refused before a policy sees it
# dcap-qvl 0.7.0's refusals (its error text, pinned with the version) -> our code and words.
# First match wins; anything unlisted is tdx_quote_invalid (fail closed, never a pass).
DCAP_REFUSALS: tuple[tuple[str, ErrorCode, str], ...] = (
    ("TCB status is invalid: Revoked", ErrorCode.TDX_TCB_REVOKED, "the platform's TCB is revoked"),
    (
        "No matching TCB level",
        ErrorCode.TDX_TCB_UNSUPPORTED,
        "the platform's TCB is below every level Intel lists for it",
    ),
    ("ISVSVN", ErrorCode.TDX_TCB_UNSUPPORTED, "the TDX module is below every level"),
    (
        "No TDX module identity",
        ErrorCode.TDX_TCB_UNSUPPORTED,
        "the TDX module version is not in Intel's TCB info",
    ),
    ("TDX TCB", ErrorCode.TDX_TCB_UNSUPPORTED, "the TDX TCB cannot be evaluated"),
    ("Debug mode", ErrorCode.TDX_TD_ATTRIBUTES_REFUSED, "the TD is a debug TD"),
    ("TD attributes", ErrorCode.TDX_TD_ATTRIBUTES_REFUSED, "reserved TD attribute bits set"),
    ("SEPT_VE_DISABLE", ErrorCode.TDX_TD_ATTRIBUTES_REFUSED, "SEPT_VE_DISABLE is off"),
    ("migration", ErrorCode.TDX_TD_ATTRIBUTES_REFUSED, "the TD is migratable"),
    ("profiling", ErrorCode.TDX_TD_ATTRIBUTES_REFUSED, "TD profiling is on"),
    ("SERVTD", ErrorCode.TDX_TD_ATTRIBUTES_REFUSED, "a service TD is bound"),
    ("service TD", ErrorCode.TDX_TD_ATTRIBUTES_REFUSED, "a service TD is bound"),
    ("CertExpired", ErrorCode.CERT_CHAIN_INVALID, "a certificate has expired"),
    ("CertNotValidYet", ErrorCode.CERT_CHAIN_INVALID, "a certificate is not valid yet"),
    ("xpired", ErrorCode.TDX_COLLATERAL_EXPIRED, "a CRL or the collateral has expired"),
    ("Fmspc", ErrorCode.TDX_COLLATERAL_INVALID, "the collateral is for another platform"),
    ("quote_collateral", ErrorCode.TDX_COLLATERAL_INVALID, "a collateral signature is invalid"),
    ("TCB Info", ErrorCode.TDX_COLLATERAL_INVALID, "the TCB info is unusable"),
    ("TcbInfo", ErrorCode.TDX_COLLATERAL_INVALID, "the TCB info is unusable"),
    ("QE Identity", ErrorCode.TDX_COLLATERAL_INVALID, "the QE identity is unusable"),
    ("QeIdentity", ErrorCode.TDX_COLLATERAL_INVALID, "the QE identity is unusable"),
    ("CRL", ErrorCode.TDX_COLLATERAL_INVALID, "a CRL is unusable"),
    ("Revoked", ErrorCode.CERT_CHAIN_INVALID, "a certificate is revoked"),
    ("UnknownIssuer", ErrorCode.CERT_CHAIN_INVALID, "a chain does not reach the pinned root"),
    ("root ca", ErrorCode.CERT_CHAIN_INVALID, "the pinned root is unusable"),
)
# TD report fields as dcap-qvl names them (step 5)
DCAP_FIELDS = {
    "tee_tcb_svn": "tee_tcb_svn",
    "mrseam": "mr_seam",
    "mrsignerseam": "mr_signer_seam",
    "seam_attributes": "seam_attributes",
    "td_attributes": "td_attributes",
    "xfam": "xfam",
    "mrtd": "mr_td",
    "mrconfigid": "mr_config_id",
    "mrowner": "mr_owner",
    "mrownerconfig": "mr_owner_config",
    "rtmr0": "rt_mr0",
    "rtmr1": "rt_mr1",
    "rtmr2": "rt_mr2",
    "rtmr3": "rt_mr3",
    "report_data": "report_data",
    "tee_tcb_svn2": "tee_tcb_svn2",
    "mrservicetd": "mr_service_td",
}


@dataclass(frozen=True)
class DcapVerdict:
    """What ``dcap-qvl`` said about a quote it accepted."""

    tcb_status: str
    advisory_ids: tuple[str, ...]


def dcap_verify(
    raw_quote: bytes, collateral: TdxCollateral, root_der: bytes, now: datetime
) -> DcapVerdict:
    """``dcap-qvl``'s verification with ``root_der`` as the only trust anchor.

    Raises:
        AttestationError: the mapped code of its refusal.
    """
    try:
        report = dcap_qvl.verify_with_root_ca(
            raw_quote, _dcap_collateral(collateral), root_der, int(now.timestamp())
        )
    except ValueError as exc:
        code, words = _refusal(str(exc))
        raise AttestationError(f"TDX quote refused: {words}", code=code) from exc
    status = str(report.status)
    if status not in TCB_STATUSES:
        code = ErrorCode.TDX_TCB_REVOKED if status == "Revoked" else ErrorCode.TDX_QUOTE_INVALID
        raise AttestationError(f"TDX quote: TCB status {status!r} refused", code=code)
    return DcapVerdict(tcb_status=status, advisory_ids=tuple(str(a) for a in report.advisory_ids))


def _refusal(text: str) -> tuple[ErrorCode, str]:
    for needle, code, words in DCAP_REFUSALS:
        if needle in text:
            return code, words
    return ErrorCode.TDX_QUOTE_INVALID, "a signature, the QE or the PCK chain does not verify"


def _dcap_collateral(collateral: TdxCollateral) -> Any:
    # The PCK chain is never passed: dcap-qvl then verifies the quote's own.
    return dcap_qvl.QuoteCollateralV3(
        collateral.pck_crl_issuer_chain,
        collateral.root_ca_crl,
        collateral.pck_crl,
        collateral.tcb_info_issuer_chain,
        collateral.tcb_info,
        collateral.tcb_info_signature,
        collateral.qe_identity_issuer_chain,
        collateral.qe_identity,
        collateral.qe_identity_signature,
    )


def check_same_report(quote: TdxQuote) -> None:
    """Both parsers read the same TD report (what the policy sees is what was signed).

    Raises:
        AttestationError: ``tdx_quote_malformed`` naming the field they disagree on.
    """
    report = dcap_qvl.parse_quote(quote.raw).report
    for ours, theirs in DCAP_FIELDS.items():
        if ours in quote.body and bytes(getattr(report, theirs)) != quote.body[ours]:
            raise AttestationError(
                f"TDX quote: the verifier read {ours} differently",
                code=ErrorCode.TDX_QUOTE_MALFORMED,
            )


def pck_fmspc(pck_chain_pem: bytes) -> str:
    """The FMSPC (upper-case hex) in the Intel SGX extension of a PCK chain's leaf.

    Raises:
        AttestationError: ``tdx_quote_malformed``.
    """
    try:
        fmspc = bytes(dcap_qvl.parse_pck_extension_from_pem(pck_chain_pem).fmspc)
    except ValueError as exc:
        raise AttestationError(
            "TDX quote: the PCK certificate has no Intel SGX extension",
            code=ErrorCode.TDX_QUOTE_MALFORMED,
        ) from exc
    if len(fmspc) != 6:
        raise AttestationError(
            "TDX quote: the PCK certificate's FMSPC is not 6 bytes",
            code=ErrorCode.TDX_QUOTE_MALFORMED,
        )
    return fmspc.hex().upper()
