"""A development SPIFFE CA for ``[identity]``: a root and an intermediate under it, both EC
P-256, the intermediate's key a PEM file (``ca.key``, 0600) and its chain ``ca-chain.pem``
(intermediate first, root last), the root ``root.pem``. ``make_dev_identity_chain`` certifies
an intermediate key that lives elsewhere (Cloud KMS, a PKCS#11 token) from its public half.

DEVELOPMENT ONLY: in production the intermediate's key lives in Cloud KMS or an HSM and the
root stays offline with the operator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from broker.dev.tls import CA_KEY_USAGE

ROOT_DAYS = 3650
INTERMEDIATE_DAYS = 365


@dataclass(frozen=True)
class DevIdentityCa:
    chain: Path  # intermediate, then root
    key: Path  # the intermediate's key
    root: Path


@dataclass(frozen=True)
class DevIdentityChain:
    """A development root and an intermediate whose key is kept elsewhere (KMS, HSM)."""

    chain: Path  # intermediate, then root
    root: Path


def _ca(
    name: str,
    trust_domain: str,
    key: ec.EllipticCurvePublicKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | ec.EllipticCurvePrivateKey,
    *,
    now: datetime,
    days: int,
    path_length: int,
) -> x509.Certificate:
    """A CA certificate for ``key``, signed by ``issuer`` (its name and key), or self-signed
    (``issuer`` is then ``key``'s private half)."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "broker dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    issuer_name, issuer_key = issuer if isinstance(issuer, tuple) else (subject, issuer)
    builder = x509.CertificateBuilder()
    if isinstance(issuer, tuple):  # RFC 5280 §4.2.1.1: names its root among same-named ones
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    return (
        builder.subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(
            CA_KEY_USAGE,
            critical=True,
        )
        # SPIFFE X509-SVID §4.1: a signing certificate may name its trust domain
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"spiffe://{trust_domain}")]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key), critical=False)
        .sign(issuer_key, hashes.SHA256())
    )


def make_dev_identity_ca(directory: Path, trust_domain: str, *, now: datetime) -> DevIdentityCa:
    """Write ``root.pem``, ``ca-chain.pem`` and ``ca.key`` (0600) under ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    chain = make_dev_identity_chain(directory, trust_domain, key.public_key(), now=now)
    paths = DevIdentityCa(chain.chain, directory / "ca.key", chain.root)
    descriptor = os.open(paths.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return paths


def make_dev_identity_chain(
    directory: Path, trust_domain: str, ca_key: ec.EllipticCurvePublicKey, *, now: datetime
) -> DevIdentityChain:
    """Write ``root.pem`` and ``ca-chain.pem`` under ``directory``: a new development root and
    the intermediate it certifies for ``ca_key``, the public half of an ``[identity] ca_key``
    kept in Cloud KMS or on a PKCS#11 token. No intermediate key is written; the root's key is
    not kept (this root certifies this one intermediate)."""
    directory.mkdir(parents=True, exist_ok=True)
    root_key = ec.generate_private_key(ec.SECP256R1())
    root = _ca(
        "broker dev SPIFFE root",
        trust_domain,
        root_key.public_key(),
        root_key,
        now=now,
        days=ROOT_DAYS,
        path_length=1,
    )
    intermediate = _ca(
        "broker dev SPIFFE intermediate",
        trust_domain,
        ca_key,
        (root.subject, root_key),
        now=now,
        days=INTERMEDIATE_DAYS,
        path_length=0,
    )
    paths = DevIdentityChain(directory / "ca-chain.pem", directory / "root.pem")
    pem = serialization.Encoding.PEM
    paths.root.write_bytes(root.public_bytes(pem))
    paths.chain.write_bytes(intermediate.public_bytes(pem) + root.public_bytes(pem))
    return paths
