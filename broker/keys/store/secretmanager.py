"""Google Secret Manager DEK store, through ``google-cloud-secret-manager``.

URI: ``secretmanager:projects/P``. One secret per key version, id
``broker-dek-<first 40 hex of SHA-256(key name)>-v<version>``, labelled ``broker=dek``,
``broker-key=<the same 40 hex>`` and ``broker-purpose=<purpose>`` (``/readyz`` asks for query
keys with one filtered list, never reading payloads); each secret version's payload is the
record as JSON (the wrapped DEK in base64, never plaintext). A change adds a secret version; the
newest one is the record. ``destroy`` adds a record without wrapped material and then destroys
every earlier secret version, so the wrapped DEK is gone for good (crypto-shredding) while
metadata remains.

Payloads are sent and read with their CRC32C (``data_crc32c``), checked on every read.
``replace`` compares the stored ``kek_ref`` before writing; Secret Manager offers no
compare-and-swap on payloads, so run one ``broker keys rewrap`` at a time (the SQLite store is
atomic per DEK without that restriction). Errors become ``key_store_unavailable``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from datetime import datetime
from typing import Any

from google.api_core import exceptions as api_exceptions
from google.api_core.client_options import ClientOptions
from google.cloud import secretmanager_v1 as sm
from google.cloud.secretmanager_v1.services.secret_manager_service.transports import (
    SecretManagerServiceGrpcAsyncIOTransport,
)

from broker.cloud.google_api import call, close_client, crc32c, grpc_transport
from broker.core.errors import ConfigError, Conflict, ErrorCode, UpstreamError
from broker.core.protocol import Algorithm
from broker.keys.store.base import KeyVersionRecord, Purpose, VersionState

PROJECT = re.compile(r"^projects/[a-z0-9-]+$")
RPC_TIMEOUT_SECONDS = 10.0
PAGE_SIZE = 250


def parse_project(uri: str) -> str:
    """``projects/P`` of a ``secretmanager:projects/P`` URI.

    Raises:
        ConfigError: ``keys.store``.
    """
    project = uri.removeprefix("secretmanager:")
    if not uri.startswith("secretmanager:") or not PROJECT.match(project):
        raise ConfigError("keys.store", "expected secretmanager:projects/P")
    return project


def key_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:40]


def _unavailable(message: str) -> UpstreamError:
    return UpstreamError(f"Secret Manager: {message}", code=ErrorCode.KEY_STORE_UNAVAILABLE)


class SecretManagerKeyStore:
    def __init__(
        self,
        project: str,
        *,
        endpoint: str = "secretmanager.googleapis.com",
        timeout_seconds: float = RPC_TIMEOUT_SECONDS,
    ) -> None:
        self._project = project
        self._endpoint = endpoint
        self._timeout = timeout_seconds
        self._client: sm.SecretManagerServiceAsyncClient | None = None

    async def open(self) -> None:
        transport = await grpc_transport(
            SecretManagerServiceGrpcAsyncIOTransport, self._endpoint, None
        )
        options = ClientOptions(api_endpoint=self._endpoint)
        self._client = sm.SecretManagerServiceAsyncClient(
            transport=transport, client_options=options
        )

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await close_client(client)

    async def add_version(self, record: KeyVersionRecord) -> None:
        secret = sm.Secret(
            replication=sm.Replication(automatic=sm.Replication.Automatic()),
            labels={
                "broker": "dek",
                "broker-key": key_hash(record.name),
                "broker-purpose": record.purpose.value,
            },
        )
        try:
            await self._call(
                "create_secret",
                sm.CreateSecretRequest(
                    parent=self._project,
                    secret_id=_secret_id(record.name, record.version),
                    secret=secret,
                ),
            )
        except api_exceptions.AlreadyExists as exc:
            raise Conflict(f"key {record.name} version {record.version} exists") from exc
        await self._write(record)

    async def get_version(self, name: str, version: int) -> KeyVersionRecord | None:
        return await self._read(f"{self._project}/secrets/{_secret_id(name, version)}")

    async def latest_version(self, name: str, *, enabled_only: bool) -> KeyVersionRecord | None:
        versions = await self.list_versions(name)
        if enabled_only:
            versions = [v for v in versions if v.state is VersionState.ENABLED]
        return versions[-1] if versions else None

    async def list_versions(self, name: str | None = None) -> list[KeyVersionRecord]:
        label = "labels.broker=dek" if name is None else f"labels.broker-key={key_hash(name)}"
        records = []
        token = ""
        while True:
            page = await self._call(
                "list_secrets",
                sm.ListSecretsRequest(
                    parent=self._project, filter=label, page_size=PAGE_SIZE, page_token=token
                ),
            )
            for secret in page.secrets:
                record = await self._read(secret.name)
                if record is not None and (name is None or record.name == name):
                    records.append(record)
            token = page.next_page_token
            if not token:
                break
        return sorted(records, key=lambda r: (r.name, r.version))

    async def has_purpose(self, purpose: Purpose) -> bool:
        """One ``ListSecrets`` of page size 1 filtered on the purpose label (no payload read).
        Secrets written before the label existed carry none and are not counted."""
        page = await self._call(
            "list_secrets",
            sm.ListSecretsRequest(
                parent=self._project,
                filter=f"labels.broker=dek AND labels.broker-purpose={purpose.value}",
                page_size=1,
            ),
        )
        return len(page.secrets) > 0

    async def replace(self, record: KeyVersionRecord, *, expect_kek_ref: str) -> bool:
        current = await self.get_version(record.name, record.version)
        if current is None or current.kek_ref != expect_kek_ref:
            return False
        await self._write(record)
        if record.state is VersionState.DESTROYED:
            await self._shred_older(record)
        return True

    async def _write(self, record: KeyVersionRecord) -> None:
        data = json.dumps(_to_json(record), sort_keys=True).encode()
        await self._call(
            "add_secret_version",
            sm.AddSecretVersionRequest(
                parent=f"{self._project}/secrets/{_secret_id(record.name, record.version)}",
                payload=sm.SecretPayload(data=data, data_crc32c=crc32c(data)),
            ),
        )

    async def _read(self, secret_name: str) -> KeyVersionRecord | None:
        try:
            response = await self._call(
                "access_secret_version",
                sm.AccessSecretVersionRequest(name=f"{secret_name}/versions/latest"),
            )
        except api_exceptions.NotFound:
            return None
        data = bytes(response.payload.data)
        if crc32c(data) != response.payload.data_crc32c:
            raise _unavailable("a secret payload was corrupted in transit")
        try:
            return _from_json(json.loads(data))
        except (ValueError, KeyError, TypeError) as exc:
            raise _unavailable("a secret payload is not a broker key record") from exc

    async def _shred_older(self, record: KeyVersionRecord) -> None:
        parent = f"{self._project}/secrets/{_secret_id(record.name, record.version)}"
        page = await self._call(
            "list_secret_versions", sm.ListSecretVersionsRequest(parent=parent, page_size=PAGE_SIZE)
        )
        ordered = sorted(page.versions, key=lambda v: int(v.name.rsplit("/", 1)[1]))
        for version in ordered[:-1]:  # every payload but the new, material-free one
            if version.state != sm.SecretVersion.State.DESTROYED:
                await self._call(
                    "destroy_secret_version", sm.DestroySecretVersionRequest(name=version.name)
                )

    async def _call(self, method: str, request: Any) -> Any:
        return await call(
            self._client, method, request, deadline_seconds=self._timeout, unavailable=_unavailable
        )


def _secret_id(name: str, version: int) -> str:
    return f"broker-dek-{key_hash(name)}-v{version}"


def _to_json(record: KeyVersionRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "version": record.version,
        "purpose": record.purpose.value,
        "state": record.state.value,
        "wrapped_dek": base64.b64encode(record.wrapped_dek).decode(),
        "kek_ref": record.kek_ref,
        "created_at": record.created_at.isoformat(),
        "updated_at": None if record.updated_at is None else record.updated_at.isoformat(),
        "algorithm": record.algorithm.value,
        "public_key": base64.b64encode(record.public_key).decode(),
    }


def _from_json(data: dict[str, Any]) -> KeyVersionRecord:
    return KeyVersionRecord(
        name=str(data["name"]),
        version=int(data["version"]),
        purpose=Purpose(data["purpose"]),
        state=VersionState(data["state"]),
        wrapped_dek=base64.b64decode(data["wrapped_dek"]),
        kek_ref=str(data["kek_ref"]),
        created_at=datetime.fromisoformat(data["created_at"]),
        updated_at=None
        if data.get("updated_at") is None
        else datetime.fromisoformat(data["updated_at"]),
        algorithm=Algorithm(data.get("algorithm", Algorithm.AES_256.value)),
        public_key=base64.b64decode(data.get("public_key", "")),
    )
