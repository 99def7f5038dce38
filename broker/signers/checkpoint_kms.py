"""Checkpoints signed by a Cloud KMS key version (``EC_SIGN_ED25519``): the signing key never
leaves the KMS. ``[audit] signing_key = "cloudkms:projects/P/locations/L/keyRings/R/cryptoKeys/
K/cryptoKeyVersions/N"``; the endpoint is ``[keys] kms_endpoint``, the credentials ``[keys]
kms_credentials`` (Workload Identity Federation) when set. Requests and answers carry
CRC32C checksums, checked both ways as for the KEK (keys/kek/cloudkms.py)."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from google.cloud import kms_v1

from broker.cloud.google_api import crc32c
from broker.cloud.kms_key import KmsKeyVersion
from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.crypto.checkpoint import _check_name, note_with_signature, verifier_key_text


def _unavailable(message: str) -> UpstreamError:
    return UpstreamError(f"checkpoint signing key: {message}", code=ErrorCode.AUDIT_LOG_UNAVAILABLE)


class KmsNoteSigner:
    def __init__(
        self,
        name: str,
        uri: str,
        *,
        endpoint: str,
        timeout_seconds: float,
        credentials_file: Path | None = None,
    ) -> None:
        self._kms = KmsKeyVersion(
            uri,
            setting="audit.signing_key",
            endpoint=endpoint,
            timeout_seconds=timeout_seconds,
            unavailable=_unavailable,
            credentials_file=credentials_file,
        )
        self.name = _check_name(name)
        self.public_raw = b""

    async def open(self) -> None:
        """Connect and read the version's public key (it must be Ed25519).

        Raises:
            UpstreamError / ConfigError.
        """
        key = await self._kms.open()
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise ConfigError("audit.signing_key", "the KMS key version is not EC_SIGN_ED25519")
        self.public_raw = key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    async def close(self) -> None:
        await self._kms.close()

    def verifier_key(self) -> str:
        return verifier_key_text(self.name, self.public_raw)

    async def sign_note(self, body: str) -> str:
        data = body.encode()
        answer = await self._kms.call(
            "asymmetric_sign",
            kms_v1.AsymmetricSignRequest(
                name=self._kms.version, data=data, data_crc32c=crc32c(data)
            ),
        )
        if not answer.verified_data_crc32c:
            raise _unavailable("the service did not verify the data checksum")
        if crc32c(answer.signature) != answer.signature_crc32c:
            raise _unavailable("the signature was corrupted in transit")
        signature = bytes(answer.signature)
        ed25519.Ed25519PublicKey.from_public_bytes(self.public_raw).verify(signature, data)
        return note_with_signature(body, self.name, self.public_raw, signature)
