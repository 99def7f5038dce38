"""What a peer runner presented in an mTLS handshake, judged (issue 32): its leaf, its one
SPIFFE ID, the attestation its leaf names, and a stable code for every refusal. Pure: no I/O, the
time passed in; ``broker.client.mtls`` runs ``verdict`` inside the handshake and the helpers.

Refusal codes (``PeerRefused.code``, docs/runner.md "Refusal codes"):

* in the handshake: ``peer_no_certificate``, ``peer_untrusted`` (the chain does not verify
  against the trust bundle: another trust domain's CA, a retired root, a bad signature),
  ``peer_certificate_expired``, ``peer_certificate_not_yet_valid``, ``peer_session_resumed``,
  ``peer_no_spiffe_id``, ``peer_not_allowed``, ``peer_handshake_failed`` (any other TLS failure),
  ``peer_attestation_unchecked`` (a ``require_live_attestation`` context used without the
  helpers that make that check);
* after it, at the broker: ``peer_attestation_revoked``, ``peer_attestation_unknown``,
  ``peer_certificate_unknown``.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable

from cryptography import x509

from broker.crypto.svid import attestation_of

SPIFFE_SCHEME = "spiffe://"
# OpenSSL's verification results (include/openssl/x509_vfy.h), read from SSLCertVerificationError
X509_V_ERR_CERT_NOT_YET_VALID = 9
X509_V_ERR_CERT_HAS_EXPIRED = 10
NO_CLIENT_CERTIFICATE = "PEER_DID_NOT_RETURN_A_CERTIFICATE"  # OpenSSL's reason on a server

Connection = ssl.SSLObject | ssl.SSLSocket
Peer = bytes | x509.Certificate | Connection | None


class PeerRefused(Exception):
    """A peer runner refused, with its stable ``code`` (the module's list) and, once known, the
    SPIFFE ID it presented."""

    def __init__(self, code: str, message: str, spiffe_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.spiffe_id = spiffe_id


class HandshakeRefused(ssl.SSLError):
    """Raised from inside a handshake that OpenSSL completed but this SDK refused (an
    ``ssl.SSLError``, so asyncio, aiohttp and ``ssl`` treat it as a failed handshake and close
    the connection); ``refused`` says why."""

    def __init__(self, refused: PeerRefused) -> None:
        super().__init__(str(refused))
        self.refused = refused
        self.strerror = str(refused)  # what aiohttp's connection errors print


def peer_leaf(peer: Peer) -> x509.Certificate:
    """The peer's leaf: given, as DER, or read from a connection.

    Raises:
        PeerRefused: ``peer_no_certificate``; ``peer_untrusted`` (not a certificate).
    """
    if isinstance(peer, x509.Certificate):
        return peer
    der = peer.getpeercert(binary_form=True) if isinstance(peer, Connection) else peer
    if not der:
        raise PeerRefused("peer_no_certificate", "the peer presented no certificate")
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise PeerRefused("peer_untrusted", "the peer's certificate does not parse") from exc


def spiffe_id_of(leaf: x509.Certificate) -> str:
    """The leaf's one ``spiffe://`` URI SAN (X509-SVID §2: exactly one URI).

    Raises:
        PeerRefused: ``peer_no_spiffe_id``.
    """
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise PeerRefused("peer_no_spiffe_id", "the peer's certificate names no URI") from exc
    uris = san.value.get_values_for_type(x509.UniformResourceIdentifier)
    if len(uris) != 1 or not uris[0].startswith(SPIFFE_SCHEME):
        raise PeerRefused("peer_no_spiffe_id", "an SVID carries exactly one spiffe:// URI")
    return uris[0]


def peer_spiffe_id(ssl_object: Connection | None) -> str:
    """The one ``spiffe://`` URI SAN of a connection's peer.

    Raises:
        PeerRefused: ``peer_no_certificate`` (no TLS, no certificate), ``peer_no_spiffe_id``.
    """
    return spiffe_id_of(peer_leaf(ssl_object))


def peer_attestation_jti(peer: Peer) -> str:
    """The ``jti`` in the attestation extension of the peer's leaf.

    Raises:
        PeerRefused: ``peer_no_certificate``, ``peer_attestation_unknown``.
    """
    certificate = peer_leaf(peer)
    try:
        value = attestation_of(certificate)
        jti = json.loads(value)["jti"] if value is not None else None
    except (ValueError, TypeError, KeyError) as exc:
        raise PeerRefused("peer_attestation_unknown", "unreadable attestation extension") from exc
    if not isinstance(jti, str) or not jti:
        raise PeerRefused("peer_attestation_unknown", "the certificate names no attestation")
    return jti


def verdict(connection: Connection | None, accept: Callable[[str], bool], now: float) -> str:
    """The SPIFFE ID of a connection's peer once its handshake is done, if ``accept`` (a
    predicate on it) allows it. OpenSSL has checked the chain against the bundle and its
    dates; this checklist runs after it:

    1. Not a resumed session: a resumed TLS 1.3 session (RFC 8446 §2.2) carries the first
       handshake's peer certificate, never verified again; this SDK's servers issue no
       tickets, so only a foreign server can offer one.
    2. The peer presented a leaf.
    3. The leaf is valid at ``now`` (again: a long handshake, or a resumed one).
    4. It carries exactly one ``spiffe://`` URI (X509-SVID §2).
    5. ``accept`` allows that ID (answers ``True``: anything else refuses).

    Raises:
        PeerRefused: ``peer_session_resumed``, ``peer_no_certificate``,
            ``peer_certificate_not_yet_valid``, ``peer_certificate_expired``,
            ``peer_no_spiffe_id``, ``peer_not_allowed``.
    """
    if connection is not None and connection.session_reused:
        raise PeerRefused("peer_session_resumed", "a resumed TLS session is not accepted")
    leaf = peer_leaf(connection)
    if now < leaf.not_valid_before_utc.timestamp():
        raise PeerRefused(
            "peer_certificate_not_yet_valid", "the peer's certificate is not valid yet"
        )
    if now >= leaf.not_valid_after_utc.timestamp():
        raise PeerRefused("peer_certificate_expired", "the peer's certificate has expired")
    spiffe_id = spiffe_id_of(leaf)
    if accept(spiffe_id) is not True:
        raise PeerRefused("peer_not_allowed", f"{spiffe_id} is not allowed", spiffe_id)
    return spiffe_id


def refusal_of(error: ssl.SSLError) -> PeerRefused:
    """The stable code of a failed handshake (ours, or OpenSSL's verification)."""
    if isinstance(error, HandshakeRefused):
        return error.refused
    if isinstance(error, ssl.SSLCertVerificationError):
        message = error.verify_message or str(error)
        if error.verify_code == X509_V_ERR_CERT_HAS_EXPIRED:
            return PeerRefused("peer_certificate_expired", message)
        if error.verify_code == X509_V_ERR_CERT_NOT_YET_VALID:
            return PeerRefused("peer_certificate_not_yet_valid", message)
        return PeerRefused("peer_untrusted", message)
    reason = getattr(error, "reason", None)
    if reason == NO_CLIENT_CERTIFICATE:
        return PeerRefused("peer_no_certificate", "the peer presented no certificate")
    return PeerRefused("peer_handshake_failed", str(reason or error))
