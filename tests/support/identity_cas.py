"""Workload-certificate CAs the development helper does not make (issue 32 tests): a root of
any key type the bundle may carry (EC P-256/P-384/P-521, RSA) or may not (Ed25519), and an EC
P-256 intermediate valid over any window (one that expires within seconds, one not valid yet),
written where ``[identity]`` reads them (``ca-chain.pem``, ``ca.key``, ``root.pem``).
Fixed-purpose, not a general CA: ``broker/dev/identity_ca.py`` is what deployments use."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import NameOID

from broker.dev.tls import CA_KEY_USAGE
from broker.dev.workspace import private_pem


def root_key(kind: str) -> CertificateIssuerPrivateKeyTypes:
    """A new private key of ``kind``: ``P-256``, ``P-384``, ``P-521``, ``RSA-<bits>`` or
    ``Ed25519``."""
    if kind == "Ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    if kind.startswith("RSA-"):
        return rsa.generate_private_key(public_exponent=65537, key_size=int(kind[4:]))
    curves = {"P-256": ec.SECP256R1(), "P-384": ec.SECP384R1(), "P-521": ec.SECP521R1()}
    return ec.generate_private_key(curves[kind])


def ca_certificate(
    name: str,
    public: x509.Certificate | CertificateIssuerPrivateKeyTypes,
    signer: CertificateIssuerPrivateKeyTypes,
    *,
    issuer: x509.Name | None = None,
    valid: tuple[datetime, datetime],
    path_length: int,
) -> x509.Certificate:
    """A CA certificate named ``name`` for ``public``'s key, signed by ``signer`` (self-signed
    when ``issuer`` is None), valid from ``valid[0]`` until ``valid[1]``."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    key = public.public_key()
    algorithm = None if isinstance(signer, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer or subject)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .sign(signer, algorithm)
    )


@dataclass(frozen=True)
class IssuingCa:
    """A root and the P-256 intermediate it signed (whose key signs leaves)."""

    root: x509.Certificate
    intermediate: x509.Certificate
    key: ec.EllipticCurvePrivateKey  # the intermediate's

    def write(self, directory: Path) -> None:
        """``ca-chain.pem`` (intermediate, root), ``ca.key``, ``root.pem`` under ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        pem = serialization.Encoding.PEM
        (directory / "root.pem").write_bytes(self.root.public_bytes(pem))
        (directory / "ca-chain.pem").write_bytes(
            self.intermediate.public_bytes(pem) + self.root.public_bytes(pem)
        )
        (directory / "ca.key").write_bytes(private_pem(self.key))
        (directory / "ca.key").chmod(0o600)


def make_issuing_ca(
    now: datetime,
    *,
    root: str = "P-256",
    name: str = "test",
    intermediate: tuple[timedelta, timedelta] = (timedelta(minutes=-5), timedelta(days=30)),
    root_until: timedelta = timedelta(days=365),
) -> IssuingCa:
    """A ``root``-keyed root valid from five minutes before ``now`` for ``root_until``, and an
    intermediate valid from ``now + intermediate[0]`` to ``now + intermediate[1]``."""
    signer = root_key(root)
    root_certificate = ca_certificate(
        f"{name} root",
        signer,
        signer,
        valid=(now - timedelta(minutes=5), now + root_until),
        path_length=1,
    )
    key = ec.generate_private_key(ec.SECP256R1())
    issued = ca_certificate(
        f"{name} intermediate",
        key,
        signer,
        issuer=root_certificate.subject,
        valid=(now + intermediate[0], now + intermediate[1]),
        path_length=0,
    )
    return IssuingCa(root_certificate, issued, key)
