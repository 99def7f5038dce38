"""Certificate chains to pinned anchors. Pure: certificates + anchors + ``now`` in.

Vendor chains are unusual (EVIDENCE.md: Google's leaf has no SAN, key usage or EKU; NVIDIA device
certificates expire in 9999; NVIDIA RIM certificates use GeneralizedTime before 2050), so the
checks are explicit and link by link; see ``verify_chain``.
"""

from __future__ import annotations

import base64
import binascii
import itertools
from collections.abc import Sequence
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from broker.errors import AttestationError, ErrorCode

MAX_CHAIN_DEPTH = 8


def load_der(der: bytes) -> x509.Certificate:
    """Parse one DER certificate.

    Raises:
        AttestationError: ``cert_chain_invalid`` when it is not a certificate.
    """
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise AttestationError(
            "certificate is not valid DER", code=ErrorCode.CERT_CHAIN_INVALID
        ) from exc


def load_b64_der(text: str) -> x509.Certificate:
    """Parse one standard-base64 DER certificate (the JOSE ``x5c`` form).

    Raises:
        AttestationError: ``cert_chain_invalid``.
    """
    try:
        return load_der(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise AttestationError(
            "x5c entry is not base64 DER", code=ErrorCode.CERT_CHAIN_INVALID
        ) from exc


def load_pem_chain(pem: bytes) -> list[x509.Certificate]:
    """Parse concatenated PEM certificates (leaf first).

    Raises:
        AttestationError: ``cert_chain_invalid``.
    """
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise AttestationError(
            "certificate chain is not PEM", code=ErrorCode.CERT_CHAIN_INVALID
        ) from exc


def verify_chain(
    leaf: x509.Certificate,
    intermediates: Sequence[x509.Certificate],
    anchors: Sequence[x509.Certificate],
    *,
    now: datetime,
) -> list[x509.Certificate]:
    """Validate ``leaf`` through ``intermediates`` (in order) to one of ``anchors`` at ``now``.

    Link by link: each certificate's issuer name is the next one's subject and its signature
    verifies with the next one's key; every issuer is a CA (BasicConstraints ``ca=True``, path
    length respected); every certificate, the anchor included, is valid at ``now``; the chain
    ends at a pinned anchor (identical certificate, or issued by one). This is used instead of
    ``cryptography``'s RFC 5280 policy verifier because real vendor chains break its strict
    encoding rules (NVIDIA RIM certificates carry GeneralizedTime before 2050).

    Returns:
        The validated chain, leaf first, ending with the anchor.

    Raises:
        AttestationError: ``cert_chain_invalid`` naming the failing link.
    """
    if not anchors:
        raise AttestationError("no trust anchor configured", code=ErrorCode.CERT_CHAIN_INVALID)
    chain = [leaf, *intermediates]
    if len(chain) > MAX_CHAIN_DEPTH:
        raise AttestationError("certificate chain is too long", code=ErrorCode.CERT_CHAIN_INVALID)
    if chain[-1] not in anchors:
        issuer = next((a for a in anchors if a.subject == chain[-1].issuer), None)
        if issuer is None:
            raise AttestationError(
                "certificate chain does not end at a pinned anchor",
                code=ErrorCode.CERT_CHAIN_INVALID,
            )
        chain.append(issuer)
    for depth, (child, parent) in enumerate(itertools.pairwise(chain)):
        _check_link(child, parent, depth)
    for cert in chain:
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise AttestationError(
                f"certificate {cert.subject.rfc4514_string()} is not valid at {now.isoformat()}",
                code=ErrorCode.CERT_CHAIN_INVALID,
            )
    return chain


def _check_link(child: x509.Certificate, parent: x509.Certificate, depth: int) -> None:
    name = child.subject.rfc4514_string()
    try:
        constraints = parent.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound as exc:
        raise AttestationError(
            f"issuer of {name} is not marked as a CA", code=ErrorCode.CERT_CHAIN_INVALID
        ) from exc
    if not constraints.ca or (
        constraints.path_length is not None and depth > constraints.path_length + 1
    ):
        raise AttestationError(
            f"issuer of {name} may not issue at this depth", code=ErrorCode.CERT_CHAIN_INVALID
        )
    try:
        child.verify_directly_issued_by(parent)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise AttestationError(
            f"{name} is not signed by {parent.subject.rfc4514_string()}",
            code=ErrorCode.CERT_CHAIN_INVALID,
        ) from exc
