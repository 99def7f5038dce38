"""One Cloud KMS asymmetric key version as a signer uses it (result keys, checkpoint keys): the
``cloudkms:projects/…/cryptoKeyVersions/N`` name checked, the async client over gRPC to
``[keys] kms_endpoint`` (as the KEK: Workload Identity Federation with ``[keys]
kms_credentials``, else Application Default Credentials), the public key read with its CRC32C
checked, every call bounded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from google.api_core.client_options import ClientOptions
from google.cloud import kms_v1
from google.cloud.kms_v1.services.key_management_service.transports.grpc_asyncio import (
    KeyManagementServiceGrpcAsyncIOTransport,
)

from broker.cloud.federation import FederatedCredentials, open_federated
from broker.cloud.google_api import call, close_client, crc32c, grpc_transport
from broker.core.errors import ConfigError, UpstreamError

KMS_PREFIX = "cloudkms:"


class KmsKeyVersion:
    def __init__(
        self,
        uri: str,
        *,
        setting: str,
        endpoint: str,
        timeout_seconds: float,
        unavailable: Callable[[str], UpstreamError],
        credentials_file: Path | None = None,
    ) -> None:
        """Raises: ConfigError naming ``setting`` when ``uri`` is not a key version's name.

        ``credentials_file``: a Workload Identity Federation configuration, loaded at ``open``.
        """
        version = uri.removeprefix(KMS_PREFIX)
        if "/cryptoKeyVersions/" not in version or not version.startswith("projects/"):
            raise ConfigError(setting, "cloudkms: needs a full cryptoKeyVersions name")
        self.version = version
        self._endpoint = endpoint
        self._timeout = timeout_seconds
        self._unavailable = unavailable
        if credentials_file is not None:  # a refusal names the federation it came through
            self._unavailable = lambda message: unavailable(
                f"(Workload Identity Federation) {message}"
            )
        self._credentials_file = credentials_file
        self._federated: FederatedCredentials | None = None
        self._client: Any = None

    async def open(self) -> PublicKeyTypes:
        """Connect; the version's public key (its checksum checked).

        Raises: UpstreamError (what ``unavailable`` makes); ConfigError (``kms_credentials``)."""
        self._federated = await open_federated(self._credentials_file, self._timeout)
        credentials = None if self._federated is None else self._federated.credentials
        transport = await grpc_transport(
            KeyManagementServiceGrpcAsyncIOTransport, self._endpoint, credentials
        )
        self._client = kms_v1.KeyManagementServiceAsyncClient(
            transport=transport, client_options=ClientOptions(api_endpoint=self._endpoint)
        )
        answer = await self.call("get_public_key", kms_v1.GetPublicKeyRequest(name=self.version))
        pem = answer.pem.encode()
        if crc32c(pem) != answer.pem_crc32c:
            raise self._unavailable("the public key was corrupted in transit")
        return serialization.load_pem_public_key(pem)

    async def call(self, method: str, request: Any) -> Any:
        return await call(
            self._client,
            method,
            request,
            deadline_seconds=self._timeout,
            unavailable=self._unavailable,
            federated=self._federated,
        )

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await close_client(client)
