"""DCAP collateral for TDX quotes as a value: parsed, with its validity window. Pure.

Collateral is what Intel's PCS (or a PCCS caching it) publishes per platform family (FMSPC) and
PCK CA: the TCB info and the TDX QE identity (JSON, each signed by Intel's TCB signing key, with
the signer's chain), the PCK CRL (with its issuer chain) and the root CA's CRL. Two forms come
in: ``dcap-qvl``'s collateral JSON (files, ``broker verify tdx --collateral``; CRLs and
signatures in hex) and the PCS v4 responses (``collateral_from_pcs``), whose signed JSON is
kept byte for byte as the response carried it (the signature covers those bytes).

**Freshness is explicit**: ``next_update`` is the earliest of the TCB info's and QE identity's
``nextUpdate`` and both CRLs' ``nextUpdate``; ``check_fresh`` refuses collateral past it with
``tdx_collateral_expired`` naming the part, and collateral issued after ``now`` with
``tdx_collateral_invalid``. Nothing here trusts anything: ``raw/tdx.py`` verifies.
"""

from __future__ import annotations

import binascii
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from broker.core.errors import AttestationError, ErrorCode
from broker.core.jsonsafe import loads_bounded

MAX_COLLATERAL_BYTES = 256 * 1024  # a real TDX collateral JSON is 16-19 KiB
COLLATERAL_MEMBERS = (
    "pck_crl_issuer_chain",
    "root_ca_crl",
    "pck_crl",
    "tcb_info_issuer_chain",
    "tcb_info",
    "tcb_info_signature",
    "qe_identity_issuer_chain",
    "qe_identity",
    "qe_identity_signature",
)
HEX_MEMBERS = frozenset({"root_ca_crl", "pck_crl", "tcb_info_signature", "qe_identity_signature"})
# dcap-qvl writes the PCK chain it fetched for quotes without one; the chain verified here is
# always the quote's own, so the member is accepted and never used.
IGNORED_MEMBERS = frozenset({"pck_certificate_chain"})
PCK_CAS = {"Intel SGX PCK Platform CA": "platform", "Intel SGX PCK Processor CA": "processor"}


@dataclass(frozen=True)
class TdxCollateral:
    """Collateral for one FMSPC and PCK CA, with the dates that bound its use."""

    pck_crl_issuer_chain: str
    root_ca_crl: bytes
    pck_crl: bytes
    tcb_info_issuer_chain: str
    tcb_info: str  # the signed JSON text, exactly
    tcb_info_signature: bytes
    qe_identity_issuer_chain: str
    qe_identity: str
    qe_identity_signature: bytes
    fmspc: str  # upper-case hex, from the TCB info
    ca: str  # "platform" | "processor", from the PCK CRL's issuer
    tcb_evaluation_data_number: int
    issued: tuple[tuple[str, datetime], ...]  # (part, issueDate/thisUpdate)
    next_updates: tuple[tuple[str, datetime], ...]  # (part, nextUpdate)

    @property
    def next_update(self) -> datetime:
        """The earliest ``nextUpdate``: past it, this collateral is never used."""
        return min(moment for _, moment in self.next_updates)

    @property
    def not_before(self) -> datetime:
        return max(moment for _, moment in self.issued)


def _invalid(problem: str) -> AttestationError:
    return AttestationError(f"TDX collateral: {problem}", code=ErrorCode.TDX_COLLATERAL_INVALID)


def check_fresh(collateral: TdxCollateral, now: datetime) -> None:
    """Refuse collateral that is not valid at ``now``: at its ``nextUpdate`` instant it has
    expired already (dcap-qvl agrees, and a token judged with it would expire as it is issued).

    Raises:
        AttestationError: ``tdx_collateral_expired`` (a ``nextUpdate`` has come),
            ``tdx_collateral_invalid`` (a part is dated after ``now``).
    """
    for part, moment in collateral.next_updates:
        if now >= moment:
            raise AttestationError(
                f"TDX collateral: {part} nextUpdate {moment.isoformat()} has been reached "
                f"(at {now.isoformat()}); fetch fresh collateral",
                code=ErrorCode.TDX_COLLATERAL_EXPIRED,
            )
    for part, moment in collateral.issued:
        if now < moment:
            raise _invalid(f"{part} is dated {moment.isoformat()}, after {now.isoformat()}")


def parse_collateral_json(data: bytes | str) -> TdxCollateral:
    """``dcap-qvl``'s collateral JSON (``QuoteCollateralV3``).

    Raises:
        AttestationError: ``tdx_collateral_invalid``.
    """
    if len(data) > MAX_COLLATERAL_BYTES:
        raise _invalid(f"larger than {MAX_COLLATERAL_BYTES} bytes")
    try:
        document = loads_bounded(data)
    except ValueError as exc:
        raise _invalid("not JSON") from exc
    if not isinstance(document, dict):
        raise _invalid("not a JSON object")
    unknown = set(document) - set(COLLATERAL_MEMBERS) - IGNORED_MEMBERS
    missing = [name for name in COLLATERAL_MEMBERS if not isinstance(document.get(name), str)]
    if unknown or missing:
        raise _invalid(f"members missing or not strings {missing}, unknown {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name in COLLATERAL_MEMBERS:
        text = document[name]
        values[name] = _hex(text, name) if name in HEX_MEMBERS else text
    return _build(values)


def collateral_from_pcs(
    *,
    tcb_info_body: bytes,
    tcb_info_chain: str,
    qe_identity_body: bytes,
    qe_identity_chain: str,
    pck_crl: bytes,
    pck_crl_chain: str,
    root_ca_crl: bytes,
) -> TdxCollateral:
    """Collateral from the Intel PCS v4 API's answers (``/tdx/certification/v4/tcb``,
    ``…/qe/identity``, ``/sgx/certification/v4/pckcrl``, the root CA CRL); issuer chains as
    the response headers carry them (URL-encoded PEM).

    Raises:
        AttestationError: ``tdx_collateral_invalid``.
    """
    tcb_info, tcb_signature = _signed_member(tcb_info_body, "tcbInfo")
    qe_identity, qe_signature = _signed_member(qe_identity_body, "enclaveIdentity")
    return _build(
        {
            "pck_crl_issuer_chain": unquote(pck_crl_chain),
            "root_ca_crl": crl_der(root_ca_crl, "root CA CRL"),
            "pck_crl": crl_der(pck_crl, "PCK CRL"),
            "tcb_info_issuer_chain": unquote(tcb_info_chain),
            "tcb_info": tcb_info,
            "tcb_info_signature": tcb_signature,
            "qe_identity_issuer_chain": unquote(qe_identity_chain),
            "qe_identity": qe_identity,
            "qe_identity_signature": qe_signature,
        }
    )


def crl_der(body: bytes, what: str) -> bytes:
    """A CRL as DER, from DER, PEM or hex text (a PCCS answers ``rootcacrl`` in hex).

    Raises:
        AttestationError: ``tdx_collateral_invalid``.
    """
    data = body.strip()
    try:
        if data.startswith(b"-----BEGIN"):
            crl = x509.load_pem_x509_crl(data)
            return crl.public_bytes(serialization.Encoding.DER)
        return data if data[:1] == b"\x30" else bytes.fromhex(data.decode("ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _invalid(f"{what} is not DER, PEM or hex") from exc


def _build(values: dict[str, Any]) -> TdxCollateral:
    tcb_info = _json_object(values["tcb_info"], "tcb_info")
    qe_identity = _json_object(values["qe_identity"], "qe_identity")
    root_crl = _crl(values["root_ca_crl"], "root CA CRL")
    pck_crl = _crl(values["pck_crl"], "PCK CRL")
    if tcb_info.get("id") != "TDX" or qe_identity.get("id") != "TD_QE":
        raise _invalid("not TDX collateral (tcbInfo id TDX, QE identity id TD_QE)")
    fmspc = tcb_info.get("fmspc")
    number = tcb_info.get("tcbEvaluationDataNumber")
    if not isinstance(fmspc, str) or len(fmspc) != 12 or not _is_hex(fmspc):
        raise _invalid("tcbInfo fmspc is not 6 bytes of hex")
    if not isinstance(number, int) or isinstance(number, bool):
        raise _invalid("tcbInfo tcbEvaluationDataNumber is not an integer")
    crls = (("root CA CRL", root_crl), ("PCK CRL", pck_crl))
    return TdxCollateral(
        **values,
        fmspc=fmspc.upper(),
        ca=_pck_ca(values["pck_crl_issuer_chain"]),
        tcb_evaluation_data_number=number,
        issued=(
            ("tcbInfo", _date(tcb_info, "issueDate", "tcbInfo")),
            ("QE identity", _date(qe_identity, "issueDate", "QE identity")),
            *((name, crl.last_update_utc) for name, crl in crls),
        ),
        next_updates=(
            ("tcbInfo", _date(tcb_info, "nextUpdate", "tcbInfo")),
            ("QE identity", _date(qe_identity, "nextUpdate", "QE identity")),
            *((name, _crl_next_update(crl, name)) for name, crl in crls),
        ),
    )


def _crl_next_update(crl: x509.CertificateRevocationList, name: str) -> datetime:
    if crl.next_update_utc is None:
        raise _invalid(f"{name} has no nextUpdate")
    return crl.next_update_utc


def _pck_ca(chain_pem: str) -> str:
    try:
        issuer = x509.load_pem_x509_certificates(chain_pem.encode())[0]
    except (ValueError, IndexError) as exc:
        raise _invalid("PCK CRL issuer chain is not PEM") from exc
    names = issuer.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ca = PCK_CAS.get(str(names[0].value)) if names else None
    if ca is None:
        raise _invalid("PCK CRL issuer is neither Intel's platform nor processor PCK CA")
    return ca


def _signed_member(body: bytes, name: str) -> tuple[str, bytes]:
    """The exact text of ``name`` in ``{"<name>": {…}, "signature": "<hex>"}`` and the
    signature's bytes: the signature covers the text as served, not a re-serialisation."""
    try:
        text = body.decode("utf-8")
        loads_bounded(text)  # depth and duplicate members refused before the scan
        members = _member_texts(text)
        signature = json.loads(members["signature"])
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise _invalid(f'PCS answer is not {{"{name}": …, "signature": …}}') from exc
    if name not in members or not isinstance(signature, str):
        raise _invalid(f'PCS answer is not {{"{name}": …, "signature": …}}')
    return members[name], _hex(signature, f"{name} signature")


_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


def _member_texts(text: str) -> dict[str, str]:
    """Each top-level member's value as its source text (the document is valid JSON)."""
    at = _skip(text, 0)
    if text[at : at + 1] != "{":
        raise ValueError("not an object")
    at = _skip(text, at + 1)
    members: dict[str, str] = {}
    while text[at : at + 1] != "}":
        key, at = _DECODER.raw_decode(text, at)
        at = _skip(text, at)
        if not isinstance(key, str) or text[at : at + 1] != ":":
            raise ValueError("not a member")
        start = _skip(text, at + 1)
        _, end = _DECODER.raw_decode(text, start)
        members[key] = text[start:end]
        at = _skip(text, end)
        if text[at : at + 1] == ",":
            at = _skip(text, at + 1)
    return members


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = loads_bounded(text)
    except ValueError as exc:
        raise _invalid(f"{name} is not JSON") from exc
    if not isinstance(value, dict):
        raise _invalid(f"{name} is not a JSON object")
    return value


def _crl(der: bytes, name: str) -> x509.CertificateRevocationList:
    try:
        return x509.load_der_x509_crl(der)
    except ValueError as exc:
        raise _invalid(f"{name} is not a DER CRL") from exc


def _date(document: dict[str, Any], member: str, part: str) -> datetime:
    text = document.get(member)
    try:
        moment = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError as exc:
        raise _invalid(f"{part} {member} is not an RFC 3339 time") from exc
    if not isinstance(text, str) or moment.tzinfo is None:
        raise _invalid(f"{part} {member} is not an RFC 3339 time")
    return moment.astimezone(UTC)


def _hex(text: str, name: str) -> bytes:
    try:
        return binascii.unhexlify(text)
    except (binascii.Error, ValueError) as exc:
        raise _invalid(f"{name} is not hex") from exc


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)
