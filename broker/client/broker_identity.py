"""Verify the broker's own attestation (``GET /.well-known/broker-attestation``). Pure.

A client that trusts a broker only after this check knows it talks to the expected broker image
running in a Confidential Space TEE, over a TLS connection whose server key that TEE made.

Checklist (docs/runner.md "Verifying the broker"; the endpoint format of issue 29), each failure
a ``BrokerNotAttested`` naming its ``check``:

1. ``response``: the answer is a JSON object of bounded size; ``attested`` is true (else the
   broker's own ``reason`` is quoted: ``attested``); ``token`` is a string; ``keys`` maps names
   to base64url SubjectPublicKeyInfo DER and holds ``tls`` (``keys``).
2. ``signature``: the token's JOSE header passes the project's header rules
   (``crypto/jose.py``: RS256 only, ``kid`` required, no ``jku``/``x5u``/``jwk``/``crit``).
   OIDC form: the key named by ``kid`` in the configured JWKS (never one the token brings);
   PKI form (``x5c``): the chain validates at ``now`` to the configured root, the leaf is
   RSA-2048 or larger and ``kid`` is its RFC 7638 thumbprint. Then the RS256 signature.
3. ``times``: ``exp``/``nbf``/``iat`` against ``now`` with one leeway; lifetime bounded.
4. ``issuer``: ``iss`` equals the configured issuer (Google's by default).
5. ``audience``: ``aud`` is, or contains, the configured audience (when one is configured).
6. ``debug``: ``dbgstat`` is ``disabled-since-boot`` (a debug image lets its operator in).
7. ``software``: ``swname`` is ``CONFIDENTIAL_SPACE`` and its ``support_attributes`` hold
   ``STABLE`` (a supported launcher image; the KEK's federation condition requires it too).
8. ``image``: ``submods.container.image_digest`` is one of the allowed digests.
9. ``nonce``: ``eat_nonce`` holds the lowercase hex SHA-256 of every key in ``keys``.
10. ``tls``: the SubjectPublicKeyInfo of the certificate the server presented on this very
    connection equals ``keys.tls`` (a relay with its own certificate and a copy of the
    attestation fails here).

The PKI chain policy is the service's own (``crypto/x509chain.py``), imported, not repeated.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt import PyJWK, PyJWKError

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.core.jsonsafe import loads_bounded
from broker.crypto import jose
from broker.crypto.jwk import public_jwk, thumbprint
from broker.crypto.x509chain import load_b64_der, verify_chain

GOOGLE_ISSUER = "https://confidentialcomputing.googleapis.com"
MAX_ATTESTATION_BYTES = 64 * 1024
TLS_TRUST = frozenset({"ca", "attestation"})
MAX_KEYS = 8
MAX_CHAIN = 5
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
TIME_CODES = frozenset(
    {
        ErrorCode.TOKEN_EXPIRED,
        ErrorCode.TOKEN_NOT_YET_VALID,
        ErrorCode.TOKEN_ISSUED_IN_FUTURE,
        ErrorCode.TOKEN_CLAIM_INVALID,
    }
)


class BrokerNotAttested(Exception):
    """The broker's attestation failed ``check`` (a step of the module checklist)."""

    def __init__(self, check: str, reason: str) -> None:
        super().__init__(f"{check}: {reason}")
        self.check = check
        self.reason = reason


@dataclass(frozen=True)
class BrokerIdentity:
    """What a client expects of the broker: its image and the attestation trust anchors.

    ``jwks``: the issuer's JSON Web Key Set (OIDC tokens); ``root_pem``: the issuer's root
    certificate (PKI tokens); one of them at least. ``audience``: the broker's token audience
    (``[sealed] token_audience``); ``None`` leaves ``aud`` unchecked. ``tls_trust``: ``"ca"``
    (the connection's certificate must also chain to the client's CAs and name the host) or
    ``"attestation"`` (a sealed broker's self-signed certificate, made in its TEE: trusted only
    because the attestation binds its key, check 10; no CA the operator controls is involved).

    Raises:
        ValueError: no trust anchor, no image digest, or a digest not ``sha256:<64 hex>``.
    """

    image_digests: frozenset[str]
    jwks: str | bytes | None = None
    root_pem: str | bytes | None = None
    audience: str | None = None
    issuer: str = GOOGLE_ISSUER
    leeway: timedelta = jose.DEFAULT_LEEWAY
    tls_trust: str = "ca"

    def __post_init__(self) -> None:
        if self.tls_trust not in TLS_TRUST:
            raise ValueError(f"tls_trust must be one of {sorted(TLS_TRUST)}")
        if self.jwks is None and self.root_pem is None:
            raise ValueError("BrokerIdentity needs jwks (OIDC) or root_pem (PKI)")
        if not self.image_digests:
            raise ValueError("BrokerIdentity needs at least one allowed image digest")
        bad = sorted(d for d in self.image_digests if not DIGEST.match(d))
        if bad:
            raise ValueError(f"image digests must be sha256:<64 lowercase hex>: {bad}")


@dataclass(frozen=True)
class VerifiedBrokerIdentity:
    """An attested broker: its image, its bound keys (name -> SPKI DER) and when it expires."""

    image_digest: str
    keys: Mapping[str, bytes]
    expires: datetime
    token_type: str
    claims: Mapping[str, Any] = field(repr=False, default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The report ``broker verify broker`` prints."""
        return {
            "attested": True,
            "image_digest": self.image_digest,
            "token_type": self.token_type,
            "expires": self.expires.isoformat(),
            "keys": {name: b64url_encode(der) for name, der in self.keys.items()},
            "key_sha256": {
                name: hashlib.sha256(der).hexdigest() for name, der in self.keys.items()
            },
        }


def verify_broker_attestation(
    body: bytes, server_cert_der: bytes, identity: BrokerIdentity, *, now: datetime
) -> VerifiedBrokerIdentity:
    """Run the module checklist on the endpoint's answer and the connection's certificate.

    Raises:
        BrokerNotAttested: the first failed check, with its reason.
    """
    token, keys = parse_answer(body)
    claims, token_type = verify_token(token, identity, now=now)
    check_claims(claims, identity)
    digest = claims["submods"]["container"]["image_digest"]
    check_nonces(claims, keys)
    check_tls(server_cert_der, keys["tls"])
    return VerifiedBrokerIdentity(
        image_digest=str(digest),
        keys=MappingProxyType(dict(keys)),
        expires=datetime.fromtimestamp(float(claims["exp"]), UTC),
        token_type=token_type,
        claims=MappingProxyType(dict(claims)),
    )


def parse_answer(body: bytes) -> tuple[str, dict[str, bytes]]:
    """Step 1: the token and the keys (name -> canonical SPKI DER).

    Raises:
        BrokerNotAttested: ``response``, ``attested`` or ``keys``.
    """
    if len(body) > MAX_ATTESTATION_BYTES:
        raise BrokerNotAttested("response", "the attestation answer exceeds the size limit")
    try:
        answer = loads_bounded(body)
    except ValueError as exc:
        raise BrokerNotAttested("response", "the attestation answer is not JSON") from exc
    if not isinstance(answer, dict):
        raise BrokerNotAttested("response", "the attestation answer is not a JSON object")
    if answer.get("attested") is not True:
        reason = answer.get("reason")
        said = f": {reason[:200]}" if isinstance(reason, str) else ""
        raise BrokerNotAttested("attested", f"the broker says it is not attested{said}")
    token, named = answer.get("token"), answer.get("keys")
    if not isinstance(token, str):
        raise BrokerNotAttested("response", "the attestation answer has no token")
    if not isinstance(named, dict) or not 1 <= len(named) <= MAX_KEYS or "tls" not in named:
        raise BrokerNotAttested("keys", "the attestation answer binds no TLS key")
    return token, {str(name): _spki(name, value) for name, value in named.items()}


def _spki(name: Any, value: Any) -> bytes:
    try:
        key = serialization.load_der_public_key(b64url_decode(str(value)))
    except ValueError as exc:
        raise BrokerNotAttested("keys", f"key {name!r} is not a base64url SPKI DER") from exc
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def verify_token(
    token: str, identity: BrokerIdentity, *, now: datetime
) -> tuple[dict[str, Any], str]:
    """Steps 2-5: signature (OIDC or PKI), times, issuer and audience.

    Raises:
        BrokerNotAttested: ``signature``, ``times``, ``issuer`` or ``audience``.
    """
    try:
        header = jose.parse_header_with_kid(token, ("RS256",))
        if "x5c" in header.fields:
            key, token_type = _pki_key(header, identity, now=now), "PKI"
        else:
            key, token_type = _jwks_key(header, identity), "OIDC"
        verified = jose.verify_jws(
            token, header, key, now=now, leeway=identity.leeway, required_claims=("iss", "exp")
        )
    except AttestationError as exc:
        check = "times" if exc.code in TIME_CODES else "signature"
        raise BrokerNotAttested(check, f"{exc.code.value}: {exc.message}") from exc
    claims = dict(verified.claims)
    if claims.get("iss") != identity.issuer:
        raise BrokerNotAttested("issuer", f"token issuer {claims.get('iss')!r} is not expected")
    aud = claims.get("aud")
    if identity.audience is not None and not (
        aud == identity.audience or (isinstance(aud, list) and identity.audience in aud)
    ):
        raise BrokerNotAttested("audience", f"token audience {aud!r} is not {identity.audience!r}")
    return claims, token_type


def _jwks_key(header: jose.UnverifiedHeader, identity: BrokerIdentity) -> Any:
    if identity.jwks is None:
        raise BrokerNotAttested("signature", "an OIDC token, but no JWKS is configured")
    try:
        document = json.loads(identity.jwks)
        entries = [e for e in document.get("keys", []) if e.get("kid") == header.kid]
    except (ValueError, AttributeError) as exc:
        raise BrokerNotAttested("signature", "the configured JWKS is not a key set") from exc
    if (
        len(entries) != 1
        or entries[0].get("kty") != "RSA"
        or entries[0].get("alg", "RS256") != "RS256"
    ):
        raise BrokerNotAttested("signature", "the token's kid names no RS256 key of the JWKS")
    try:
        key = PyJWK(entries[0]).key
    except PyJWKError as exc:
        raise BrokerNotAttested("signature", f"the JWKS key is unusable: {exc}") from exc
    if not isinstance(key, rsa.RSAPublicKey) or key.key_size < 2048:
        raise BrokerNotAttested("signature", "the JWKS key is not RSA-2048 or larger")
    return key


def _pki_key(
    header: jose.UnverifiedHeader, identity: BrokerIdentity, *, now: datetime
) -> rsa.RSAPublicKey:
    if identity.root_pem is None:
        raise BrokerNotAttested("signature", "a PKI token, but no root certificate is configured")
    pem = identity.root_pem.encode() if isinstance(identity.root_pem, str) else identity.root_pem
    roots = x509.load_pem_x509_certificates(pem)
    x5c = header.fields["x5c"]
    if not isinstance(x5c, list) or not 2 <= len(x5c) <= MAX_CHAIN:
        raise BrokerNotAttested("signature", "x5c must list the leaf, intermediate and root")
    try:  # the root the token brings is only a hint: validation ends at the configured root
        chain = [load_b64_der(str(c)) for c in x5c]
        verify_chain(chain[0], [c for c in chain[1:] if c not in roots], roots, now=now)
    except AttestationError as exc:  # the one chain policy (crypto/x509chain.py)
        raise BrokerNotAttested("signature", f"x5c: {exc.message}") from exc
    leaf = chain[0].public_key()
    if not isinstance(leaf, rsa.RSAPublicKey) or leaf.key_size < 2048:
        raise BrokerNotAttested("signature", "the PKI leaf key is not RSA-2048 or larger")
    if header.kid != thumbprint(public_jwk(leaf)):
        raise BrokerNotAttested("signature", "kid is not the thumbprint of the x5c leaf key")
    return leaf


def check_claims(claims: Mapping[str, Any], identity: BrokerIdentity) -> None:
    """Steps 6-8: not a debug image, Confidential Space, an allowed image digest.

    Raises:
        BrokerNotAttested: ``debug``, ``software`` or ``image``.
    """
    if claims.get("dbgstat") != "disabled-since-boot":
        raise BrokerNotAttested("debug", f"dbgstat is {claims.get('dbgstat')!r}: a debug image")
    if claims.get("swname") != "CONFIDENTIAL_SPACE":
        raise BrokerNotAttested("software", f"swname is {claims.get('swname')!r}")
    submods = claims.get("submods")
    space = submods.get("confidential_space") if isinstance(submods, dict) else None
    support = space.get("support_attributes") if isinstance(space, dict) else None
    if not isinstance(support, list) or "STABLE" not in support:  # as the KEK's WIF condition
        raise BrokerNotAttested(
            "software", f"the Confidential Space image is not STABLE-supported ({support!r})"
        )
    container = submods.get("container") if isinstance(submods, dict) else None
    digest = container.get("image_digest") if isinstance(container, dict) else None
    if digest not in identity.image_digests:
        raise BrokerNotAttested("image", f"the broker runs image {digest!r}, not an allowed one")


def check_nonces(claims: Mapping[str, Any], keys: Mapping[str, bytes]) -> None:
    """Step 9: every bound key's SHA-256 (lowercase hex) is one of the token's nonces.

    Raises:
        BrokerNotAttested: ``nonce``.
    """
    nonces = claims.get("eat_nonce")
    listed = (
        {nonces} if isinstance(nonces, str) else set(nonces) if isinstance(nonces, list) else set()
    )
    missing = sorted(n for n, der in keys.items() if hashlib.sha256(der).hexdigest() not in listed)
    if missing:
        raise BrokerNotAttested("nonce", f"eat_nonce does not bind the key(s) {missing}")


def check_tls(server_cert_der: bytes, tls_spki: bytes) -> None:
    """Step 10: the connection's server key is the attested TLS key.

    Raises:
        BrokerNotAttested: ``tls``.
    """
    try:
        presented = x509.load_der_x509_certificate(server_cert_der).public_key()
    except ValueError as exc:
        raise BrokerNotAttested("tls", "the server certificate is not DER X.509") from exc
    spki = presented.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if spki != tls_spki:
        raise BrokerNotAttested(
            "tls", "the TLS server key is not the attested one (a relay or another server)"
        )
