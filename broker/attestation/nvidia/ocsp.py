"""OCSP for GPU and RIM signer chains, judged here (pure): the adapter only fetches the bytes.

``chain_status`` judges the responses for every certificate of a chain below its root (RFC 6960
§3.2, ``verify_ocsp_response``) and combines them: any ``revoked`` wins, ``good`` only when every
certificate has a good answer, else ``unknown``. Responses are keyed by ``cert_key`` (the
issuer's subject and the certificate's serial), so an answer is only ever judged against the
certificate and issuer it is looked up for.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID

OCSP_LEEWAY = timedelta(minutes=5)
OCSP_MAX_AGE = timedelta(days=1)  # an answer without nextUpdate older than this is stale

CertKey = tuple[bytes, int]  # (issuer subject DER, serial number)


def cert_key(cert: x509.Certificate, issuer: x509.Certificate) -> CertKey:
    return issuer.subject.public_bytes(), cert.serial_number


def ocsp_pairs(
    chain: Sequence[x509.Certificate], *, include_leaf: bool
) -> list[tuple[x509.Certificate, x509.Certificate]]:
    """(certificate, issuer) for every certificate OCSP is asked about, leaf first."""
    return list(itertools.pairwise(chain if include_leaf else chain[1:]))


def chain_status(
    chain: Sequence[x509.Certificate],
    responses: Mapping[CertKey, bytes],
    now: datetime,
    *,
    include_leaf: bool,
) -> str:
    """``good`` | ``revoked`` | ``unknown`` for a chain, from the fetched response bytes."""
    return chain_answer(chain, responses, now, include_leaf=include_leaf).status


def chain_answer(
    chain: Sequence[x509.Certificate],
    responses: Mapping[CertKey, bytes],
    now: datetime,
    *,
    include_leaf: bool,
) -> OcspAnswer:
    """``chain_status`` and the earliest ``nextUpdate`` among the answers it rests on (a result
    made from them must not outlive it)."""
    results, updates = [], []
    for cert, issuer in ocsp_pairs(chain, include_leaf=include_leaf):
        body = responses.get(cert_key(cert, issuer))
        answer = verify_ocsp_response(body, cert, issuer, now=now) if body is not None else None
        results.append(answer.status if answer is not None else "unknown")
        if answer is not None and answer.next_update is not None:
            updates.append(answer.next_update)
    return OcspAnswer(combine_ocsp(results), min(updates) if updates else None)


def combine_ocsp(results: Sequence[str]) -> str:
    """One status for several certificates: any ``revoked`` wins; ``good`` only if all are."""
    if "revoked" in results:
        return "revoked"
    return "good" if results and all(r == "good" for r in results) else "unknown"


@dataclass(frozen=True)
class OcspAnswer:
    status: str  # good | revoked | unknown
    next_update: datetime | None
    why: str = ""


def verify_ocsp_response(  # noqa: PLR0911 - one return per RFC 6960 check
    body: bytes,
    cert: x509.Certificate,
    issuer: x509.Certificate,
    *,
    now: datetime,
    leeway: timedelta = OCSP_LEEWAY,
) -> OcspAnswer:
    """Interpret one OCSP response per RFC 6960 §3.2. Pure; anything off is ``unknown``.

    1. The response is SUCCESSFUL and its single response names ``cert``: serial, and the
       issuer's name and key hashes under the response's hash algorithm (§3.2 item 1).
    2. The signer is the issuer itself, or a delegated responder certificate the issuer signed
       directly that carries the id-kp-OCSPSigning EKU and is valid at ``now`` (§3.2 items 2-3,
       §4.2.2.2).
    3. The signature verifies with the signer's key (§3.2 item 4).
    4. ``thisUpdate`` is not in the future and, with ``nextUpdate``, ``now`` is not past it;
       without ``nextUpdate``, ``thisUpdate`` is at most ``OCSP_MAX_AGE`` old (§3.2 items 5-6,
       §4.2.2.1), each with ``leeway``. An old "good" cannot be replayed.
    """
    try:
        response = ocsp.load_der_ocsp_response(body)
    except ValueError:
        return OcspAnswer("unknown", None, "not a DER OCSP response")
    if response.response_status is not ocsp.OCSPResponseStatus.SUCCESSFUL:
        return OcspAnswer("unknown", None, f"status {response.response_status.name}")
    if not _names_certificate(response, cert, issuer):
        return OcspAnswer("unknown", None, "answer is about another certificate")
    signer = _authorised_signer(response, issuer, now)
    if signer is None:
        return OcspAnswer("unknown", None, "no authorised signer (issuer or OCSP-signing EKU)")
    if not _signed_by(response, signer):
        return OcspAnswer("unknown", None, "signature does not verify")
    this_update = response.this_update_utc
    next_update = response.next_update_utc
    if this_update > now + leeway:
        return OcspAnswer("unknown", None, "thisUpdate is in the future")
    if next_update is not None and now > next_update + leeway:
        return OcspAnswer("unknown", None, "answer is past its nextUpdate (stale)")
    if next_update is None and now - this_update > OCSP_MAX_AGE + leeway:
        return OcspAnswer("unknown", None, "answer without nextUpdate is too old")
    status = response.certificate_status
    if status is ocsp.OCSPCertStatus.REVOKED:
        return OcspAnswer("revoked", next_update)
    if status is ocsp.OCSPCertStatus.GOOD:
        return OcspAnswer("good", next_update)
    return OcspAnswer("unknown", None, "responder does not know the certificate")


def _names_certificate(
    response: ocsp.OCSPResponse, cert: x509.Certificate, issuer: x509.Certificate
) -> bool:
    if response.serial_number != cert.serial_number:
        return False
    algorithm = response.hash_algorithm
    name_hash = hashes.Hash(algorithm)
    name_hash.update(issuer.subject.public_bytes())
    key_bits = issuer.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    key_hash = hashes.Hash(algorithm)
    key_hash.update(_subject_public_key_bits(key_bits))
    return (
        response.issuer_name_hash == name_hash.finalize()
        and response.issuer_key_hash == key_hash.finalize()
    )


def _subject_public_key_bits(spki: bytes) -> bytes:
    """The BIT STRING contents of a SubjectPublicKeyInfo (what CertID's issuerKeyHash hashes)."""
    # SPKI ::= SEQUENCE { algorithm AlgorithmIdentifier, subjectPublicKey BIT STRING }
    _, body = _der_element(spki, 0)
    offset = body
    header, _ = _der_element(spki, offset)  # AlgorithmIdentifier
    offset = header
    _, content_start = _der_element(spki, offset)
    return spki[content_start + 1 :]  # skip the unused-bits byte


def _der_element(data: bytes, offset: int) -> tuple[int, int]:
    """(end of the element at ``offset``, start of its contents)."""
    length = data[offset + 1]
    start = offset + 2
    if length & 0x80:
        count = length & 0x7F
        length = int.from_bytes(data[start : start + count], "big")
        start += count
    return start + length, start


def _authorised_signer(
    response: ocsp.OCSPResponse, issuer: x509.Certificate, now: datetime
) -> x509.Certificate | None:
    if _responder_is(response, issuer):
        return issuer
    for candidate in response.certificates:
        if not _responder_is(response, candidate) or candidate.issuer != issuer.subject:
            continue
        try:
            candidate.verify_directly_issued_by(issuer)
            usage = candidate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
            continue
        in_time = candidate.not_valid_before_utc <= now <= candidate.not_valid_after_utc
        if ExtendedKeyUsageOID.OCSP_SIGNING in usage and in_time:
            return candidate
    return None


def _responder_is(response: ocsp.OCSPResponse, cert: x509.Certificate) -> bool:
    if response.responder_name is not None:
        return response.responder_name == cert.subject
    digest = hashes.Hash(hashes.SHA1())  # noqa: S303 - RFC 6960 ResponderID byKey is SHA-1
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest.update(_subject_public_key_bits(spki))
    return response.responder_key_hash == digest.finalize()


def _signed_by(response: ocsp.OCSPResponse, signer: x509.Certificate) -> bool:
    key = signer.public_key()
    algorithm = response.signature_hash_algorithm
    if algorithm is None:
        return False
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(response.signature, response.tbs_response_bytes, ec.ECDSA(algorithm))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(
                response.signature, response.tbs_response_bytes, padding.PKCS1v15(), algorithm
            )
        else:
            return False
    except InvalidSignature:
        return False
    return True
