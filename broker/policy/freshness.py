"""Policy freshness, TUF's rule: never go back, never past expiry.

What the security team signs carries, in the signature's payload (OPA's ``.signatures.json``
JWS; ``opa build/sign --claims-file`` writes the same claims):

* ``policy_version``: a positive integer that only grows from one published bundle to the next
  (``broker policy build --version``, default the build time in Unix seconds);
* ``policy_expires``: Unix seconds after which the bundle is refused
  (``broker policy build --expires-in``, default 30 days).

Each replica keeps, beside its decision log (``<log>.policy/``, shared by its workers under a
``flock``, files replaced atomically):

* ``state.json``: the floor (the version in force) and the highest version ever loaded. A bundle
  below the floor is a rollback and refused; after a deliberate downgrade through the admin API
  the floor is the older version, and the versions rolled back from (above the floor, up to the
  highest) stay refused, so whoever can write the bundle storage cannot serve them back;
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
from dataclasses import asdict, dataclass
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


class StaleBundle(PolicyLoadError):
    """A signed bundle that is expired, older than, or rolled back from, what this replica
    loaded."""


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
    allow_downgrade: bool = False,
    source: str,
) -> None:
    """Refuse an expired bundle, and one older than the replica's floor or rolled back from.

    1. Expiry: ``now`` at or past ``policy_expires`` refuses (a downgrade cannot lift it).
    2. Version: below the floor, or above it and at most the highest version ever loaded
       after a downgrade (the versions withdrawn), refuses unless ``allow_downgrade``.

    Raises:
        StaleBundle: naming both versions, or the expiry.
    """
    if now.timestamp() >= fresh.expires:
        raise StaleBundle(f"{source}: the bundle expired at {fresh.expires_at}")
    if allow_downgrade:
        return
    if fresh.version < state.version:
        raise StaleBundle(
            f"{source}: bundle version {fresh.version} is older than version {state.version} "
            "already loaded (a rollback); a deliberate downgrade goes through "
            "POST /v1/admin/policy/reload with allow_downgrade and a reason"
        )
    if state.version < fresh.version <= state.highest:
        raise StaleBundle(
            f"{source}: bundle version {fresh.version} was rolled back from (downgrade to "
            f"{state.version}); publish a version above {state.highest}"
        )


class FreshnessStore:
    """``<log>.policy/``: the replica's floor, its last verified bundle, and the refusals
    already logged; shared by the workers under one ``flock``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def read(self) -> FreshnessState:
        value = _read_json(self.directory / STATE)
        if not isinstance(value, dict):
            return FreshnessState()
        known = FreshnessState.__dataclass_fields__
        return FreshnessState(**{k: v for k, v in value.items() if k in known})

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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None


def _write(path: Path, content: bytes) -> None:
    """Replace ``path`` atomically (a crash leaves the old file or the new one, never half)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as handle:
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
