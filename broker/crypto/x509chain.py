"""Certificate chains to pinned anchors. Pure: certificates + anchors + ``now`` in.

Two validators, chosen by the chain's family:

* ``verify_chain`` — RFC 5280 path validation by ``cryptography``'s X.509 verifier (the same
  Rust code that validates TLS chains), used for every chain it can validate: Confidential
  Space PKI tokens, Intel Trust Authority signing keys, NVIDIA device identity chains. Vendor
  chains are not WebPKI, so, as sigstore-python does, the policy is relaxed as narrowly as real
  chains need (docs/evidence.md): the end-entity may lack SAN/KU/EKU (Google's leaf has none), and a
  CA may carry an EKU of its own (Google's intermediate carries TCG's 2.23.133.8.1). Everything
  else — basic constraints and path length, CA key usage ``keyCertSign``, unknown critical
  extensions, validity, signature algorithms and key sizes — is the library's.
* ``verify_chain_legacy_encoding`` — a hand-written link-by-link walk, **only** for NVIDIA RIM
  signer chains: their certificates encode validity dates before 2050 as GeneralizedTime, which
  RFC 5280 §4.1.2.5 forbids and ``cryptography``'s verifier rightly refuses. It applies the
  same rules itself (pathLen, keyCertSign, no unknown critical extension, validity) and is
  tested rule by rule with crafted chains (tests/unit/test_x509_chains.py).
"""

from __future__ import annotations

import base64
import binascii
import itertools
from collections.abc import Sequence
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.verification import (
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from broker.core.errors import AttestationError, ErrorCode

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


def _relaxed_policies() -> tuple[ExtensionPolicy, ExtensionPolicy]:
    ca = ExtensionPolicy.webpki_defaults_ca().may_be_present(
        x509.ExtendedKeyUsage, Criticality.AGNOSTIC, None
    )
    return ca, ExtensionPolicy.permit_all()


_CA_POLICY, _EE_POLICY = _relaxed_policies()


def verify_chain(
    leaf: x509.Certificate,
    intermediates: Sequence[x509.Certificate],
    anchors: Sequence[x509.Certificate],
    *,
    now: datetime,
) -> list[x509.Certificate]:
    """Validate ``leaf`` through ``intermediates`` to one of ``anchors`` at ``now`` (RFC 5280,
    by ``cryptography``'s verifier with the narrow relaxations in the module docstring).

    Returns:
        The validated chain, leaf first, ending with the anchor.

    Raises:
        AttestationError: ``cert_chain_invalid`` with the verifier's reason.
    """
    if not anchors:
        raise AttestationError("no trust anchor configured", code=ErrorCode.CERT_CHAIN_INVALID)
    if len(intermediates) + 1 > MAX_CHAIN_DEPTH:
        raise AttestationError("certificate chain is too long", code=ErrorCode.CERT_CHAIN_INVALID)
    verifier = (
        PolicyBuilder()
        .store(Store(list(anchors)))
        .time(now)
        .max_chain_depth(MAX_CHAIN_DEPTH)
        .extension_policies(ca_policy=_CA_POLICY, ee_policy=_EE_POLICY)
        .build_client_verifier()
    )
    try:
        verified = verifier.verify(leaf, list(intermediates))
    except VerificationError as exc:
        raise AttestationError(
            f"certificate chain does not validate: {exc}", code=ErrorCode.CERT_CHAIN_INVALID
        ) from exc
    return list(verified.chain)


def verify_chain_legacy_encoding(
    leaf: x509.Certificate,
    intermediates: Sequence[x509.Certificate],
    anchors: Sequence[x509.Certificate],
    *,
    now: datetime,
) -> list[x509.Certificate]:
    """Validate a chain whose dates break RFC 5280's encoding rule (NVIDIA RIM signers only).

    Link by link: each certificate's issuer name is the next one's subject and its signature
    verifies with the next one's key; every issuer is a CA (BasicConstraints ``ca=True``) whose
    ``pathLenConstraint`` allows the intermediates below it and whose KeyUsage includes
    ``keyCertSign``; no certificate has a critical extension we do not process; every
    certificate, the anchor included, is valid at ``now``; the chain ends at a pinned anchor
    (identical certificate, or issued by one).

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
    for cert in chain:
        _check_critical_extensions(cert)
    for depth, (child, parent) in enumerate(itertools.pairwise(chain)):
        _check_link(child, parent, depth)
    for cert in chain:
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise AttestationError(
                f"certificate {cert.subject.rfc4514_string()} is not valid at {now.isoformat()}",
                code=ErrorCode.CERT_CHAIN_INVALID,
            )
    return chain


# Critical extensions the legacy walk processes; any other critical one fails (RFC 5280 §4.2).
_PROCESSED_CRITICAL = frozenset(
    {
        x509.BasicConstraints.oid,
        x509.KeyUsage.oid,
        x509.ExtendedKeyUsage.oid,
        x509.SubjectAlternativeName.oid,
    }
)


def _check_critical_extensions(cert: x509.Certificate) -> None:
    unknown = [e.oid.dotted_string for e in cert.extensions if e.critical]
    unknown = [oid for oid in unknown if x509.ObjectIdentifier(oid) not in _PROCESSED_CRITICAL]
    if unknown:
        raise AttestationError(
            f"{cert.subject.rfc4514_string()} has unprocessed critical extensions {unknown}",
            code=ErrorCode.CERT_CHAIN_INVALID,
        )


def _check_link(child: x509.Certificate, parent: x509.Certificate, depth: int) -> None:
    """``depth``: how many intermediates stand between ``parent`` and the leaf (0: it issued
    the leaf) — what RFC 5280 §4.2.1.9's pathLenConstraint bounds."""
    name = child.subject.rfc4514_string()
    try:
        constraints = parent.extensions.get_extension_for_class(x509.BasicConstraints).value
        usage = parent.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound as exc:
        raise AttestationError(
            f"issuer of {name} lacks basic constraints or key usage",
            code=ErrorCode.CERT_CHAIN_INVALID,
        ) from exc
    if not constraints.ca or (
        constraints.path_length is not None and depth > constraints.path_length
    ):
        raise AttestationError(
            f"issuer of {name} may not issue at this depth", code=ErrorCode.CERT_CHAIN_INVALID
        )
    if not usage.key_cert_sign:
        raise AttestationError(
            f"issuer of {name} may not sign certificates (key usage)",
            code=ErrorCode.CERT_CHAIN_INVALID,
        )
    try:
        child.verify_directly_issued_by(parent)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise AttestationError(
            f"{name} is not signed by {parent.subject.rfc4514_string()}",
            code=ErrorCode.CERT_CHAIN_INVALID,
        ) from exc
