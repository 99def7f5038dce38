"""SPIFFE X.509-SVIDs (issue 32): the CSR a runner sends, checked; the leaf certificate's
to-be-signed part, built to the X.509-SVID profile; the certificate assembled around a
signature made elsewhere (a PEM key, Cloud KMS, PKCS#11: ``signers/results.py``'s port); the
trust bundle in its JWKS and PEM forms.

Profile (SPIFFE X509-SVID §4, §5): exactly one URI SAN, ``spiffe://<trust domain>/<path>``; the
leaf is not a CA (``basicConstraints`` CA:false, critical), ``keyUsage`` digitalSignature
(critical), ``extendedKeyUsage`` serverAuth and clientAuth, no wildcard, an empty subject. One
private, non-critical extension (``ATTESTATION_OID``) carries the attestation's ``jti`` and the
identity policy's digest as canonical JSON.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID

from broker.core.encoding import b64url_encode, canonical
from broker.core.errors import ErrorCode, InputError
from broker.crypto.jwk import public_jwk, thumbprint

# The private extension's OID: under 1.3.6.1.4.1.32473, the enterprise number IANA reserves for
# documentation (RFC 5612), until this project has its own; the value is canonical JSON
# {"jti", "policy_digest"}. Not 2.25.<UUID> (X.667): Go's crypto/x509 reads each arc into an int
# and refuses the whole certificate for a 128-bit arc (go-spiffe could not load our SVIDs)
ATTESTATION_OID = x509.ObjectIdentifier("1.3.6.1.4.1.32473.32.1")
MAX_CSR_BYTES = 8 * 1024
# a leaf is valid from this long before it was issued (never before its CA): a peer whose clock
# is a little behind the broker's accepts it at once
NOT_BEFORE_BACKDATE = timedelta(seconds=30)
# a SPIFFE ID path: segments of [A-Za-z0-9._-], no empty, "." or ".." segment (SPIFFE ID §2.2)
# (``fullmatch`` only: ``$`` also matches before a trailing newline)
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_TRUST_DOMAIN = re.compile(r"[a-z0-9._-]{1,255}")
# ecdsa-with-SHA256 (RFC 5758 §3.2): the AlgorithmIdentifier of every certificate signed here
_ECDSA_SHA256 = bytes.fromhex("300a06082a8648ce3d040302")


class CsrRefused(InputError):
    """A CSR the broker does not certify (400, its own code)."""

    default_code = ErrorCode.CSR_INVALID


def valid_trust_domain(name: str) -> bool:
    """A SPIFFE trust domain name (SPIFFE ID §2.1): lower-case letters, digits, ``.``, ``-``
    and ``_``, 1 to 255 characters, neither starting nor ending with a dot."""
    return bool(_TRUST_DOMAIN.fullmatch(name)) and "." not in (name[0], name[-1])


def spiffe_id(trust_domain: str, path: str) -> str:
    """``spiffe://<trust domain>/<path>``.

    Raises:
        ValueError: ``trust_domain`` is no trust domain name, or ``path`` is not a SPIFFE ID
            path (empty, a bad segment, a wildcard).
    """
    if not valid_trust_domain(trust_domain):
        raise ValueError(f"{trust_domain[:300]!r} is not a SPIFFE trust domain name")
    segments = path.strip("/").split("/") if path.strip("/") else []
    if not segments or len(path) > 2048:
        raise ValueError("the SPIFFE ID path is empty or too long")
    for segment in segments:
        if segment in (".", "..") or not _SEGMENT.fullmatch(segment):
            raise ValueError(f"the SPIFFE ID path segment {segment!r} is not allowed")
    return f"spiffe://{trust_domain}/{'/'.join(segments)}"


def load_csr(text: str) -> x509.CertificateSigningRequest:
    """A PKCS#10 CSR as PEM or standard/url-safe base64 of its DER.

    Raises:
        CsrRefused: ``csr_invalid`` (not a CSR), ``csr_key_invalid`` (a key algorithm or curve
            ``cryptography`` cannot read), ``csr_signature_invalid``.
    """
    if len(text) > MAX_CSR_BYTES * 2:
        raise CsrRefused(f"csr is longer than {MAX_CSR_BYTES} bytes")
    try:
        if text.lstrip().startswith("-----BEGIN"):
            csr = x509.load_pem_x509_csr(text.encode("ascii"))
        else:
            raw = text.strip().replace("-", "+").replace("_", "/")
            csr = x509.load_der_x509_csr(base64.b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, UnicodeEncodeError, binascii.Error) as exc:
        raise CsrRefused("csr is not a PKCS#10 request (PEM or base64 DER)") from exc
    _readable_key(csr)  # an unknown key algorithm or curve: the key's fault, before its signature
    try:
        signed = csr.is_signature_valid
    except UnsupportedAlgorithm as exc:
        raise CsrRefused(
            "the CSR's signature algorithm is not supported", code=ErrorCode.CSR_SIGNATURE_INVALID
        ) from exc
    if not signed:
        raise CsrRefused(
            "the CSR's signature does not verify with its own key",
            code=ErrorCode.CSR_SIGNATURE_INVALID,
        )
    return csr


def csr_key(csr: x509.CertificateSigningRequest, pop_thumbprint: str) -> ec.EllipticCurvePublicKey:
    """The CSR's key: P-256, and not the result's proof-of-possession key.

    Raises:
        CsrRefused: ``csr_key_invalid`` (another kind of key), ``csr_key_is_pop_key``.
    """
    key = _readable_key(csr)
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise CsrRefused("the CSR's key must be an EC P-256 key", code=ErrorCode.CSR_KEY_INVALID)
    if thumbprint(public_jwk(key)) == pop_thumbprint:
        raise CsrRefused(
            "the CSR's key is the result's proof-of-possession key; make a new key for the "
            "certificate",
            code=ErrorCode.CSR_KEY_IS_POP_KEY,
        )
    return key


def _readable_key(csr: x509.CertificateSigningRequest) -> CertificatePublicKeyTypes:
    """Raises: CsrRefused ``csr_key_invalid``: a key ``cryptography`` cannot read (an unknown
    algorithm or curve OID is ``UnsupportedAlgorithm``, not ``ValueError``)."""
    try:
        return csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CsrRefused(
            "the CSR's key cannot be read (an unsupported algorithm or curve): make an EC P-256 "
            "key",
            code=ErrorCode.CSR_KEY_INVALID,
        ) from exc


def csr_names(csr: x509.CertificateSigningRequest) -> list[str]:
    """The URIs the CSR asks for in a subjectAltName extension request (the SAN is the
    policy's; the CSR may name none or this very SPIFFE ID)."""
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    except ValueError as exc:
        raise CsrRefused("the CSR's extensions cannot be read") from exc
    return [str(name.value) for name in san]


@dataclass(frozen=True)
class LeafProfile:
    spiffe_id: str
    not_before: datetime
    not_after: datetime
    serial: int
    attestation_jti: str
    policy_digest: str


def new_serial() -> int:
    """A positive serial with 120 random bits (CA/B BR §7.1: at least 64)."""
    return uuid.uuid4().int >> 8 | 1 << 119


def leaf_tbs(
    profile: LeafProfile,
    key: ec.EllipticCurvePublicKey,
    issuer: x509.Certificate,
) -> bytes:
    """The leaf's TBSCertificate (DER), signature algorithm ecdsa-with-SHA256. Made with a
    throw-away P-256 key (``cryptography`` signs only with keys it holds); only its TBS part is
    kept, to be signed by the CA's key wherever it lives."""
    extension = canonical({"jti": profile.attestation_jti, "policy_digest": profile.policy_digest})
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(issuer.subject)
        .public_key(key)
        .serial_number(profile.serial)
        .not_valid_before(profile.not_before)
        .not_valid_after(profile.not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(profile.spiffe_id)]),
            critical=True,  # RFC 5280 §4.2.1.6: critical when the subject is empty
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(
                issuer.public_key()  # type: ignore[arg-type]
            ),
            critical=False,
        )
        .add_extension(x509.UnrecognizedExtension(ATTESTATION_OID, extension), critical=False)
    )
    throwaway = ec.generate_private_key(ec.SECP256R1())
    return builder.sign(throwaway, hashes.SHA256()).tbs_certificate_bytes


def assemble(tbs: bytes, signature_der: bytes) -> x509.Certificate:
    """Certificate ::= SEQUENCE { tbs, ecdsa-with-SHA256, BIT STRING signature } (RFC 5280)."""
    bits = _der(0x03, b"\x00" + signature_der)
    return x509.load_der_x509_certificate(_der(0x30, tbs + _ECDSA_SHA256 + bits))


def _der(tag: int, content: bytes) -> bytes:
    length = len(content)
    if length < 0x80:
        return bytes([tag, length]) + content
    octets = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(octets)]) + octets + content


def attestation_of(certificate: x509.Certificate) -> bytes | None:
    """The private extension's value (canonical JSON), if the certificate has one."""
    try:
        extension = certificate.extensions.get_extension_for_oid(ATTESTATION_OID)
    except x509.ExtensionNotFound:
        return None
    value = extension.value
    return value.value if isinstance(value, x509.UnrecognizedExtension) else None


def pem(certificates: Sequence[x509.Certificate]) -> str:
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode() for c in certificates)


# the JWK ``crv`` of each curve an authority's key may be on (RFC 7518 §6.2.1.1)
_JWK_CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
MIN_RSA_BITS = 2048


def authority_jwk(authority: x509.Certificate) -> dict[str, str]:
    """The public JWK (RFC 7517/7518 members) of an X.509 authority's key: EC P-256, P-384 or
    P-521 (``x`` and ``y`` padded to the curve's size, RFC 7518 §6.2.1.2), or RSA of at least
    ``MIN_RSA_BITS`` bits.

    Raises:
        ValueError: any other key (another curve, Ed25519, a short RSA key): ``load_ca``
            refuses such an authority at start-up.
    """
    key = authority.public_key()
    if isinstance(key, rsa.RSAPublicKey) and key.key_size >= MIN_RSA_BITS:
        return public_jwk(key)
    if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name in _JWK_CURVES:
        numbers = key.public_numbers()
        size = (key.curve.key_size + 7) // 8
        return {
            "crv": _JWK_CURVES[key.curve.name],
            "kty": "EC",
            "x": b64url_encode(numbers.x.to_bytes(size, "big")),
            "y": b64url_encode(numbers.y.to_bytes(size, "big")),
        }
    kind = key.curve.name if isinstance(key, ec.EllipticCurvePublicKey) else type(key).__name__
    raise ValueError(
        f"an authority's key must be EC P-256, P-384, P-521 or RSA of at least {MIN_RSA_BITS} "
        f"bits, not {kind}"
    )


def bundle_jwks(
    authorities: Sequence[x509.Certificate], *, sequence: int, refresh: int
) -> dict[str, object]:
    """The SPIFFE bundle (SPIFFE Trust Domain and Bundle §4): one ``x509-svid`` JWK per X.509
    authority (``authority_jwk``), its certificate in ``x5c``, in the order given (the PEM form
    lists the same authorities in the same order).

    Raises:
        ValueError: an authority whose key ``authority_jwk`` does not express.
    """
    keys = [
        {
            **authority_jwk(authority),
            "use": "x509-svid",
            "x5c": [base64.b64encode(authority.public_bytes(serialization.Encoding.DER)).decode()],
        }
        for authority in authorities
    ]
    return {"spiffe_sequence": sequence, "spiffe_refresh_hint": refresh, "keys": keys}
