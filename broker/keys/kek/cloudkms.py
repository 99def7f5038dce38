"""Google Cloud KMS KEK (software or Cloud HSM protection), through ``google-cloud-kms``.

URI: ``cloudkms:projects/P/locations/L/keyRings/R/cryptoKeys/K`` (a symmetric ENCRYPT_DECRYPT
key; KMS picks the primary version to encrypt and the right version to decrypt).

Every request carries the CRC32C fields Google documents for end-to-end integrity, and every
response is checked: ``verified_plaintext_crc32c`` and
``verified_additional_authenticated_data_crc32c`` must be true, ``name`` must be a version of our
key, and the returned ciphertext/plaintext must match its CRC32C
(cloud.google.com/kms/docs/data-integrity-guidelines). A mismatch, a gRPC error or a timeout is
``kek_unavailable``: nothing is released.

Credentials: with ``[keys] kms_credentials`` (required for a sealed broker), Workload Identity
Federation: the broker's own Confidential Space attestation token exchanged at the STS
(``cloud/federation.py``), so the key serves only the attested image; otherwise Application
Default Credentials. ``[keys] kms_endpoint`` names another API endpoint; a loopback endpoint (a
local test server) is spoken to in plaintext with anonymous credentials, or over gRPC local
credentials with federated ones; anything else over TLS. A refusal (the STS's or KMS's IAM) is
``kek_unavailable`` with a message that names Workload Identity Federation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from google.api_core.client_options import ClientOptions
from google.cloud import kms_v1
from google.cloud.kms_v1.services.key_management_service.transports import (
    KeyManagementServiceGrpcAsyncIOTransport,
)

from broker.cloud.federation import FederatedCredentials, open_federated
from broker.cloud.google_api import call, close_client, crc32c, grpc_transport
from broker.core.errors import ConfigError, ErrorCode, UpstreamError

KEY_NAME = re.compile(
    r"^projects/[a-z0-9-]+/locations/[a-z0-9-]+/keyRings/[A-Za-z0-9_-]+/cryptoKeys/[A-Za-z0-9_-]+$"
)
DEFAULT_ENDPOINT = "cloudkms.googleapis.com"
RPC_TIMEOUT_SECONDS = 10.0


def parse_cloudkms_uri(uri: str) -> str:
    """The CryptoKey resource name of a ``cloudkms:`` URI.

    Raises:
        ConfigError: ``keys.kek`` for a malformed name.
    """
    name = uri.removeprefix("cloudkms:")
    if not uri.startswith("cloudkms:") or not KEY_NAME.match(name):
        raise ConfigError(
            "keys.kek",
            "expected cloudkms:projects/P/locations/L/keyRings/R/cryptoKeys/K",
        )
    return name


def _unavailable(message: str) -> UpstreamError:
    return UpstreamError(f"Cloud KMS: {message}", code=ErrorCode.KEK_UNAVAILABLE)


def _federated_unavailable(message: str) -> UpstreamError:
    return UpstreamError(
        f"Cloud KMS (Workload Identity Federation): {message}", code=ErrorCode.KEK_UNAVAILABLE
    )


class CloudKmsKek:
    """``KekProvider`` over a Cloud KMS symmetric key."""

    def __init__(
        self,
        key_name: str,
        *,
        endpoint: str = DEFAULT_ENDPOINT,
        credentials: Any = None,
        credentials_file: Path | None = None,
        timeout_seconds: float = RPC_TIMEOUT_SECONDS,
    ) -> None:
        """``credentials_file``: a Workload Identity Federation configuration (``[keys]
        kms_credentials``), loaded at ``open``."""
        self._name = key_name
        self._endpoint = endpoint
        self._timeout = timeout_seconds
        self._credentials = credentials
        self._credentials_file = credentials_file
        self._federated: FederatedCredentials | None = None
        self._client: kms_v1.KeyManagementServiceAsyncClient | None = None

    @property
    def reference(self) -> str:
        return f"cloudkms:{self._name}"

    @property
    def development_only(self) -> bool:
        return False

    async def open(self) -> None:
        """Create the gRPC client.

        The channel is made on the event loop that will use it; credential discovery and the
        client constructor (which look for files) run on a worker thread.

        Raises:
            ConfigError: ``keys.kms_credentials`` is not a configuration the broker accepts.
        """
        self._federated = await open_federated(self._credentials_file, self._timeout)
        credentials = self._credentials
        if self._federated is not None:
            credentials = self._federated.credentials
        transport = await grpc_transport(
            KeyManagementServiceGrpcAsyncIOTransport, self._endpoint, credentials
        )
        options = ClientOptions(api_endpoint=self._endpoint)
        self._client = kms_v1.KeyManagementServiceAsyncClient(
            transport=transport, client_options=options
        )

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await close_client(client)

    async def wrap(self, dek: bytes, aad: bytes) -> bytes:
        request = kms_v1.EncryptRequest(
            name=self._name,
            plaintext=dek,
            additional_authenticated_data=aad,
            plaintext_crc32c=crc32c(dek),
            additional_authenticated_data_crc32c=crc32c(aad),
        )
        response = await self._call("encrypt", request)
        if not response.verified_plaintext_crc32c:
            raise _unavailable("the service did not verify the plaintext checksum")
        if not response.verified_additional_authenticated_data_crc32c:
            raise _unavailable("the service did not verify the AAD checksum")
        if not response.name.startswith(self._name + "/cryptoKeyVersions/"):
            raise _unavailable("the service answered for another key")
        if crc32c(response.ciphertext) != response.ciphertext_crc32c:
            raise _unavailable("the ciphertext was corrupted in transit")
        return bytes(response.ciphertext)

    async def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        request = kms_v1.DecryptRequest(
            name=self._name,
            ciphertext=wrapped,
            additional_authenticated_data=aad,
            ciphertext_crc32c=crc32c(wrapped),
            additional_authenticated_data_crc32c=crc32c(aad),
        )
        response = await self._call("decrypt", request)
        if crc32c(response.plaintext) != response.plaintext_crc32c:
            raise _unavailable("the plaintext was corrupted in transit")
        return bytes(response.plaintext)

    async def _call(self, method: str, request: Any) -> Any:
        return await call(
            self._client,
            method,
            request,
            deadline_seconds=self._timeout,
            unavailable=_unavailable if self._federated is None else _federated_unavailable,
            federated=self._federated,
        )
