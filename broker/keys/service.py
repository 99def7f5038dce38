"""Key lifecycle and key material access: the only code that sees plaintext DEKs.

A DEK whose KEK keeps it in its HSM (``x-hsm-rewrap``, ``keys/custody.py``) is never plaintext
here: the token makes it, wraps it and releases it. For every other DEK, plaintext exists only in
process memory: briefly while wrapping it to a runner key, and in the bounded DEK cache
(``dek_cache_seconds``, ``dek_cache_max``) so a release does not pay a KMS/HSM round trip each
time. A release reads key metadata (state, wrapped DEK) from a second small cache
(``metadata_cache_seconds``, default 1 s) instead of the store, so it makes no store round trip
and no thread hop. Lifecycle changes made through this process (create, rotate, disable, enable,
destroy, rewrap) invalidate both caches at once; a change made by another process or replica
takes effect here within ``metadata_cache_seconds`` (docs/keys.md). Set it to 0 to read the
store on every release.

Lifecycle: ``create`` (version 1), ``rotate`` (a new version; older ones stay usable until
disabled), ``disable`` / ``enable``, ``destroy`` (the wrapped material is deleted for good; the
metadata and the log history stay), ``import`` (bring your own 32-byte DEK), ``rewrap`` (move
every DEK to the primary KEK, one atomic compare-and-swap per DEK, so it can be killed and re-run
at any moment). Every change is two ``key_admin`` records in the decision log when one is
attached (``keys/changes.py``): its intent, before the store is touched (a change that cannot be
recorded is not made), then its outcome (``result`` ok, error or unknown, and the intent's
index). A change rests on the row it was read as: the store writes it only over that exact row,
never over a destroyed one (``KeyStore.replace``), so a stale read never undoes a newer change.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker.core.errors import (
    Conflict,
    ErrorCode,
    InputError,
    KeyUnavailable,
    NotFound,
    UpstreamError,
)
from broker.core.protocol import Algorithm
from broker.crypto.jwk import RunnerKey
from broker.keys.caches import DekCache, MetadataCache, dek_cache_key
from broker.keys.changes import (
    ERROR,
    OK,
    UNKNOWN,
    ChangeLogger,
    Recorder,
    key_admin_entry,
    recorded,
)
from broker.keys.custody import (
    DekCustody,
    check_release_wrap,
    custody_of,
    refuse_plaintext,
    rewrap_to,
)
from broker.keys.kek.base import KekProvider, dek_aad
from broker.keys.kek.ring import KekRing
from broker.keys.material import (
    aes_algorithm,
    check_imported,
    new_material,
    query_public_of,
)
from broker.keys.store.base import (
    KeyStore,
    KeyVersionRecord,
    Purpose,
    VersionState,
    same_row,
)

KEY_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")
MAX_KEY_NAME = 128


def validate_key_name(name: str) -> str:
    """Key names: lower-case path segments (``models/llama-70b``), at most 128 characters.

    Raises:
        InputError: ``bad_request`` for another form.
    """
    if len(name) > MAX_KEY_NAME or not KEY_NAME.match(name):
        raise InputError(
            "key names are lower-case segments of [a-z0-9._-] joined by '/', "
            f"at most {MAX_KEY_NAME} characters"
        )
    return name


@dataclass(frozen=True)
class RewrapReport:
    rewrapped: int
    already_current: int
    skipped_destroyed: int
    lost: int = 0  # changed by another writer meanwhile (left as they are: the next run moves them)


MAX_CHECKED_PUBLIC = 4096  # query-key versions remembered as checked (then checked afresh)
SYSTEM_ACTOR = "broker"  # who, when the broker itself acts (demo set-up, tests)


class KeyService:
    def __init__(
        self,
        store: KeyStore,
        keks: KekRing,
        *,
        cache: DekCache | None = None,
        metadata: MetadataCache | None = None,
        change_log: ChangeLogger | None = None,
        query_keys_publishable: bool = False,
    ) -> None:
        self._store = store
        self._query_keys_publishable = query_keys_publishable  # [keys] signing_key is set
        self._keks = keks
        self._cache = cache if cache is not None else DekCache(ttl_seconds=0, max_entries=0)
        self._metadata = (
            metadata if metadata is not None else MetadataCache(ttl_seconds=0, max_entries=0)
        )
        self._change_log = change_log
        # the public halves already checked against their wrapped private halves: a public,
        # unauthenticated GET must not cost a KEK call each time (that record, those bytes)
        self._checked_public: set[tuple[str, int, str, bytes, bytes]] = set()

    @property
    def kek(self) -> KekProvider:
        return self._keks.primary

    @property
    def keks(self) -> KekRing:
        return self._keks

    @property
    def cache(self) -> DekCache:
        return self._cache

    # --- lifecycle ---------------------------------------------------------------------------

    async def create(
        self,
        name: str,
        purpose: Purpose,
        *,
        now: datetime,
        who: str = SYSTEM_ACTOR,
        material: bytes | None = None,
        algorithm: Algorithm | None = None,
    ) -> KeyVersionRecord:
        """Version 1 of a new key: a random AES-256 DEK, or an HPKE key pair for ``query``.

        Raises:
            InputError: bad name or material, or a query key where no statement signing key is
                configured (its public half could not be published); ``Conflict`` when the
                key exists.
            UpstreamError: when the KEK or the store cannot answer.
        """
        validate_key_name(name)
        if purpose is Purpose.QUERY and not self._query_keys_publishable:
            raise InputError(
                "query keys need [keys] signing_key: their public halves are published signed"
            )
        if await self._store.latest_version(name, enabled_only=False) is not None:
            raise Conflict(f"key {name!r} exists; rotate it to add a version")
        record = await self._new_version(
            name, 1, purpose, now=now, material=material, algorithm=algorithm
        )
        await self._add("create", record, now, who)
        return record

    async def import_key(
        self,
        name: str,
        purpose: Purpose,
        material: bytes,
        *,
        now: datetime,
        who: str = SYSTEM_ACTOR,
    ) -> KeyVersionRecord:
        """``create`` with caller-supplied material (32 bytes for AES-256 keys)."""
        check_imported(purpose, material)
        return await self.create(name, purpose, now=now, who=who, material=material)

    async def rotate(
        self, name: str, *, now: datetime, who: str = SYSTEM_ACTOR
    ) -> KeyVersionRecord:
        """A new version with fresh material; earlier versions stay as they are."""
        latest = await self._require_latest(name)
        record = await self._next_version(name, latest, latest.purpose, now=now)
        await self._add("rotate", record, now, who)
        return record

    async def import_version(
        self,
        name: str,
        purpose: Purpose,
        material: bytes,
        *,
        now: datetime,
        who: str = SYSTEM_ACTOR,
    ) -> KeyVersionRecord:
        """A new version of ``name`` from a DEK its owner made (``POST /v1/admin/keys/import``,
        ``broker weights encrypt --url``): version 1 of a new key, else the next version, as
        ``rotate`` numbers it. Wrapped by the primary KEK (or imported into the HSM keeping
        DEKs), logged as a ``key_admin`` ``import`` record without the material.

        Raises:
            InputError: ``key_material_invalid`` unless 32 bytes; ``bad_request`` for a query
                key, or a purpose other than the existing key's.
            Conflict: ``conflict`` when another change took the version number first.
            UpstreamError: when the KEK or the store cannot answer.
        """
        validate_key_name(name)
        check_imported(purpose, material)
        latest = await self._store.latest_version(name, enabled_only=False)
        if latest is not None and latest.purpose is not purpose:
            raise InputError(f"key {name!r} is a {latest.purpose.value} key, not {purpose.value}")
        record = await self._next_version(name, latest, purpose, now=now, material=material)
        await self._add("import", record, now, who)
        return record

    async def set_enabled(
        self, name: str, version: int, enabled: bool, *, now: datetime, who: str = SYSTEM_ACTOR
    ) -> KeyVersionRecord:
        record = await self._require(name, version)
        if record.state is VersionState.DESTROYED:
            raise KeyUnavailable(f"key {name!r} version {version} is destroyed")
        state = VersionState.ENABLED if enabled else VersionState.DISABLED
        updated = record.evolve(state=state, updated_at=now)
        await self._replace("enable" if enabled else "disable", updated, record, now, who)
        return updated

    async def destroy(
        self, name: str, version: int, *, now: datetime, who: str = SYSTEM_ACTOR
    ) -> KeyVersionRecord:
        """Delete the wrapped material for good; metadata and history remain.

        Raises:
            KeyUnavailable: the version is destroyed already.
        """
        record = await self._require(name, version)
        if record.state is VersionState.DESTROYED:
            raise KeyUnavailable(f"key {name!r} version {version} is destroyed")
        updated = record.evolve(state=VersionState.DESTROYED, wrapped_dek=b"", updated_at=now)
        await self._replace("destroy", updated, record, now, who)
        return updated

    async def list_versions(self, name: str | None = None) -> list[KeyVersionRecord]:
        return await self._store.list_versions(name)

    async def has_query_keys(self) -> bool:
        """Whether the store holds any query key: one cheap store call, no key material read
        (``/readyz``'s background check; it also shows the store answers).

        Raises:
            UpstreamError: ``key_store_unavailable``.
        """
        return await self._store.has_purpose(Purpose.QUERY)

    async def show(self, name: str) -> list[KeyVersionRecord]:
        versions = await self._store.list_versions(name)
        if not versions:
            raise NotFound(f"no key {name!r}", code=ErrorCode.KEY_UNKNOWN)
        return versions

    # --- release path ------------------------------------------------------------------------

    async def resolve(self, name: str, version: int | None) -> KeyVersionRecord:
        """The version a release would use: the named one, or the newest enabled one.

        Raises:
            NotFound: ``key_unknown``.
            KeyUnavailable: ``key_version_unavailable`` when disabled or destroyed.
        """
        record = self._metadata.get((name, version))
        if record is None:
            record = await self._read(name, version)
            if record is not None and record.state is VersionState.ENABLED:
                self._metadata.put((name, version), record)
        if record is None:
            suffix = "" if version is None else f" version {version}"
            raise NotFound(f"no key {name!r}{suffix}", code=ErrorCode.KEY_UNKNOWN)
        if record.state is not VersionState.ENABLED:
            raise KeyUnavailable(f"key {name!r} version {record.version} is {record.state.value}")
        return record

    async def query_public(self, record: KeyVersionRecord) -> bytes:
        """A query key's public half as its private half gives it: the stored one is only
        checked against it (whoever can write the store, e.g. the operator of a sealed broker,
        must not get their own public key signed by the broker's attested statement key).

        Raises:
            UpstreamError: ``key_record_invalid`` when the stored half differs; as ``unwrap``.
        """
        checked = (
            record.name,
            record.version,
            record.kek_ref,
            record.wrapped_dek,
            record.public_key,
        )
        if checked in self._checked_public:  # the same bytes as checked before
            return record.public_key
        public = query_public_of(record.algorithm, await self.unwrap(record))
        if not hmac.compare_digest(public, record.public_key):
            raise UpstreamError(
                f"the stored public half of query key {record.name!r} version {record.version} "
                "is not its private half's (the key store was edited); nothing signed",
                code=ErrorCode.KEY_RECORD_INVALID,
            )
        if len(self._checked_public) >= MAX_CHECKED_PUBLIC:
            self._checked_public.clear()
        self._checked_public.add(checked)
        return public

    async def unwrap(self, record: KeyVersionRecord) -> bytes:
        """The plaintext material of a resolved version (cached within bounds).

        Raises:
            KeyUnavailable: for a destroyed version.
            UpstreamError: ``kek_unavailable`` when the KEK cannot unwrap it.
        """
        if record.state is VersionState.DESTROYED or not record.wrapped_dek:
            raise KeyUnavailable(f"key {record.name!r} version {record.version} is destroyed")
        kek = self._keks.for_ref(record.kek_ref)
        if custody_of(kek, record.purpose) is not None:
            raise refuse_plaintext(record)
        cached = self._cache.get(dek_cache_key(record))
        if cached is not None:
            return cached
        material = await kek.unwrap(record.wrapped_dek, dek_aad(record.name, record.version))
        self._cache.put(dek_cache_key(record), material)
        return material

    def check_release(
        self, record: KeyVersionRecord, mode: str, runner_key: RunnerKey
    ) -> DekCustody | None:
        """Refuse, before the policy runs, a wrap this version cannot be released with; return
        the HSM keeping its DEK, if one does (release it with ``custody.release_from_custody``,
        never ``unwrap``).

        Raises:
            InputError: ``runner_key_invalid``.
            UpstreamError: ``kek_unavailable`` when its KEK is not configured.
        """
        custody = custody_of(self._keks.for_ref(record.kek_ref), record.purpose)
        check_release_wrap(record, mode, runner_key, custody)
        return custody

    async def owner_material(
        self,
        name: str,
        version: int | None,
        *,
        action: str,
        detail: Mapping[str, Any],
        now: datetime,
        who: str = SYSTEM_ACTOR,
    ) -> tuple[KeyVersionRecord, bytes]:
        """The DEK of an enabled model-weights version for its owner's own use (``broker weights
        encrypt|decrypt``), logged as a ``key_admin`` record with ``action`` before it is
        returned — key material never leaves the broker's code without a record.

        Raises:
            NotFound, KeyUnavailable: as ``resolve``; ``InputError`` for a non-weights key.
        """
        record = await self.resolve(name, version)
        if record.purpose is Purpose.QUERY:
            raise InputError(f"key {name!r} is a query key, not a data key")
        material = await self.unwrap(record)
        await self._log_event(
            action, {"key": record.name, "version": record.version, **detail}, now, who
        )
        return record, material

    async def log_outcome(
        self, action: str, detail: Mapping[str, Any], *, now: datetime, who: str = SYSTEM_ACTOR
    ) -> None:
        """A ``key_admin`` record of how an owner's use of a key ended (``weights-decrypt``:
        ``outcome`` ok or failed, and why), after the record ``owner_material`` wrote first."""
        await self._log_event(action, detail, now, who)

    # --- KEK rotation ------------------------------------------------------------------------

    async def rewrap(
        self,
        *,
        now: datetime,
        who: str = SYSTEM_ACTOR,
        on_progress: Callable[[int], None] | None = None,
    ) -> RewrapReport:
        """Move every DEK under the primary KEK. Safe to kill and re-run at any point.

        Each DEK is unwrapped with the KEK that wrapped it, wrapped with the primary, and written
        back only over the exact row it was read from (one atomic compare-and-swap: only the
        wrapped DEK and its KEK change), so every DEK is at every moment wrapped by exactly one
        KEK that its record names, and no other change is undone; a DEK changed meanwhile is
        left as it is and counted (``lost``): the next run moves it. Recorded as
        ``rewrap-start`` before the first move and ``rewrap`` (``result`` ok, error with the
        code, or unknown when interrupted; the counts so far and the intent's index) at the end.
        """
        target = self._keks.primary
        counts = {"rewrapped": 0, "lost": 0}
        versions = await self._store.list_versions()
        moving = [r for r in versions if r.state is not VersionState.DESTROYED]
        current = sum(1 for r in moving if r.kek_ref == target.reference)
        report = RewrapReport(0, current, len(versions) - len(moving))
        if current == len(moving):
            return report
        fields = {"kek": target.reference}
        intent = await Recorder(self._change_log, "rewrap-start", fields, now, who).intent()
        closing = Recorder(self._change_log, "rewrap", fields, now, who)
        try:
            for record in moving:
                if record.kek_ref != target.reference:
                    moved = await self._rewrap_one(record, now)
                    counts["rewrapped" if moved else "lost"] += 1
                    if moved and on_progress is not None:
                        on_progress(counts["rewrapped"])
        except Exception as exc:
            await closing.outcome(intent, ERROR, counts, failure=exc)
            raise
        except asyncio.CancelledError:  # Ctrl-C: the DEK in flight may or may not have moved
            await closing.outcome(intent, UNKNOWN, {**counts, "message": "interrupted"})
            raise
        await closing.outcome(intent, OK, counts)
        return RewrapReport(counts["rewrapped"], current, report.skipped_destroyed, counts["lost"])

    async def _rewrap_one(self, record: KeyVersionRecord, now: datetime) -> bool:
        """Move one DEK to the primary KEK over its exact row; False when that row changed."""
        target = self._keks.primary
        wrapped = await rewrap_to(record, self._keks.for_ref(record.kek_ref), target)
        updated = record.evolve(wrapped_dek=wrapped, kek_ref=target.reference, updated_at=now)
        moved = await self._store.replace(updated, expected=record)
        self._invalidate(record.name)
        return moved

    # --- helpers -----------------------------------------------------------------------------

    async def _read(self, name: str, version: int | None) -> KeyVersionRecord | None:
        if version is not None:
            return await self._store.get_version(name, version)
        record = await self._store.latest_version(name, enabled_only=True)
        if record is None:
            record = await self._store.latest_version(name, enabled_only=False)
        return record

    def _invalidate(self, name: str) -> None:
        self._cache.invalidate(name)
        self._metadata.invalidate(name)

    async def _new_version(
        self,
        name: str,
        version: int,
        purpose: Purpose,
        *,
        now: datetime,
        material: bytes | None = None,
        algorithm: Algorithm | None = None,
    ) -> KeyVersionRecord:
        """A new version's record, its material made (or imported) and wrapped; not stored yet
        (``_add`` stores it after its intent is recorded)."""
        kek = self._keks.primary
        aad = dek_aad(name, version)
        custody = custody_of(kek, purpose)
        if custody is None:
            algorithm, secret, public = new_material(purpose, material, algorithm)
            wrapped = await kek.wrap(secret, aad)
        else:  # made (or imported) in the HSM; it stays there
            algorithm, public = aes_algorithm(purpose, algorithm), b""
            making = custody.generate(aad) if material is None else custody.import_(material, aad)
            wrapped = await making
        return KeyVersionRecord(
            name=name,
            version=version,
            purpose=purpose,
            state=VersionState.ENABLED,
            wrapped_dek=wrapped,
            kek_ref=kek.reference,
            created_at=now,
            updated_at=now,
            algorithm=algorithm,
            public_key=public,
        )

    async def _next_version(
        self,
        name: str,
        latest: KeyVersionRecord | None,
        purpose: Purpose,
        *,
        now: datetime,
        material: bytes | None = None,
    ) -> KeyVersionRecord:
        """The version after ``latest`` (version 1 when there is none), as ``latest`` was made;
        not stored yet (``_add``)."""
        version, algorithm = (1, None) if latest is None else (latest.version + 1, latest.algorithm)
        return await self._new_version(
            name, version, purpose, now=now, material=material, algorithm=algorithm
        )

    async def _add(self, action: str, record: KeyVersionRecord, now: datetime, who: str) -> None:
        """Store a new version, recorded (intent, then outcome).

        Raises:
            Conflict: ``conflict`` when another change took that version number first.
        """

        async def commit() -> Mapping[str, Any]:
            try:
                await self._store.add_version(record)
            except Conflict as exc:  # another rotation (or import) took this version number
                message = f"key {record.name!r} was rotated concurrently; retry"
                if record.version == 1:
                    message = f"key {record.name!r} was created concurrently"
                raise Conflict(message, code=ErrorCode.CONFLICT) from exc
            return {}

        async def check() -> bool | None:
            stored = await self._store.get_version(record.name, record.version)
            if stored is None:
                return False
            return True if same_row(stored, record) else None

        await self._recorded(action, record, now=now, who=who, commit=commit, check=check)

    async def _require(self, name: str, version: int) -> KeyVersionRecord:
        record = await self._store.get_version(name, version)
        if record is None:
            raise NotFound(f"no key {name!r} version {version}", code=ErrorCode.KEY_UNKNOWN)
        return record

    async def _require_latest(self, name: str) -> KeyVersionRecord:
        record = await self._store.latest_version(name, enabled_only=False)
        if record is None:
            raise NotFound(f"no key {name!r}", code=ErrorCode.KEY_UNKNOWN)
        return record

    async def _replace(
        self,
        action: str,
        updated: KeyVersionRecord,
        current: KeyVersionRecord,
        now: datetime,
        who: str,
    ) -> None:
        """Write ``updated`` over the exact row ``current`` was read as, recorded.

        Raises:
            Conflict: ``conflict`` when that row changed meanwhile (or was destroyed).
        """

        async def commit() -> Mapping[str, Any]:
            if not await self._store.replace(updated, expected=current):
                raise Conflict(
                    f"key {updated.name!r} version {updated.version} changed meanwhile; retry",
                    code=ErrorCode.CONFLICT,
                )
            return {}

        async def check() -> bool | None:
            stored = await self._store.get_version(updated.name, updated.version)
            if stored is not None and same_row(stored, updated):
                return True
            return False if stored is not None and same_row(stored, current) else None

        await self._recorded(action, updated, now=now, who=who, commit=commit, check=check)

    async def _recorded(
        self,
        action: str,
        record: KeyVersionRecord,
        *,
        now: datetime,
        who: str,
        commit: Callable[[], Awaitable[Mapping[str, Any]]],
        check: Callable[[], Awaitable[bool | None]],
    ) -> None:
        """``changes.recorded`` for one version; the caches are invalidated once the store is
        written (or not), inside the shielded change: a caller gone does not skip it."""

        async def committed() -> Mapping[str, Any]:
            try:
                return await commit()
            finally:
                self._invalidate(record.name)

        recorder = Recorder(self._change_log, action, _fields(record), now, who)
        await recorded(recorder, committed, check)

    async def _log_event(
        self, action: str, fields: Mapping[str, Any], now: datetime, who: str
    ) -> None:
        if self._change_log is not None:
            await self._change_log(key_admin_entry(action, fields, now=now, who=who))


def _fields(record: KeyVersionRecord) -> dict[str, Any]:
    """What a ``key_admin`` record says about a version (never its material)."""
    return {
        "key": record.name,
        "version": record.version,
        "purpose": record.purpose.value,
        "state": record.state.value,
        "algorithm": record.algorithm.value,
        "kek": record.kek_ref,
    }
