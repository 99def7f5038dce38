"""Answers of ``GET /.well-known/broker-attestation`` minted by the development issuer (issue 29).

The answer format is the one agreed for the broker's endpoint: ``attested``, ``token`` (a
GCA-shaped token whose ``eat_nonce`` lists the hex SHA-256 of each bound key's SPKI DER),
``token_type``, ``keys`` (name -> base64url SPKI DER) and ``expires``. PKI-form tokens are
signed by a leaf under a test root (``pki_issuer``), shaped like Google's: ``x5c`` = leaf,
intermediate, root; ``kid`` = RFC 7638 thumbprint of the leaf key.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from broker.core.encoding import b64url_encode
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, Workload
from broker.dev.tls import CA_KEY_USAGE
from tests.support.issuers import dev_issuer

IMAGE = "sha256:" + "b1" * 32  # the broker image its clients expect
OTHER_IMAGE = "sha256:" + "0e" * 32  # a modified broker
AUDIENCE = "https://broker.test"


def spki(key: Any) -> bytes:
    """The SubjectPublicKeyInfo DER of a public (or private) key."""
    public = key.public_key() if hasattr(key, "private_bytes") else key
    return bytes(
        public.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def key_hash(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def mint(
    issuer: DevIssuer,
    keys: dict[str, bytes],
    *,
    image: str = IMAGE,
    debug: bool = False,
    now: datetime,
    lifetime: timedelta = timedelta(hours=1),
    nonces: list[str] | None = None,
) -> str:
    """A GCA-shaped OIDC token binding ``keys`` (or exactly ``nonces``)."""
    bound = nonces if nonces is not None else [key_hash(der) for der in keys.values()]
    return issuer.mint(
        audience=AUDIENCE,
        nonces=bound,
        workload=Workload(image_digest=image, debug=debug),
        now=now,
        lifetime=lifetime,
    )


def answer(token: str, keys: dict[str, bytes], *, token_type: str = "OIDC") -> bytes:
    """The endpoint's JSON for ``token`` and ``keys``."""
    try:
        exp = jwt.decode(token, options={"verify_signature": False})["exp"]
        expires = datetime.fromtimestamp(exp, UTC).isoformat().replace("+00:00", "Z")
    except jwt.DecodeError:  # a tampered token: its answer says what the broker would say
        expires = ""
    return json.dumps(
        {
            "attested": True,
            "token": token,
            "token_type": token_type,
            "keys": {name: b64url_encode(der) for name, der in keys.items()},
            "expires": expires,
        }
    ).encode()


def self_signed(key: ec.EllipticCurvePrivateKey, now: datetime) -> bytes:
    """A DER certificate for ``key`` (what a TLS server presents)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.DER)


def _ca(
    name: str, key: Any, issuer: x509.Certificate | None, signer: Any, now: datetime
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            CA_KEY_USAGE,
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), False
        )
    return builder.sign(signer, hashes.SHA256())


@cache
def pki_issuer(now: datetime) -> tuple[bytes, DevIssuer, list[str]]:
    """A test PKI: the root PEM, an issuer signing with the leaf key, and the ``x5c``."""
    root_key = ec.generate_private_key(ec.SECP384R1())
    root = _ca("test Confidential Space root", root_key, None, root_key, now)
    mid_key = ec.generate_private_key(ec.SECP384R1())
    mid = _ca("test intermediate", mid_key, root, root_key, now)
    leaf_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test signer")]))
        .issuer_name(mid.subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(mid_key.public_key()), False
        )
        .sign(mid_key, hashes.SHA256())
    )
    x5c = [
        base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode()
        for c in (leaf, mid, root)
    ]
    issuer = DevIssuer(dev_mode=True, key=leaf_key)
    issuer.kid = thumbprint(public_jwk(leaf_key.public_key()))
    return root.public_bytes(serialization.Encoding.PEM), issuer, x5c


def pki_token(keys: dict[str, bytes], *, now: datetime, image: str = IMAGE) -> tuple[str, bytes]:
    """A PKI-form token binding ``keys`` and the root PEM it chains to."""
    root_pem, issuer, x5c = pki_issuer(now)
    oidc = mint(issuer, keys, image=image, now=now)
    claims = jwt.decode(oidc, options={"verify_signature": False})
    return issuer.sign(claims, headers={"kid": issuer.kid, "x5c": x5c}), root_pem


__all__ = ["AUDIENCE", "IMAGE", "OTHER_IMAGE", "dev_issuer"]
