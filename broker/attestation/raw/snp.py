"""Verify an AMD SEV-SNP attestation report against pinned AMD roots. Pure: the report, the
VCEK/VLEK certificate, the trust anchors and ``now`` in, a :class:`VerifiedRawEvidence` out, or
an ``AttestationError`` with a stable code. Where the certificates come from (the guest's
``cert_chain``, files, AMD's key distribution service) is ``raw/snp_certs.py``'s business.

The checks, in order (AMD 56860 *SEV-SNP Firmware ABI*, §7.3 and Table 23; AMD 57230
*VCEK Certificate and KDS Interface Specification*, §2-3; AMD 58369 *VLEK*):

1. The report parses (1184 bytes, version 2 or 3): ``snp_report_malformed`` /
   ``snp_report_version_unsupported``.
2. It is signed, by a VCEK or a VLEK, with ECDSA P-384/SHA-384 (SIGNATURE_ALGO 1, MASK_CHIP_KEY
   0, SIGNING_KEY 0 or 1): ``snp_signing_key_unsupported``.
3. The endorsement key's certificate is the one SIGNING_KEY names (CN ``SEV-VCEK`` /
   ``SEV-VLEK``), holds a P-384 key, and is issued (RSA-PSS) by an ASK (VCEK) or ASVK (VLEK)
   that a pinned ARK issued; each of the three is valid at ``now``; a version 3 report's CPUID
   names the same product as the root: ``snp_cert_chain_invalid``.
4. The certificate's TCB extensions (bootloader, TEE, SNP, microcode, and FMC on Turin) are the
   report's REPORTED_TCB: ``snp_tcb_mismatch``.
5. A VCEK's hardware id is the report's CHIP_ID (unless the firmware masked it):
   ``snp_chip_id_mismatch``.
6. The report's signature over bytes 0x000-0x29F verifies with that key:
   ``snp_signature_invalid``.
7. The report was asked for from a VMPL no higher than allowed: ``snp_vmpl_refused``.

Checks 4 and 5 run before the signature on purpose: a stale or foreign certificate (a TCB update,
another host's VCEK) is the usual operator mistake, and it would otherwise read as a bad
signature. They only compare; nothing of the report is used before check 6 passes. The caller
compares ``report_data`` with the binding it expects; the policy judges the rest.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.utils import CryptographyDeprecationWarning
from cryptography.x509.oid import NameOID

from broker.attestation.raw import VerifiedRawEvidence, unsigned_sections
from broker.attestation.raw.snp_report import (
    PLATFORM_BITS,
    POLICY_BITS,
    PRODUCTS,
    SIG_ALGO_ECDSA_P384_SHA384,
    TURIN,
    SnpReport,
    bits,
)
from broker.core.errors import AttestationError, ErrorCode

TECHNOLOGY = "sev-snp"
AMD_OID = "1.3.6.1.4.1.3704.1"
# VCEK/VLEK extensions (AMD 57230 Table 8): SPLs of the TCB the key was derived for
TCB_OIDS = {
    "bootloader": f"{AMD_OID}.3.1",
    "tee": f"{AMD_OID}.3.2",
    "snp": f"{AMD_OID}.3.3",
    "microcode": f"{AMD_OID}.3.8",
    "fmc": f"{AMD_OID}.3.9",  # Turin only
}
HWID_OID = f"{AMD_OID}.4"
HWID_BYTES = {"Milan": 64, "Genoa": 64, TURIN: 8}  # how much of CHIP_ID a VCEK names
VEK_NAMES = {"vcek": "SEV-VCEK", "vlek": "SEV-VLEK"}
PEM_MARK = b"-----BEGIN CERTIFICATE-----"
_CHAIN_ERRORS = (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm)


@dataclass(frozen=True)
class SnpTrust:
    """Pinned ARKs by product (``Milan``, ``Genoa``, ``Turin``) and the intermediates (ASK,
    ASVK) that may sit under them; an intermediate counts only if a pinned ARK issued it."""

    roots: Mapping[str, x509.Certificate]
    intermediates: Sequence[x509.Certificate]


def load_certificate(data: bytes) -> x509.Certificate:
    """One certificate, DER or PEM.

    AMD issues every VCEK with serial number 0, which ``cryptography`` still loads but warns
    about (RFC 5280 wants a positive serial); the warning is expected here and silenced for
    this call only. Reading ``serial_number`` warns again: nothing here does.

    Raises:
        ValueError: not a certificate.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        if PEM_MARK in data:
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)


def load_certificates(data: bytes) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle (text between them is ignored), or the one of a DER
    file.

    Raises:
        ValueError: no certificate.
    """
    if PEM_MARK not in data:
        return [load_certificate(data)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        return x509.load_pem_x509_certificates(data)


def trust_from_pem(roots: bytes, intermediates: bytes) -> SnpTrust:
    """Pinned ARKs (each self-signed, named ``ARK-<product>``) and the ASKs/ASVKs under them.

    Raises:
        ValueError: a root that is not a self-signed AMD root of a known product, or no root.
    """
    pinned: dict[str, x509.Certificate] = {}
    for ark in load_certificates(roots):
        product = common_name(ark).removeprefix("ARK-")
        if product not in PRODUCTS or not _issued(ark, ark):
            raise ValueError(f"{common_name(ark)!r} is not a self-signed AMD root (ARK-<product>)")
        pinned[product] = ark
    return SnpTrust(roots=pinned, intermediates=tuple(load_certificates(intermediates)))


def find_vek(report: SnpReport, candidates: Sequence[x509.Certificate]) -> x509.Certificate | None:
    """The first VCEK/VLEK among ``candidates`` for this report: of the key SIGNING_KEY names,
    certified for its REPORTED_TCB and (a VCEK) its chip. Unverified: the checks follow."""
    name = VEK_NAMES.get(report.signing_key or "")
    for cert in candidates:
        product = common_name_of_issuer(cert).removeprefix("SEV-").removeprefix("VLEK-")
        if common_name(cert) != name or product not in PRODUCTS:
            continue
        try:
            _tcb_matches(cert, report.tcbs(product)["reported_tcb"].as_json(), product)
            if name == VEK_NAMES["vcek"] and not report.chip_id_masked:
                _chip_id_matches(cert, report.chip_id, product)
        except AttestationError:
            continue
        return cert
    return None


def verify_snp_report(
    report: SnpReport,
    vek: x509.Certificate,
    trust: SnpTrust,
    *,
    now: datetime,
    max_vmpl: int = 0,
) -> VerifiedRawEvidence:
    """Run checks 2-7 of the module docstring on a parsed report (check 1).

    Raises:
        AttestationError: with the code of the first check that fails.
    """
    kind = _signing_key(report)
    product, ark = _chain(report, kind, vek, trust, now)
    _tcb_matches(vek, report.tcbs(product)["reported_tcb"].as_json(), product)
    if kind == "vcek" and not report.chip_id_masked:
        _chip_id_matches(vek, report.chip_id, product)
    _signature(report, vek)
    if report.vmpl > max_vmpl:
        raise AttestationError(
            f"the report was asked for from VMPL {report.vmpl}; at most {max_vmpl} is accepted",
            code=ErrorCode.SNP_VMPL_REFUSED,
        )
    return _verified(report, product=product, kind=kind, ark=ark, now=now)


def _signing_key(report: SnpReport) -> str:
    kind = report.signing_key
    if report.sig_algo != SIG_ALGO_ECDSA_P384_SHA384 or report.mask_chip_key or kind is None:
        raise AttestationError(
            "the report is not signed by a VCEK or VLEK with ECDSA P-384 (SIGNATURE_ALGO "
            f"{report.sig_algo}, KEY_INFO {report.key_info:#x})",
            code=ErrorCode.SNP_SIGNING_KEY_UNSUPPORTED,
        )
    return kind


def _chain(
    report: SnpReport, kind: str, vek: x509.Certificate, trust: SnpTrust, now: datetime
) -> tuple[str, x509.Certificate]:
    """The product and pinned ARK the endorsement key chains to (check 3)."""
    if common_name(vek) != VEK_NAMES[kind]:
        raise _chain_invalid(
            f"the report is signed by its {kind.upper()}, not by {common_name(vek)!r}"
        )
    try:  # the guest may send any certificate: an algorithm cryptography lacks is not a bug
        key = vek.public_key()
    except (UnsupportedAlgorithm, ValueError) as exc:
        raise _chain_invalid("the endorsement key's algorithm is not known") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise _chain_invalid("the endorsement key is not an ECDSA P-384 key")
    for middle in trust.intermediates:
        if middle.subject != vek.issuer or not _issued(vek, middle):
            continue
        for product, ark in trust.roots.items():
            expected = f"SEV-{product}" if kind == "vcek" else f"SEV-VLEK-{product}"
            if common_name(middle) == expected and _issued(middle, ark):
                return _product(report, product, (vek, middle, ark), now), ark
    raise _chain_invalid(f"the {kind.upper()} does not chain to a pinned AMD root")


def _issued(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)  # RSA-PSS (SHA-384) for every AMD chain
    except _CHAIN_ERRORS:
        return False
    return True


def _product(
    report: SnpReport, product: str, chain: Sequence[x509.Certificate], now: datetime
) -> str:
    for cert in chain:
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise _chain_invalid(
                f"{common_name(cert)!r} is valid from {cert.not_valid_before_utc.isoformat()} "
                f"to {cert.not_valid_after_utc.isoformat()}, not at {now.isoformat()}"
            )
    if report.product_hint not in (None, product):
        raise _chain_invalid(
            f"the report's CPU is {report.product_hint}, its key chains to {product}"
        )
    return product


def _signature(report: SnpReport, vek: x509.Certificate) -> None:
    r, s = report.signature_rs
    key = vek.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)  # noqa: S101 - _chain checked it
    try:
        key.verify(encode_dss_signature(r, s), report.signed_bytes, ec.ECDSA(hashes.SHA384()))
    except (InvalidSignature, ValueError) as exc:
        raise AttestationError(
            "the report's signature does not verify with its endorsement key",
            code=ErrorCode.SNP_SIGNATURE_INVALID,
        ) from exc


def _tcb_matches(vek: x509.Certificate, reported: Mapping[str, Any], product: str) -> None:
    for name, oid in TCB_OIDS.items():
        if name == "fmc" and product != TURIN:
            continue
        certified = _der_uint(_extension(vek, oid))
        if certified is None:
            raise _chain_invalid(f"the endorsement key's {name} SPL extension is not an integer")
        if certified != reported[name]:
            raise AttestationError(
                f"the endorsement key is for {name} SPL {certified}, the report's "
                f"REPORTED_TCB says {reported[name]}",
                code=ErrorCode.SNP_TCB_MISMATCH,
            )


def _chip_id_matches(vek: x509.Certificate, chip_id: bytes, product: str) -> None:
    size = HWID_BYTES[product]
    value = _extension(vek, HWID_OID)
    # Older VCEKs hold the id itself, newer ones a DER OCTET STRING of it (AMD 57230 Table 8).
    if len(value) == size + 2 and value[:2] == bytes([0x04, size]):
        value = value[2:]
    if len(value) != size:
        raise _chain_invalid("the VCEK's hardware id extension is malformed")
    if value != chip_id[:size]:
        raise AttestationError(
            "the VCEK is another chip's: its hardware id is not the report's CHIP_ID",
            code=ErrorCode.SNP_CHIP_ID_MISMATCH,
        )


def _extension(cert: x509.Certificate, oid: str) -> bytes:
    try:
        found = cert.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid)).value
    except (x509.ExtensionNotFound, ValueError) as exc:
        raise _chain_invalid(f"the endorsement key has no usable extension {oid}") from exc
    if not isinstance(found, x509.UnrecognizedExtension):
        raise _chain_invalid(f"the endorsement key's extension {oid} is not AMD's")
    return found.value


def _der_uint(value: bytes) -> int | None:
    """A DER INTEGER of at most 4 content bytes, non-negative (``02 01 0a`` → 10)."""
    if len(value) < 3 or value[0] != 0x02 or value[1] != len(value) - 2 or value[1] > 4:
        return None
    return None if value[2] & 0x80 else int.from_bytes(value[2:], "big")


def common_name(cert: x509.Certificate) -> str:
    return _cn(cert.subject)


def common_name_of_issuer(cert: x509.Certificate) -> str:
    return _cn(cert.issuer)


def _cn(name: x509.Name) -> str:
    names = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if len(names) == 1 else ""


def _chain_invalid(message: str) -> AttestationError:
    return AttestationError(message, code=ErrorCode.SNP_CERT_CHAIN_INVALID)


def _verified(
    report: SnpReport, *, product: str, kind: str, ark: x509.Certificate, now: datetime
) -> VerifiedRawEvidence:
    """The policy input's ``tee`` section (the shape of ``claims.ita_tee``; docs/policy.md)
    and every parsed field as ``claims``."""
    tcbs = {name: tcb.as_json() for name, tcb in report.tcbs(product).items()}
    tee = {
        **unsigned_sections(),
        "verifier": "local",
        "issuer": common_name(ark),  # ARK-Milan, ARK-Genoa, ARK-Turin
        "technology": TECHNOLOGY,
        "debug": report.debug,
        "measurements": report.digests(),
        "tcb": tcbs["reported_tcb"],
        # AMD publishes no TCB status service: tcb_status stays "" (docs/policy.md), and a
        # policy compares ``tcb`` with minimum SPLs instead.
        "product": product,
        "signing_key": kind,
        "vmpl": report.vmpl,
        "guest_svn": report.guest_svn,
    }
    claims = {
        "version": report.version,
        "product": product,
        "signing_key": kind,
        "guest_svn": report.guest_svn,
        "vmpl": report.vmpl,
        "policy": {
            "value": report.policy,
            "abi_major": report.policy >> 8 & 0xFF,
            "abi_minor": report.policy & 0xFF,
            **bits(report.policy, POLICY_BITS),
        },
        "platform_info": {
            "value": report.platform_info,
            **bits(report.platform_info, PLATFORM_BITS),
        },
        "cpuid": list(report.cpuid) if report.cpuid else None,
        **tcbs,
        **report.identity(),
        **report.digests(),
    }
    return VerifiedRawEvidence(
        technology=TECHNOLOGY, report_data=report.report_data, tee=tee, claims=claims,
        verified_at=now, init_data_field=("host_data", report.host_data),
    )  # fmt: skip
