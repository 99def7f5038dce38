"""The intermediate CA that issues workload certificates (``[identity]``, issue 32): its
certificate chain from PEM files, its key behind the same ``ResultSigner`` port as the
attestation result key (a PEM file for development, Cloud KMS, PKCS#11), and the trust bundle
it publishes. The key signs each leaf's TBSCertificate; nothing else of it is used here."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.core.records import RecordType
from broker.crypto.jwk import public_jwk, thumbprint
from broker.crypto.svid import assemble, authority_jwk, bundle_jwks, pem
from broker.signers.results import ResultSigner

log = logging.getLogger(__name__)
BUNDLE_REFRESH_SECONDS = 300  # spiffe_refresh_hint: a peer re-reads the bundle this often


@dataclass(frozen=True)
class IdentityCa:
    """The issuing CA: ``chain[0]`` signs leaves (its key is ``signer``), ``chain[-1]`` is the
    root the operator controls; ``previous`` holds authorities a rotation retired."""

    trust_domain: str
    signer: ResultSigner
    chain: tuple[x509.Certificate, ...]
    previous: tuple[x509.Certificate, ...]
    max_lifetime: timedelta

    @property
    def issuer(self) -> x509.Certificate:
        return self.chain[0]

    @property
    def valid_from(self) -> datetime:
        """When every certificate of the issuing chain is valid (the latest ``notBefore``)."""
        return max(c.not_valid_before_utc for c in self.chain)

    @property
    def valid_until(self) -> datetime:
        """When the first certificate of the issuing chain expires: no leaf lives past it."""
        return min(c.not_valid_after_utc for c in self.chain)

    def check_valid(self, now: datetime) -> None:
        """The issuing chain is valid at ``now`` (``load_ca`` refused one that was not at
        start-up; it may expire while the broker runs).

        Raises:
            UpstreamError: ``identity_ca_unavailable``: nothing can be issued until the CA is
                rotated (a leaf under an expired or not yet valid CA verifies nowhere).
        """
        if self.valid_from <= now < self.valid_until:
            return
        log.warning("identity CA: %s", self.expiry_warning(now))
        raise UpstreamError(
            "the identity CA's certificate is not valid now; the operator must rotate it",
            code=ErrorCode.IDENTITY_CA_UNAVAILABLE,
        )

    def expiry_warning(self, now: datetime) -> str | None:
        """What an operator must hear about the CA's validity at ``now`` (logged; ``/readyz``
        warns): not yet valid or expired (nothing is issued), or expiring within
        ``max_lifetime`` (each leaf is cut short at its expiry); ``None`` when all is well."""
        until = self.valid_until.isoformat()
        if now < self.valid_from:
            return f"the identity CA is not valid before {self.valid_from.isoformat()}"
        if now >= self.valid_until:
            return f"the identity CA expired at {until}: no workload certificate is issued"
        if self.valid_until - now <= self.max_lifetime:
            return (
                f"the identity CA expires at {until}, within max_lifetime_seconds: "
                "certificates are cut short; rotate it"
            )
        return None

    @property
    def intermediates(self) -> tuple[x509.Certificate, ...]:
        """What an SVID's chain carries after its leaf: every CA but the root."""
        return self.chain[:-1] if len(self.chain) > 1 else ()

    def authorities(self, now: datetime) -> list[x509.Certificate]:
        """The bundle's X.509 authorities: the root, then each previous one not yet expired."""
        found: list[x509.Certificate] = [self.chain[-1]]
        for certificate in self.previous:
            if certificate not in found and certificate.not_valid_after_utc > now:
                found.append(certificate)
        return found

    def bundle(self, now: datetime) -> dict[str, object]:
        """The SPIFFE bundle (JWKS); ``spiffe_sequence``: the newest authority's start, in
        seconds (it grows when an authority is added)."""
        authorities = self.authorities(now)
        sequence = int(max(a.not_valid_before_utc for a in authorities).timestamp())
        return bundle_jwks(authorities, sequence=sequence, refresh=BUNDLE_REFRESH_SECONDS)

    def bundle_pem(self, now: datetime) -> str:
        return pem(self.authorities(now))

    def change_record(self, *, time: str, trigger: str) -> dict[str, object]:
        """The ``identity_ca`` record of the CA in force: the issuing chain and the retired
        authorities by SHA-256 of their DER, and ``ca_digest`` over them. The log writes it only
        when its newest ``identity_ca`` names another digest (``DecisionLog.append_if_changed``):
        a rotation, or the first start with ``[identity]`` on, is one record per log."""
        chain = [_described(c) for c in self.chain]
        previous = [_described(c) for c in self.previous]
        digest = hashlib.sha256(
            json.dumps(
                {
                    "trust_domain": self.trust_domain,
                    "chain": [c["sha256"] for c in chain],
                    "previous": [c["sha256"] for c in previous],
                },
                sort_keys=True,
                separators=(",", ":"),
            ).encode()
        ).hexdigest()
        return {
            "type": RecordType.IDENTITY_CA,
            "time": time,
            "trigger": trigger,
            "trust_domain": self.trust_domain,
            "ca_digest": "sha256:" + digest,
            "key_thumbprint": self.signer.kid,
            "chain": chain,
            "previous": previous,
        }

    async def sign(self, tbs: bytes) -> x509.Certificate:
        """The certificate of ``tbs``, signed by the CA key wherever it lives.

        Raises:
            UpstreamError: ``identity_ca_unavailable`` (the key service did not sign).
        """
        try:
            raw = await self.signer.sign(tbs)
        except UpstreamError as exc:
            raise UpstreamError(
                "the identity CA's key did not sign; try again",
                code=ErrorCode.IDENTITY_CA_UNAVAILABLE,
            ) from exc
        if len(raw) != 64:
            raise UpstreamError(
                "the identity CA's key answered no P-256 signature",
                code=ErrorCode.IDENTITY_CA_UNAVAILABLE,
            )
        signature = encode_dss_signature(int.from_bytes(raw[:32]), int.from_bytes(raw[32:]))
        try:  # what the key service signed is checked before anyone gets it (a wrong key
            # version, a corrupted answer): a certificate that verifies nowhere is never issued
            certificate = assemble(tbs, signature)
            certificate.verify_directly_issued_by(self.issuer)
        except (ValueError, TypeError, InvalidSignature) as exc:
            log.error(  # noqa: TRY400 - the key service's answer, not a bug: no traceback
                "identity CA: the signed leaf does not verify with the CA certificate's key: %r",
                exc,
            )
            raise UpstreamError(
                "the identity CA's key signed a certificate its CA certificate does not verify",
                code=ErrorCode.IDENTITY_CA_UNAVAILABLE,
            ) from exc
        return certificate


def load_ca(
    *,
    trust_domain: str,
    signer: ResultSigner,
    chain_file: Path,
    previous_files: Sequence[Path],
    max_lifetime: timedelta,
    now: datetime,
) -> IdentityCa:
    """The CA, checked at ``now``; a warning is logged when it expires within
    ``max_lifetime``.

    Raises:
        ConfigError: naming the setting: an unreadable chain, a first certificate that is no
            CA or whose key is not ``signer``'s, a chain that does not chain, a certificate of
            the chain not valid at ``now``, an authority the JWKS bundle cannot carry
            (``svid.authority_jwk``).
    """
    chain = tuple(_certificates(chain_file, "identity.ca_certificates"))
    previous = tuple(
        c for f in previous_files for c in _certificates(f, "identity.previous_ca_certificates")
    )
    issuer = chain[0]
    try:
        constraints = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
        usage = issuer.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound as exc:
        raise ConfigError(
            "identity.ca_certificates", "the CA certificate lacks basicConstraints or keyUsage"
        ) from exc
    if not constraints.ca or not usage.key_cert_sign:
        raise ConfigError(
            "identity.ca_certificates", "the first certificate is not a CA (CA:true, keyCertSign)"
        )
    key = issuer.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or thumbprint(public_jwk(key)) != signer.kid:
        raise ConfigError(
            "identity.ca_key", "is not the key of the first certificate in ca_certificates"
        )
    for child, parent in itertools.pairwise(chain):
        try:
            child.verify_directly_issued_by(parent)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise ConfigError(
                "identity.ca_certificates",
                "the certificates do not chain in order (CA first, root last)",
            ) from exc
    _valid_now(chain, now)
    _expressible(chain[-1:], "identity.ca_certificates")
    _expressible(previous, "identity.previous_ca_certificates")
    ca = IdentityCa(trust_domain, signer, chain, previous, max_lifetime)
    warning = ca.expiry_warning(now)
    if warning is not None:
        log.warning("identity CA: %s", warning)
    return ca


def _valid_now(chain: Sequence[x509.Certificate], now: datetime) -> None:
    """Raises: ConfigError: a certificate of the issuing chain expired or not yet valid (every
    issuance would fail, or hand out certificates no peer accepts yet)."""
    for certificate in chain:
        subject = certificate.subject.rfc4514_string()
        if now >= certificate.not_valid_after_utc:
            raise ConfigError(
                "identity.ca_certificates",
                f"{subject!r} expired at {certificate.not_valid_after_utc.isoformat()}: rotate "
                "the CA (docs/api.md, Rotating the CA)",
            )
        if now < certificate.not_valid_before_utc:
            raise ConfigError(
                "identity.ca_certificates",
                f"{subject!r} is not valid before {certificate.not_valid_before_utc.isoformat()}",
            )


def _expressible(authorities: Sequence[x509.Certificate], setting: str) -> None:
    """Raises: ConfigError: an authority whose key the JWKS bundle cannot carry."""
    for authority in authorities:
        try:
            authority_jwk(authority)
        except ValueError as exc:
            raise ConfigError(setting, str(exc)) from exc


def _described(certificate: x509.Certificate) -> dict[str, str]:
    return {
        "sha256": certificate.fingerprint(hashes.SHA256()).hex(),
        "subject": certificate.subject.rfc4514_string(),
        "not_after": certificate.not_valid_after_utc.isoformat(),
    }


def _certificates(path: Path, setting: str) -> list[x509.Certificate]:
    try:
        found = x509.load_pem_x509_certificates(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(setting, f"not a readable PEM certificate file: {path}") from exc
    return found
