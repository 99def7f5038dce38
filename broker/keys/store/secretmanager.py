"""Google Secret Manager DEK store, through ``google-cloud-secret-manager``.

URI: ``secretmanager:projects/P``. One secret per key version, id
``broker-dek-<first 40 hex of SHA-256(key name)>-v<version>``, labelled ``broker=dek``,
``broker-key=<the same 40 hex>`` and ``broker-purpose=<purpose>`` (``/readyz`` asks for query
keys with one filtered list, never reading payloads); each secret version's payload is the
record as JSON (the wrapped DEK in base64, never plaintext).

The record in force is the secret version its ``current`` version alias names (``latest`` for a
secret no change has touched yet). A change is a compare-and-swap on that alias: read the
record the alias names and compare it with the one the change was read as (``same_row``; never
a destroyed one), add the new record as a secret version, then move the alias to it with the
secret's etag (``UpdateSecret`` refuses a stale etag with FAILED_PRECONDITION). A change that
loses the race destroys the version it added; until then no reader sees it (readers follow the
alias). ``destroy`` moves the alias to a record without wrapped material and then destroys every
other secret version, so the wrapped DEK is gone for good (crypto-shredding) while metadata
remains; if that shredding is cut short, the next read of the destroyed record finishes it
(the secret's ``broker-shredded`` annotation names the version shredding completed for). A stale
change can still add its version after the shredding listed the versions, lose the alias, and
fail to destroy what it added: every read of a destroyed record therefore destroys any other
version still enabled (one filtered page a read; idempotent), so no wrapped DEK outlives it.

Payloads are sent and read with their CRC32C (``data_crc32c``), checked on every read. Errors
become ``key_store_unavailable``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from dataclasses import dataclass
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
from broker.keys.store.base import KeyVersionRecord, Purpose, VersionState, same_row

PROJECT = re.compile(r"^projects/[a-z0-9-]+$")
RPC_TIMEOUT_SECONDS = 10.0
PAGE_SIZE = 250
CURRENT = "current"  # the version alias naming the record in force
SHREDDED = "broker-shredded"  # annotation: the destroyed record every other payload is gone for
READ_ATTEMPTS = 3  # a record re-read when a destroy moved the alias and shredded it meanwhile
SWEEP_PAGE = 25  # enabled versions a read of a destroyed record looks at (the next read goes on)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Found:
    number: int  # the secret version holding it
    record: KeyVersionRecord


class _Moved(Exception):
    """The secret version read was destroyed meanwhile (a change moved past it)."""


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
        found = await self._current(_parent(self._project, name, version))
        return None if found is None else found.record

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
                found = await self._current(secret.name, secret)
                if found is not None and (name is None or found.record.name == name):
                    records.append(found.record)
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

    async def replace(self, record: KeyVersionRecord, *, expected: KeyVersionRecord) -> bool:
        if expected.state is VersionState.DESTROYED:
            return False
        parent = _parent(self._project, record.name, record.version)
        current = await self._in_force(parent)
        if current is None or current.record.state is VersionState.DESTROYED:
            return False
        if not same_row(current.record, expected):
            return False
        added = await self._write(record)
        if not await self._switch(parent, current.number, added):
            await self._discard(parent, added)
            return False
        if record.state is VersionState.DESTROYED:
            await self._shred(parent, added)
        return True

    async def _in_force(self, parent: str) -> _Found | None:
        """The record in force and its version, for a change (the alias set first if absent)."""
        secret = await self._secret(parent)
        number = None if secret is None else await self._aliased(parent, secret)
        if number is None:
            return None
        try:
            return await self._access(parent, number)
        except _Moved:
            return None

    async def _current(self, parent: str, secret: sm.Secret | None = None) -> _Found | None:
        """The record in force (the version ``current`` names, else ``latest``)."""
        for _ in range(READ_ATTEMPTS):
            if secret is None:
                secret = await self._secret(parent)
                if secret is None:
                    return None
            number = secret.version_aliases.get(CURRENT)
            try:
                found = await self._access(parent, number or None)
            except _Moved:  # a destroy moved the alias and shredded this one: read it again
                secret = None
                continue
            if found is not None and found.record.state is VersionState.DESTROYED:
                if secret.annotations.get(SHREDDED) != str(found.number):
                    await self._shred(parent, found.number)  # a destroy cut short: finish it
                else:
                    await self._sweep(parent, found.number)  # a stale change's leftover
            return found
        raise _unavailable("a key record kept changing while it was read")

    async def _secret(self, parent: str) -> sm.Secret | None:
        try:
            secret: sm.Secret = await self._call("get_secret", sm.GetSecretRequest(name=parent))
        except api_exceptions.NotFound:
            return None
        return secret

    async def _aliased(self, parent: str, secret: sm.Secret) -> int | None:
        """The number of the version in force; a secret without the alias (made by ``add_version``
        or by an older broker) first gets it, naming ``latest``, so that every change, its own
        included, moves the alias and no reader ever follows ``latest`` to a change in flight."""
        number = secret.version_aliases.get(CURRENT)
        if number:
            return int(number)
        try:
            latest = await self._access(parent, None)
        except _Moved:
            return None
        if latest is None:
            return None
        await self._move_alias(secret, latest.number)  # lost: another change named it first
        again = await self._secret(parent)
        number = None if again is None else again.version_aliases.get(CURRENT)
        return int(number) if number else None

    async def _switch(self, parent: str, base: int, added: int) -> bool:
        """Move ``current`` from ``base`` to ``added`` if nothing moved it meanwhile."""
        secret = await self._secret(parent)
        if secret is None or secret.version_aliases.get(CURRENT) != base:
            return False
        try:
            if await self._move_alias(secret, added):
                return True
        except UpstreamError:
            pass  # perhaps moved (a retried call): the secret says
        secret = await self._secret(parent)
        return secret is not None and secret.version_aliases.get(CURRENT) == added

    async def _move_alias(self, secret: sm.Secret, number: int) -> bool:
        """``current`` → ``number`` with ``secret``'s etag; False when the secret changed."""
        aliases = {**dict(secret.version_aliases), CURRENT: number}
        request = sm.UpdateSecretRequest(
            secret=sm.Secret(name=secret.name, etag=secret.etag, version_aliases=aliases),
            update_mask={"paths": ["version_aliases"]},
        )
        try:
            await self._call("update_secret", request)
        except UpstreamError as exc:
            if isinstance(exc.__cause__, api_exceptions.FailedPrecondition):
                return False
            raise
        return True

    async def _discard(self, parent: str, number: int) -> None:
        """Destroy a version whose change lost the race (best effort: no reader follows it)."""
        try:
            await self._call(
                "destroy_secret_version",
                sm.DestroySecretVersionRequest(name=f"{parent}/versions/{number}"),
            )
        except UpstreamError:
            log.warning("could not destroy %s/versions/%d (a change that lost)", parent, number)

    async def _write(self, record: KeyVersionRecord) -> int:
        """Add ``record`` as a new secret version; its number."""
        data = json.dumps(_to_json(record), sort_keys=True).encode()
        added = await self._call(
            "add_secret_version",
            sm.AddSecretVersionRequest(
                parent=_parent(self._project, record.name, record.version),
                payload=sm.SecretPayload(data=data, data_crc32c=crc32c(data)),
            ),
        )
        return _number(added.name)

    async def _access(self, parent: str, number: int | None) -> _Found | None:
        """The record in version ``number`` (``latest`` when None); None when there is none.

        Raises:
            _Moved: that version is destroyed.
        """
        name = f"{parent}/versions/{'latest' if number is None else number}"
        try:
            response = await self._call(
                "access_secret_version", sm.AccessSecretVersionRequest(name=name)
            )
        except api_exceptions.NotFound:
            return None
        except UpstreamError as exc:
            if isinstance(exc.__cause__, api_exceptions.FailedPrecondition):
                raise _Moved from exc
            raise
        data = bytes(response.payload.data)
        if crc32c(data) != response.payload.data_crc32c:
            raise _unavailable("a secret payload was corrupted in transit")
        try:
            return _Found(_number(response.name), _from_json(json.loads(data)))
        except (ValueError, KeyError, TypeError) as exc:
            raise _unavailable("a secret payload is not a broker key record") from exc

    async def _shred(self, parent: str, keep: int) -> None:
        """Destroy every secret version but ``keep`` (a destroyed record), then note it done.
        Best effort: a failure is logged and the next read of the record tries again."""
        try:
            token = await self._destroy_others(parent, keep, PAGE_SIZE)
            while token:
                token = await self._destroy_others(parent, keep, PAGE_SIZE, token=token)
            await self._call(
                "update_secret",
                sm.UpdateSecretRequest(
                    secret=sm.Secret(name=parent, annotations={SHREDDED: str(keep)}),
                    update_mask={"paths": ["annotations"]},
                ),
            )
        except UpstreamError:
            log.warning("%s: earlier payloads not all destroyed yet (retried on read)", parent)

    async def _sweep(self, parent: str, keep: int) -> None:
        """Destroy a page of enabled versions but ``keep`` (the destroyed record the alias names):
        what a stale change added after the shredding and failed to discard. Best effort."""
        try:
            await self._destroy_others(parent, keep, SWEEP_PAGE, enabled_only=True)
        except UpstreamError:
            log.warning("%s: a version left after the destroy not destroyed yet", parent)

    async def _destroy_others(
        self, parent: str, keep: int, page_size: int, *, token: str = "", enabled_only: bool = False
    ) -> str:
        """Destroy the versions of one page of ``parent``'s versions but ``keep``; the next page's
        token ("" for none). Idempotent: a destroyed version is left as it is."""
        page = await self._call(
            "list_secret_versions",
            sm.ListSecretVersionsRequest(
                parent=parent,
                page_size=page_size,
                page_token=token,
                filter="state:ENABLED" if enabled_only else "",
            ),
        )
        for version in page.versions:
            if _number(version.name) != keep and version.state != sm.SecretVersion.State.DESTROYED:
                await self._call(
                    "destroy_secret_version", sm.DestroySecretVersionRequest(name=version.name)
                )
        return str(page.next_page_token)

    async def _call(self, method: str, request: Any) -> Any:
        return await call(
            self._client, method, request, deadline_seconds=self._timeout, unavailable=_unavailable
        )


def _secret_id(name: str, version: int) -> str:
    return f"broker-dek-{key_hash(name)}-v{version}"


def _parent(project: str, name: str, version: int) -> str:
    return f"{project}/secrets/{_secret_id(name, version)}"


def _number(version_name: str) -> int:
    """The number of ``…/versions/N``."""
    return int(version_name.rsplit("/", 1)[1])


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
