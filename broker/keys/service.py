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
at any moment). Every change is appended to the decision log when one is attached, and the
record comes first (as for a policy change): a change that cannot be recorded is not made; a
change recorded and then not made (a race, the store down, a bug) is followed by a record of the
same action with ``result: error`` and its code, so a log never lacks a change the store holds.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker.core.errors import (
    BrokerError,
    Conflict,
    ErrorCode,
    InputError,
    KeyUnavailable,
    NotFound,
    UpstreamError,
)
from broker.core.protocol import Algorithm
from broker.core.records import RecordType
from broker.crypto.jwk import RunnerKey
from broker.keys.caches import DekCache, MetadataCache, dek_cache_key
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
from broker.keys.store.base import KeyStore, KeyVersionRecord, Purpose, VersionState

KEY_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")
MAX_KEY_NAME = 128
ChangeLogger = Callable[[Mapping[str, Any]], Awaitable[object]]
log = logging.getLogger(__name__)


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
        await self._recorded("create", record, now, who, self._store.add_version(record))
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
        await self._recorded("rotate", record, now, who, self._add_next(record))
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
        await self._recorded("import", record, now, who, self._add_next(record))
        return record

    async def set_enabled(
        self, name: str, version: int, enabled: bool, *, now: datetime, who: str = SYSTEM_ACTOR
    ) -> KeyVersionRecord:
        record = await self._require(name, version)
        if record.state is VersionState.DESTROYED:
            raise KeyUnavailable(f"key {name!r} version {version} is destroyed")
        state = VersionState.ENABLED if enabled else VersionState.DISABLED
        updated = record.evolve(state=state, updated_at=now)
        action = "enable" if enabled else "disable"
        await self._recorded(action, updated, now, who, self._replace(updated, record))
        return updated

    async def destroy(
        self, name: str, version: int, *, now: datetime, who: str = SYSTEM_ACTOR
    ) -> KeyVersionRecord:
        """Delete the wrapped material for good; metadata and history remain."""
        record = await self._require(name, version)
        updated = record.evolve(state=VersionState.DESTROYED, wrapped_dek=b"", updated_at=now)
        await self._recorded("destroy", updated, now, who, self._replace(updated, record))
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
        back only if its ``kek_ref`` did not change meanwhile (one atomic compare-and-swap), so
        every DEK is at every moment wrapped by exactly one KEK that its record names.
        """
        target = self._keks.primary
        rewrapped = current = destroyed = 0
        versions = await self._store.list_versions()
        moving = [r for r in versions if r.state is not VersionState.DESTROYED]
        if any(r.kek_ref != target.reference for r in moving):  # recorded before any moves
            await self._log_event("rewrap-start", {"kek": target.reference}, now, who)
        for record in versions:
            if record.state is VersionState.DESTROYED:
                destroyed += 1
                continue
            if record.kek_ref == target.reference:
                current += 1
                continue
            updated = record.evolve(
                wrapped_dek=await rewrap_to(record, self._keks.for_ref(record.kek_ref), target),
                kek_ref=target.reference,
                updated_at=now,
            )
            if await self._store.replace(updated, expect_kek_ref=record.kek_ref):
                self._invalidate(record.name)
                rewrapped += 1
                if on_progress is not None:
                    on_progress(rewrapped)
        if rewrapped or current:
            await self._log_event(
                "rewrap", {"kek": target.reference, "rewrapped": rewrapped}, now, who
            )
        return RewrapReport(
            rewrapped=rewrapped, already_current=current, skipped_destroyed=destroyed
        )

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
        (``_recorded`` stores it after its record)."""
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
        not stored yet (``_add_next``)."""
        version, algorithm = (1, None) if latest is None else (latest.version + 1, latest.algorithm)
        return await self._new_version(
            name, version, purpose, now=now, material=material, algorithm=algorithm
        )

    async def _add_next(self, record: KeyVersionRecord) -> None:
        """Store a version ``_next_version`` made.

        Raises:
            Conflict: ``conflict`` when another change took that version number first.
        """
        try:
            await self._store.add_version(record)
        except Conflict as exc:  # another rotation (or import) took this version number first
            raise Conflict(
                f"key {record.name!r} was rotated concurrently; retry", code=ErrorCode.CONFLICT
            ) from exc

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

    async def _replace(self, updated: KeyVersionRecord, current: KeyVersionRecord) -> None:
        if not await self._store.replace(updated, expect_kek_ref=current.kek_ref):
            raise Conflict(
                f"key {updated.name!r} version {updated.version} changed meanwhile; retry",
                code=ErrorCode.CONFLICT,
            )

    async def _recorded(
        self,
        action: str,
        record: KeyVersionRecord,
        now: datetime,
        who: str,
        commit: Coroutine[Any, Any, None],
    ) -> None:
        """Record the change, then make it (``commit``), shielded from the caller's
        cancellation (an admin hanging up cannot leave a change half done): a change the log
        cannot take is not made (the append's error is raised, the store untouched). A commit
        that fails after its record is followed by the same action with ``result: error`` and
        the code (best effort: if the log fails again, the first record stands alone and the
        store shows the change was not made); the commit's error is raised either way.
        """
        await asyncio.shield(self._record_then_commit(action, record, now, who, commit))

    async def _record_then_commit(
        self,
        action: str,
        record: KeyVersionRecord,
        now: datetime,
        who: str,
        commit: Coroutine[Any, Any, None],
    ) -> None:
        fields = _fields(record)
        try:
            await self._log_event(action, fields, now, who)
        except BaseException:
            commit.close()  # never awaited: nothing runs it
            raise
        try:
            await commit
        except Exception as exc:
            code = exc.code if isinstance(exc, BrokerError) else ErrorCode.INTERNAL
            message = exc.message if isinstance(exc, BrokerError) else "the change failed"
            failed = {**fields, "result": "error", "code": code.value, "message": message}
            try:
                await self._log_event(action, failed, now, who)
            except Exception:  # the first record stands; the store says it was not made
                log.exception(
                    "key %s %s: not made, and not recorded as failed", record.name, action
                )
            raise
        finally:
            self._invalidate(record.name)

    async def _log_event(
        self, action: str, fields: Mapping[str, Any], now: datetime, who: str
    ) -> None:
        if self._change_log is not None:
            await self._change_log(
                {
                    "type": RecordType.KEY_ADMIN,
                    "action": action,
                    "time": now.isoformat(),
                    "who": who,
                    **fields,
                }
            )


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
