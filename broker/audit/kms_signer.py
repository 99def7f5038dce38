"""Checkpoints signed by a Cloud KMS key version (``EC_SIGN_ED25519``): the signing key never
leaves the KMS. ``[audit] signing_key = "cloudkms:projects/P/locations/L/keyRings/R/cryptoKeys/
K/cryptoKeyVersions/N"``; the endpoint is ``[keys] kms_endpoint``. Requests and answers carry
CRC32C checksums, checked both ways as for the KEK (keys/kek/cloudkms.py)."""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from google.api_core.client_options import ClientOptions
from google.cloud import kms_v1
from google.cloud.kms_v1.services.key_management_service.transports.grpc_asyncio import (
    KeyManagementServiceGrpcAsyncIOTransport,
)

from broker.audit.signers import KMS_PREFIX
from broker.cloud.google_api import call, close_client, crc32c, grpc_transport
from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.crypto.checkpoint import _check_name, note_with_signature, verifier_key_text


def _unavailable(message: str) -> UpstreamError:
    return UpstreamError(f"checkpoint signing key: {message}", code=ErrorCode.AUDIT_LOG_UNAVAILABLE)


class KmsNoteSigner:
    def __init__(self, name: str, uri: str, *, endpoint: str, timeout_seconds: float) -> None:
        version = uri.removeprefix(KMS_PREFIX)
        if "/cryptoKeyVersions/" not in version or not version.startswith("projects/"):
            raise ConfigError("audit.signing_key", "cloudkms: needs a full cryptoKeyVersions name")
        self.name = _check_name(name)
        self._version = version
        self._endpoint = endpoint
        self._timeout = timeout_seconds
        self._client: Any = None
        self.public_raw = b""

    async def open(self) -> None:
        """Connect and read the version's public key (it must be Ed25519).

        Raises:
            UpstreamError / ConfigError.
        """
        transport = await grpc_transport(KeyManagementServiceGrpcAsyncIOTransport, self._endpoint)
        self._client = kms_v1.KeyManagementServiceAsyncClient(
            transport=transport, client_options=ClientOptions(api_endpoint=self._endpoint)
        )
        answer = await self._call("get_public_key", kms_v1.GetPublicKeyRequest(name=self._version))
        pem = answer.pem.encode()
        if crc32c(pem) != answer.pem_crc32c:
            raise _unavailable("the public key was corrupted in transit")
        key = serialization.load_pem_public_key(pem)
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise ConfigError("audit.signing_key", "the KMS key version is not EC_SIGN_ED25519")
        self.public_raw = key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await close_client(client)

    def verifier_key(self) -> str:
        return verifier_key_text(self.name, self.public_raw)

    async def sign_note(self, body: str) -> str:
        data = body.encode()
        answer = await self._call(
            "asymmetric_sign",
            kms_v1.AsymmetricSignRequest(name=self._version, data=data, data_crc32c=crc32c(data)),
        )
        if not answer.verified_data_crc32c:
            raise _unavailable("the service did not verify the data checksum")
        if crc32c(answer.signature) != answer.signature_crc32c:
            raise _unavailable("the signature was corrupted in transit")
        signature = bytes(answer.signature)
        ed25519.Ed25519PublicKey.from_public_bytes(self.public_raw).verify(signature, data)
        return note_with_signature(body, self.name, self.public_raw, signature)

    async def _call(self, method: str, request: Any) -> Any:
        return await call(
            self._client, method, request, deadline_seconds=self._timeout, unavailable=_unavailable
        )
