"""An in-memory Secret Manager speaking the real gRPC API (SecretManagerService).

Implements CreateSecret, GetSecret, UpdateSecret (``version_aliases`` and ``annotations``, with
the etag check), AddSecretVersion, AccessSecretVersion (by number, ``latest`` or a version alias),
ListSecrets (``labels.K=V`` filters, pagination), ListSecretVersions (a ``state:S`` filter) and
DestroySecretVersion, with Google's error codes (ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION
for destroyed versions and for a stale etag, INVALID_ARGUMENT for a payload whose
``data_crc32c`` does not match, or a filter it does not implement).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import grpc
from google.cloud import secretmanager_v1 as sm

from tests.fakes import start_grpc_server, stop_grpc_server

SERVICE = "google.cloud.secretmanager.v1.SecretManagerService"
SECRET_ID = re.compile(r"^[A-Za-z0-9_-]{1,255}$")


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


@dataclass
class FakeSecret:
    labels: dict[str, str]
    versions: list[bytes | None] = field(default_factory=list)  # None = destroyed
    aliases: dict[str, int] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    revision: int = 1  # the etag is '"<revision>"'; every update changes it

    def resource(self, name: str) -> sm.Secret:
        return sm.Secret(
            name=name,
            labels=self.labels,
            version_aliases=self.aliases,
            annotations=self.annotations,
            etag=f'"{self.revision}"',
        )


class FakeSecretManager:
    def __init__(self) -> None:
        self.secrets: dict[str, FakeSecret] = {}
        self.server: grpc.aio.Server | None = None
        self.endpoint = ""
        self.unavailable = False
        self.calls: list[str] = []

    async def start(self) -> str:
        methods: dict[str, tuple[Any, Any, Any]] = {
            "CreateSecret": (self._create, sm.CreateSecretRequest, sm.Secret),
            "GetSecret": (self._get, sm.GetSecretRequest, sm.Secret),
            "UpdateSecret": (self._update, sm.UpdateSecretRequest, sm.Secret),
            "AddSecretVersion": (self._add, sm.AddSecretVersionRequest, sm.SecretVersion),
            "AccessSecretVersion": (
                self._access,
                sm.AccessSecretVersionRequest,
                sm.AccessSecretVersionResponse,
            ),
            "ListSecrets": (self._list, sm.ListSecretsRequest, sm.ListSecretsResponse),
            "ListSecretVersions": (
                self._list_versions,
                sm.ListSecretVersionsRequest,
                sm.ListSecretVersionsResponse,
            ),
            "DestroySecretVersion": (
                self._destroy,
                sm.DestroySecretVersionRequest,
                sm.SecretVersion,
            ),
        }
        self.server, self.endpoint = await start_grpc_server(SERVICE, methods)
        return self.endpoint

    async def stop(self) -> None:
        await stop_grpc_server(self)

    async def _enter(self, context: Any, method: str) -> None:
        self.calls.append(method)
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the service is unavailable")

    async def _secret(self, context: Any, name: str) -> FakeSecret:
        secret = self.secrets.get(name)
        if secret is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"Secret [{name}] not found")
        assert secret is not None
        return secret

    async def _create(self, request: sm.CreateSecretRequest, context: Any) -> sm.Secret:
        await self._enter(context, "CreateSecret")
        if not SECRET_ID.match(request.secret_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad secret id")
        name = f"{request.parent}/secrets/{request.secret_id}"
        if name in self.secrets:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"Secret [{name}] already exists")
        self.secrets[name] = FakeSecret(labels=dict(request.secret.labels))
        return self.secrets[name].resource(name)

    async def _get(self, request: sm.GetSecretRequest, context: Any) -> sm.Secret:
        await self._enter(context, "GetSecret")
        return (await self._secret(context, request.name)).resource(request.name)

    async def _update(self, request: sm.UpdateSecretRequest, context: Any) -> sm.Secret:
        await self._enter(context, "UpdateSecret")
        name = request.secret.name
        secret = await self._secret(context, name)
        if request.secret.etag and request.secret.etag != f'"{secret.revision}"':
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "etag mismatch")
        for path in request.update_mask.paths:
            if path == "version_aliases":
                aliases = {k: int(v) for k, v in request.secret.version_aliases.items()}
                if any(not 1 <= v <= len(secret.versions) for v in aliases.values()):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such version")
                secret.aliases = aliases
            elif path == "annotations":
                secret.annotations = dict(request.secret.annotations)
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot update {path}")
        secret.revision += 1
        return secret.resource(name)

    async def _add(self, request: sm.AddSecretVersionRequest, context: Any) -> sm.SecretVersion:
        await self._enter(context, "AddSecretVersion")
        secret = await self._secret(context, request.parent)
        payload = sm.SecretPayload.pb(request.payload)
        if payload.HasField("data_crc32c") and payload.data_crc32c != crc(payload.data):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Checksum mismatch")
        secret.versions.append(bytes(payload.data))
        return sm.SecretVersion(
            name=f"{request.parent}/versions/{len(secret.versions)}",
            state=sm.SecretVersion.State.ENABLED,
        )

    async def _access(
        self, request: sm.AccessSecretVersionRequest, context: Any
    ) -> sm.AccessSecretVersionResponse:
        await self._enter(context, "AccessSecretVersion")
        secret_name, _, version = request.name.rpartition("/versions/")
        secret = await self._secret(context, secret_name)
        if not secret.versions:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no versions")
        if version == "latest":
            number = len(secret.versions)
        elif version.isdigit() and 1 <= int(version) <= len(secret.versions):
            number = int(version)
        elif version in secret.aliases:
            number = secret.aliases[version]
        else:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no version {version}")
        data = secret.versions[number - 1]
        if data is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "version is destroyed")
        assert data is not None
        return sm.AccessSecretVersionResponse(
            name=f"{secret_name}/versions/{number}",
            payload=sm.SecretPayload(data=data, data_crc32c=crc(data)),
        )

    async def _list(self, request: sm.ListSecretsRequest, context: Any) -> sm.ListSecretsResponse:
        await self._enter(context, "ListSecrets")
        wanted = dict(re.findall(r"labels\.([a-z0-9_-]+)=([a-z0-9_-]+)", request.filter))
        names = sorted(
            name
            for name, secret in self.secrets.items()
            if name.startswith(request.parent + "/")
            and all(secret.labels.get(k) == v for k, v in wanted.items())
        )
        start = int(request.page_token or 0)
        size = request.page_size or 25
        page = names[start : start + size]
        token = str(start + size) if start + size < len(names) else ""
        return sm.ListSecretsResponse(
            secrets=[self.secrets[n].resource(n) for n in page],
            next_page_token=token,
            total_size=len(names),
        )

    async def _list_versions(
        self, request: sm.ListSecretVersionsRequest, context: Any
    ) -> sm.ListSecretVersionsResponse:
        await self._enter(context, "ListSecretVersions")
        secret = await self._secret(context, request.parent)
        wanted = re.fullmatch(r"state:(ENABLED|DESTROYED)", request.filter)
        if request.filter and wanted is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unsupported filter")
        versions = [
            sm.SecretVersion(
                name=f"{request.parent}/versions/{i + 1}",
                state=sm.SecretVersion.State.DESTROYED
                if data is None
                else sm.SecretVersion.State.ENABLED,
            )
            for i, data in enumerate(secret.versions)
        ]
        if wanted is not None:
            versions = [v for v in versions if v.state.name == wanted.group(1)]
        return sm.ListSecretVersionsResponse(versions=versions)

    async def _destroy(
        self, request: sm.DestroySecretVersionRequest, context: Any
    ) -> sm.SecretVersion:
        await self._enter(context, "DestroySecretVersion")
        secret_name, _, version = request.name.rpartition("/versions/")
        secret = await self._secret(context, secret_name)
        secret.versions[int(version) - 1] = None
        return sm.SecretVersion(name=request.name, state=sm.SecretVersion.State.DESTROYED)
