"""Raw Intel TDX quotes verified in process with DCAP collateral. Pure: bytes, the pinned root,
collateral and ``now`` in; a ``VerifiedRawEvidence`` or a coded ``AttestationError`` out.

Checklist (Intel TDX DCAP Quote Verification Library; ``dcap-qvl`` ``verify.rs`` steps 1-10):

1. Parse the quote (``tdx_quote.parse_quote``): v4 or v5, TDX, ECDSA P-256, Intel's QE, the
   PCK chain embedded. ``tdx_quote_malformed``.
2. Authenticate it without collateral (``authenticate_quote``, also what the service runs
   before it fetches anything): the PCK chain links, signature by signature, to **our** pinned
   Intel SGX Root CA (``cert_chain_invalid``); the PCK key signed the QE report; the QE report
   data commits to SHA-256(attestation key ‖ QE authentication data); the attestation key
   signed the header and body (``tdx_quote_invalid``). Its FMSPC and PCK CA say which
   collateral applies.
3. The collateral is this platform's (FMSPC, PCK CA) and valid at ``now``: no ``nextUpdate`` of
   the TCB info, QE identity or either CRL is past (``tdx_collateral_expired``), none is dated
   after ``now`` (``tdx_collateral_invalid``) — checked here, so the refusal has its own code.
4. The collateral's issuer chains (TCB info, QE identity, PCK CRL) end at the pinned root,
   byte for byte (``cert_chain_invalid``).
5. ``dcap-qvl`` verifies everything with that root passed in (``verify_with_root_ca``, never its
   embedded copy): CRLs and revocation along every chain, certificate dates, the TCB info and
   QE identity signatures, the QE against its identity, the platform's TCB level (CPU SVN, PCE
   SVN, TEE TCB SVN, TDX module identity) and the TD attributes (debug, reserved bits,
   migration are refused by the library). Refusals map to codes (``tdx_dcap.DCAP_REFUSALS``):
   Revoked → ``tdx_tcb_revoked``, no matching level → ``tdx_tcb_unsupported``, …
6. Both parsers read the same TD report, field by field: what the policy sees was signed.
7. Normalise into the policy input's ``tee`` section (the shape of ``claims.ita_tee``).

The caller checks the report data binding (``VerifiedRawEvidence.report_data``).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.x509.oid import NameOID

from broker.attestation.raw import VerifiedRawEvidence, unsigned_sections
from broker.attestation.raw.tdx_collateral import PCK_CAS, TdxCollateral, check_fresh
from broker.attestation.raw.tdx_dcap import DcapVerdict, check_same_report, dcap_verify, pck_fmspc
from broker.attestation.raw.tdx_quote import TdxQuote, parse_quote
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.x509chain import load_pem_chain

MAX_PCK_CHAIN = 4  # Intel's is 3: PCK leaf, PCK Platform/Processor CA, root
QE_REPORT_DATA = slice(320, 352)  # SGX REPORT: report_data starts at 320; the hash fills 32


@dataclass(frozen=True)
class TdxTrust:
    """The pinned Intel SGX Root CA (from configuration or ``certs/``)."""

    root: x509.Certificate

    @property
    def root_der(self) -> bytes:
        return self.root.public_bytes(serialization.Encoding.DER)


@dataclass(frozen=True)
class AuthenticQuote:
    """A quote whose signatures chain to the pinned root (step 2); collateral not yet seen."""

    quote: TdxQuote
    fmspc: str  # upper-case hex, from the PCK certificate
    ca: str  # "platform" | "processor", from the PCK certificate's issuer


def authenticate_quote(raw_quote: bytes, trust: TdxTrust) -> AuthenticQuote:
    """Steps 1 and 2: parse, then check the quote's signatures up to the pinned root.

    Raises:
        AttestationError: ``tdx_quote_malformed``, ``cert_chain_invalid``,
            ``tdx_quote_invalid``.
    """
    quote = parse_quote(raw_quote)
    chain = load_pem_chain(quote.pck_chain_pem)
    if not 2 <= len(chain) <= MAX_PCK_CHAIN or _der(chain[-1]) != trust.root_der:
        raise _chain("the quote's PCK chain does not end at the pinned Intel SGX Root CA")
    for child, parent in itertools.pairwise(chain):
        try:
            child.verify_directly_issued_by(parent)
        except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm) as exc:
            raise _chain("a PCK chain certificate is not signed by the next one") from exc
    try:
        pck_key = chain[0].public_key()
    except (UnsupportedAlgorithm, ValueError) as exc:
        raise _chain("the PCK key's algorithm is not known") from exc
    if not isinstance(pck_key, ec.EllipticCurvePublicKey):
        raise _chain("the PCK key is not an EC key")
    if not _signed_by(pck_key, quote.qe_report_signature, quote.qe_report):
        raise _invalid("the QE report is not signed by the PCK key")
    commitment = hashlib.sha256(quote.attestation_key + quote.qe_auth_data).digest()
    if quote.qe_report[QE_REPORT_DATA] != commitment:
        raise _invalid("the QE report does not commit to the attestation key")
    try:
        point = b"\x04" + quote.attestation_key
        attestation_key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
    except ValueError as exc:
        raise _invalid("the attestation key is not a P-256 point") from exc
    if not _signed_by(attestation_key, quote.signature, quote.signed):
        raise _invalid("the header and TD report are not signed by the attestation key")
    names = chain[1].subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ca = PCK_CAS.get(str(names[0].value)) if names else None
    if ca is None:
        raise _chain("the PCK certificate's issuer is not a PCK Platform or Processor CA")
    return AuthenticQuote(quote=quote, fmspc=pck_fmspc(quote.pck_chain_pem), ca=ca)


def verify_tdx_quote(
    raw_quote: bytes, collateral: TdxCollateral, *, trust: TdxTrust, now: datetime
) -> VerifiedRawEvidence:
    """Verify a TDX quote against collateral at ``now`` (the checklist above).

    Raises:
        AttestationError: with the code of the first step that failed.
    """
    authentic = authenticate_quote(raw_quote, trust)  # 1, 2
    if (collateral.fmspc, collateral.ca) != (authentic.fmspc, authentic.ca):  # 3
        raise AttestationError(
            f"TDX collateral is for FMSPC {collateral.fmspc} ({collateral.ca}), the quote's "
            f"platform is {authentic.fmspc} ({authentic.ca})",
            code=ErrorCode.TDX_COLLATERAL_INVALID,
        )
    check_fresh(collateral, now)
    _check_anchored(collateral, trust)  # 4
    verdict = dcap_verify(raw_quote, collateral, trust.root_der, now)  # 5
    quote = authentic.quote
    check_same_report(quote)  # 6
    return VerifiedRawEvidence(  # 7
        technology="tdx",
        report_data=quote.report_data,
        tee=tdx_tee(quote, verdict),
        claims=tdx_claims(quote, verdict, collateral),
        verified_at=now,
        init_data_field=("mrconfigid", quote.body["mrconfigid"]),
    )


def _check_anchored(collateral: TdxCollateral, trust: TdxTrust) -> None:
    chains = (
        ("the TCB info issuer chain", collateral.tcb_info_issuer_chain),
        ("the QE identity issuer chain", collateral.qe_identity_issuer_chain),
        ("the PCK CRL issuer chain", collateral.pck_crl_issuer_chain),
    )
    for name, pem in chains:
        chain = load_pem_chain(pem.encode())
        if not chain or _der(chain[-1]) != trust.root_der:
            raise _chain(f"{name} does not end at the pinned Intel SGX Root CA")


def _signed_by(key: ec.EllipticCurvePublicKey, raw_signature: bytes, data: bytes) -> bool:
    """An ECDSA-P256-SHA256 signature in Intel's r‖s form."""
    r, s = int.from_bytes(raw_signature[:32], "big"), int.from_bytes(raw_signature[32:], "big")
    try:
        key.verify(encode_dss_signature(r, s), data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def _chain(problem: str) -> AttestationError:
    return AttestationError(f"TDX: {problem}", code=ErrorCode.CERT_CHAIN_INVALID)


def _invalid(problem: str) -> AttestationError:
    return AttestationError(f"TDX quote: {problem}", code=ErrorCode.TDX_QUOTE_INVALID)


def tdx_tee(quote: TdxQuote, verdict: DcapVerdict) -> dict[str, Any]:
    """The policy input's ``tee`` section for a verified quote: the shape of
    ``claims.ita_tee`` (one policy reads every kind), with ``verifier`` ``local``."""
    body = quote.body
    return {
        **unsigned_sections(),  # issuer "": the chain ends at the pinned Intel SGX Root CA
        "verifier": "local",
        "technology": "tdx",
        "debug": quote.debug,
        "measurements": {
            "mrtd": body["mrtd"].hex(),
            "rtmr": [value.hex() for value in quote.rtmrs],
            "mrseam": body["mrseam"].hex(),
            "mrsignerseam": body["mrsignerseam"].hex(),
            "mrconfigid": body["mrconfigid"].hex(),
            "mrowner": body["mrowner"].hex(),
            "mrownerconfig": body["mrownerconfig"].hex(),
            "report_data": body["report_data"].hex(),
        },
        "tcb_status": verdict.tcb_status,
        "advisory_ids": list(verdict.advisory_ids),
        "quote_version": quote.version,
        "td_attributes": body["td_attributes"].hex(),
        "xfam": body["xfam"].hex(),
    }


def tdx_claims(quote: TdxQuote, verdict: DcapVerdict, collateral: TdxCollateral) -> dict[str, Any]:
    """Every parsed field of the verified quote (``claims.tdx``), hex, plus the collateral
    it was judged with."""
    return {
        "quote_version": quote.version,
        "body_type": quote.body_type,
        "qe_svn": quote.qe_svn,
        "pce_svn": quote.pce_svn,
        **{name: value.hex() for name, value in quote.body.items()},
        "tcb_status": verdict.tcb_status,
        "advisory_ids": list(verdict.advisory_ids),
        "fmspc": collateral.fmspc,
        "pck_ca": collateral.ca,
        "tcb_evaluation_data_number": collateral.tcb_evaluation_data_number,
        "collateral_next_update": collateral.next_update.isoformat(),
        "quote_sha256": hashlib.sha256(quote.raw).hexdigest(),
    }
