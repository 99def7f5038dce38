"""X.509-SVIDs for the runner SDK's mTLS tests (issue 32) without a broker: a development CA
(``broker/dev/identity_ca.py``) signs leaves for any SPIFFE ID and validity window, and
``LocalIssuer`` answers an ``Identity``'s CSRs and bundle requests as the broker's
``POST /v1/identity`` and ``GET /v1/identity/bundle?format=pem`` would, or with the errors a
test queues. The TLS on top is real (OpenSSL on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.client import BrokerClientError
from broker.client.identity import Identity
from broker.client.mtls import LiveCheck
from broker.crypto.svid import ATTESTATION_OID
from broker.dev.identity_ca import DevIdentityCa, make_dev_identity_ca


@dataclass(frozen=True)
class SigningCa:
    """A development CA held in memory: its intermediate's key, the chain, the root."""

    key: ec.EllipticCurvePrivateKey
    chain: bytes  # intermediate, then root (PEM)
    root_pem: str

    @classmethod
    def load(cls, ca: DevIdentityCa) -> SigningCa:
        """Read the files of ``ca`` (blocking)."""
        key = serialization.load_pem_private_key(ca.key.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return cls(key, ca.chain.read_bytes(), ca.root.read_text())

    @classmethod
    def make(cls, directory: Path, trust_domain: str) -> SigningCa:
        """A new development root and intermediate under ``directory`` (blocking)."""
        return cls.load(make_dev_identity_ca(directory, trust_domain, now=datetime.now(UTC)))

    def leaf(
        self,
        spiffe_id: str,
        public_key: ec.EllipticCurvePublicKey,
        *,
        not_before: datetime,
        not_after: datetime,
        attestation: bytes | None = None,
    ) -> bytes:
        """A leaf for ``spiffe_id`` signed by the intermediate, then the chain (PEM); with
        ``attestation``, that value in the broker's attestation extension."""
        issuer = x509.load_pem_x509_certificates(self.chain)[0]
        builder = x509.CertificateBuilder()
        if attestation is not None:
            builder = builder.add_extension(
                x509.UnrecognizedExtension(ATTESTATION_OID, attestation), False
            )
        leaf = (
            builder.subject_name(x509.Name([]))
            .issuer_name(issuer.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_id)]), True
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
            .sign(self.key, hashes.SHA256())
        )
        return leaf.public_bytes(serialization.Encoding.PEM) + self.chain

    def key_and_chain(
        self,
        spiffe_id: str,
        *,
        lifetime: timedelta,
        starts: timedelta,
        attestation: bytes | None = None,
    ) -> bytes:
        """A new P-256 key's leaf (``leaf``) and chain, then the key (unencrypted PEM), for
        ``load_cert_chain`` in a client that is not an ``Identity``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        chain = self.leaf(
            spiffe_id,
            key.public_key(),
            not_before=now + starts,
            not_after=now + lifetime,
            attestation=attestation,
        )
        return chain + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


@dataclass
class LocalIssuer:
    """Issues leaves from ``ca`` (switch it to rotate), serves ``roots`` as the bundle, and
    raises the queued ``failures`` first, one a request."""

    ca: SigningCa
    roots: list[SigningCa]
    lifetime: timedelta = timedelta(minutes=10)  # not_after, from now
    starts: timedelta = timedelta(minutes=-1)  # not_before, from now
    failures: list[BrokerClientError] = field(default_factory=list)
    requests: int = 0

    def identity(self, spiffe_id: str, peer_check: LiveCheck | None = None) -> Identity:
        """An ``Identity`` for ``spiffe_id`` (no certificate yet: ``await .renew()``)."""
        return Identity(self.issue_for(spiffe_id), self.bundle, peer_check)

    def issue_for(self, spiffe_id: str) -> Callable[[str], Any]:
        async def issue(csr_pem: str) -> dict[str, Any]:
            self.requests += 1
            if self.failures:
                raise self.failures.pop(0)
            csr = x509.load_pem_x509_csr(csr_pem.encode())
            public = csr.public_key()
            assert isinstance(public, ec.EllipticCurvePublicKey)
            now = datetime.now(UTC)
            chain = self.ca.leaf(
                spiffe_id,
                public,
                not_before=now + self.starts,
                not_after=now + self.lifetime,
            )
            return {"certificates": chain.decode(), "spiffe_id": spiffe_id}

        return issue

    async def bundle(self) -> str:
        return "".join(ca.root_pem for ca in self.roots)


def broker_error(status: int, code: str) -> BrokerClientError:
    """What the SDK raises for a broker answer ``status``/``code`` (0: no answer)."""
    return BrokerClientError(status, code, "from the test", {})
