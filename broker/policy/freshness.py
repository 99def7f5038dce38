"""Policy freshness, TUF's rule: never go back, never past expiry.

What the security team signs carries, in the signature's payload (OPA's ``.signatures.json``
JWS; ``opa build/sign --claims-file`` writes the same claims):

* ``policy_version``: a positive integer that only grows from one published bundle to the next
  (``broker policy build --version``, default the build time in Unix seconds);
* ``policy_expires``: Unix seconds after which the bundle is refused
  (``broker policy build --expires-in``, default 30 days).

Each replica keeps, beside its decision log (``<log>.policy/``, shared by its workers under a
``flock``, files replaced atomically):

* ``state.json``: the floor (the version in force, and the SHA-256 of the bundle that version
  names) and the highest version ever loaded. A bundle below the floor is a rollback and refused,
  and so is another bundle with the floor's version (a version names one bundle); after a
  deliberate downgrade through the admin API (naming the target version) the floor is the older
  version, and the versions rolled back from (above the floor, up to the highest) stay refused,
  so whoever can write the bundle storage cannot serve them back. A missing or corrupt
  ``state.json`` is no reset: the floor is then at least the version of the decision log's last
  ``policy_change`` record (``merged``);
* ``bundle.tar.gz``: the last verified bundle, the replica's start-up policy while the bundle
  server is down (verified again, freshness included, before it serves);
* ``refused.json``: the refused bundles already logged (by SHA-256 of their bytes), so one refused
  bundle is one ``policy_reload_failed`` record, whichever worker or poll met it first.

``check`` is pure (claims, state and ``now`` in; an error out); ``FreshnessStore`` does the I/O.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from broker.policy.wasm import PolicyLoadError

VERSION_CLAIM = "policy_version"
EXPIRES_CLAIM = "policy_expires"
MAX_VERSION = 2**53 - 1  # JSON-safe integers only
MAX_REFUSALS_KEPT = 256
STATE = "state.json"
CACHED_BUNDLE = "bundle.tar.gz"
REFUSED = "refused.json"
LOCK = "lock"


@dataclass(frozen=True)
class Freshness:
    """A signed bundle's verified ``policy_version`` and ``policy_expires``."""

    version: int
    expires: int  # Unix seconds

    @property
    def expires_at(self) -> str:
        return datetime.fromtimestamp(self.expires, UTC).isoformat()


@dataclass(frozen=True)
class FreshnessState:
    """What a replica has loaded: the floor (the version in force) and the highest ever."""

    version: int = 0
    highest: int = 0
    bundle_sha256: str | None = None
    downgraded_by: str | None = None
    downgrade_reason: str | None = None


@dataclass(frozen=True)
class DowngradeTarget:
    """What an admin downgrade names: the version to go to, and optionally its bundle's bytes
    (``sha256:<hex>``); every worker refuses any other bundle during that downgrade."""

    version: int
    bundle_sha256: str | None = None


class StaleBundle(PolicyLoadError):
    """A signed bundle that is expired, older than, or rolled back from, what this replica
    loaded."""


class CorruptState(ValueError):
    """``state.json`` exists but is not a state this broker wrote."""


def claims_of(claims: Mapping[str, Any], *, source: str) -> Freshness:
    """The freshness claims of a verified signature payload.

    Raises:
        PolicyLoadError: a claim missing, not an integer, or out of range.
    """
    version, expires = claims.get(VERSION_CLAIM), claims.get(EXPIRES_CLAIM)
    for name, value in ((VERSION_CLAIM, version), (EXPIRES_CLAIM, expires)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_VERSION:
            raise PolicyLoadError(
                f"{source}: the signature carries no usable {name} (a positive integer; "
                "broker policy build sets it, or opa build/sign --claims-file)"
            )
    return Freshness(version=int(str(version)), expires=int(str(expires)))


def check(
    fresh: Freshness,
    state: FreshnessState,
    *,
    now: datetime,
    sha256: str | None = None,
    downgrade: DowngradeTarget | None = None,
    source: str,
) -> None:
    """Refuse an expired bundle, and one older than the replica's floor or rolled back from.

    1. Expiry: ``now`` at or past ``policy_expires`` refuses (a downgrade cannot lift it).
    2. An admin ``downgrade`` accepts exactly the bundle it names (version, and bytes when it
       names them), whatever the floor; any other bundle is refused.
    3. Version: below the floor, or above it and at most the highest version ever loaded
       after a downgrade (the versions withdrawn), refuses; so does the floor's version with
       other bytes (``sha256``) than the bundle it names.

    Raises:
        StaleBundle: naming both versions, or the expiry.
    """
    if now.timestamp() >= fresh.expires:
        raise StaleBundle(f"{source}: the bundle expired at {fresh.expires_at}")
    if downgrade is not None:
        _check_target(fresh, downgrade, sha256, source=source)
        return
    named = state.bundle_sha256
    if fresh.version == state.version and None not in (sha256, named) and sha256 != named:
        raise StaleBundle(
            f"{source}: bundle version {fresh.version} is already in force with other bytes "
            f"({named}); a version names one bundle: publish a new version"
        )
    if fresh.version < state.version:
        raise StaleBundle(
            f"{source}: bundle version {fresh.version} is older than version {state.version} "
            "already loaded (a rollback); a deliberate downgrade goes through "
            "POST /v1/admin/policy/reload with allow_downgrade, to_version and a reason"
        )
    if state.version < fresh.version <= state.highest:
        raise StaleBundle(
            f"{source}: bundle version {fresh.version} was rolled back from (downgrade to "
            f"{state.version}); publish a version above {state.highest}"
        )


def _check_target(
    fresh: Freshness, target: DowngradeTarget, sha256: str | None, *, source: str
) -> None:
    if fresh.version != target.version:
        raise StaleBundle(
            f"{source}: the downgrade names version {target.version}; the source serves "
            f"version {fresh.version}"
        )
    if target.bundle_sha256 is not None and sha256 != target.bundle_sha256:
        raise StaleBundle(
            f"{source}: the downgrade names bundle {target.bundle_sha256}; the source serves "
            f"{sha256}"
        )


def logged_floor(record: Mapping[str, Any] | None) -> FreshnessState | None:
    """The floor a ``policy_change`` record names (its ``version`` and ``bundle_sha256``);
    ``None`` for none, or one without a usable version (a directory, an unsigned bundle)."""
    version = None if record is None else record.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 < version <= MAX_VERSION:
        return None
    sha = record.get("bundle_sha256") if record is not None else None
    return FreshnessState(version, version, sha if isinstance(sha, str) else None)


def merged(state: FreshnessState, known: FreshnessState) -> FreshnessState:
    """``state`` (from ``state.json``) raised to at least ``known`` (the version the decision
    log last put in force, and any this worker loaded since): a lost or rolled-back state file
    does not lower the floor."""
    if known.version <= state.version:
        return state
    return replace(
        state,
        version=known.version,
        highest=max(state.highest, known.version),
        bundle_sha256=known.bundle_sha256,
    )


class FreshnessStore:
    """``<log>.policy/``: the replica's floor, its last verified bundle, and the refusals
    already logged; shared by the workers under one ``flock``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def read(self) -> FreshnessState:
        """The state on disk; an empty one when it is missing or corrupt."""
        try:
            return self.read_state() or FreshnessState()
        except CorruptState:
            return FreshnessState()

    def read_state(self) -> FreshnessState | None:
        """The state on disk, ``None`` when there is none.

        Raises:
            CorruptState: it cannot be read, is not JSON, or its fields are not what this
                broker writes (e.g. a version that is not an integer).
        """
        try:
            value = json.loads((self.directory / STATE).read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise CorruptState(f"{self.directory / STATE}: {exc}") from exc
        return _state_of(value, self.directory / STATE)

    def advance(
        self,
        fresh: Freshness | None,
        raw: bytes,
        sha256: str,
        *,
        downgrade: tuple[str, str] | None = None,
    ) -> FreshnessState:
        """After a bundle went live: keep its bytes, and raise the floor to its version (never
        lower it, except for a ``downgrade`` = (who, reason) through the admin API).

        Raises:
            OSError: the directory cannot be written.
        """
        with self._locked():
            current = self.read()
            state = current
            if fresh is not None and (downgrade is not None or fresh.version >= current.version):
                state = FreshnessState(
                    version=fresh.version,
                    highest=max(current.highest, fresh.version),
                    bundle_sha256=sha256,
                    downgraded_by=downgrade[0] if downgrade else current.downgraded_by,
                    downgrade_reason=downgrade[1] if downgrade else current.downgrade_reason,
                )
                _write(self.directory / STATE, json.dumps(asdict(state)).encode())
            if fresh is None or state.bundle_sha256 == sha256:
                _write(self.directory / CACHED_BUNDLE, raw)
            return state

    def cached(self) -> bytes | None:
        """The last verified bundle's bytes (verify them again before use)."""
        try:
            return (self.directory / CACHED_BUNDLE).read_bytes()
        except FileNotFoundError:
            return None

    def first_refusal(self, key: str) -> bool:
        """Whether ``key`` (a refused bundle's SHA-256, with the admin request's generation for
        an admin reload) is logged for the first time; marks it logged.

        Raises:
            OSError: the directory cannot be written.
        """
        with self._locked():
            value = _read_json(self.directory / REFUSED)
            seen = [str(k) for k in value] if isinstance(value, list) else []
            if key in seen:
                return False
            seen = [*seen, key][-MAX_REFUSALS_KEPT:]
            _write(self.directory / REFUSED, json.dumps(seen).encode())
            return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _state_of(value: Any, path: Path) -> FreshnessState:
    """``value`` as a state, checked field by field.

    Raises:
        CorruptState: a field of the wrong type or out of range.
    """
    if not isinstance(value, dict):
        raise CorruptState(f"{path}: not a JSON object")
    numbers = [value.get("version", 0), value.get("highest", 0)]
    if not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_VERSION for n in numbers
    ):
        raise CorruptState(f"{path}: version and highest must be integers")
    texts = {k: value.get(k) for k in ("bundle_sha256", "downgraded_by", "downgrade_reason")}
    if not all(t is None or isinstance(t, str) for t in texts.values()):
        raise CorruptState(f"{path}: bundle_sha256 and the downgrade fields must be strings")
    return FreshnessState(int(numbers[0]), int(numbers[1]), **texts)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _write(path: Path, content: bytes) -> None:
    """Replace ``path`` atomically (a crash leaves the old file or the new one, never half)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
