"""Bundles as the policy manager loads them: verified, held to the structure rules, fresh.

``BundleLoader`` serves ``[policy] bundle`` (a file) and ``bundle_url`` (a bundle server):

* ``load`` (start-up, SIGHUP, admin reload, poll): the bytes (fetched now, or handed over by a
  poll), verified and loaded by ``build.load_bundle_bytes``, smoke-tested, then checked for
  freshness (``freshness.check``) against the replica's floor when bundles are signed. Any
  failure the bytes cause (signature, structure, compile, an ``opa`` that does not finish, a
  smoke evaluation that fails) refuses that bundle for good (by SHA-256), and ``/readyz`` says
  the source serves a refused bundle;
* the floor is ``state.json`` raised to at least ``known``: the version of the decision log's last
  ``policy_change`` at start-up, then each version this worker put in force (a lost, corrupt or
  replaced ``state.json`` does not reset it);
* at start-up, a bundle server that does not answer, or answers with a bundle that is refused,
  leaves the replica on its last verified bundle (``<log>.policy/bundle.tar.gz``, verified again,
  freshness included); ``serving_from`` says "cached copy" until the server answers again;
* ``persist``: before a bundle goes live, its bytes are kept and the floor raised (or, for an
  admin downgrade, set); a floor that cannot be saved refuses the reload (``FloorNotSaved``),
  shows in ``/readyz`` and ``broker_policy_floor_saved``; ``accepted``: it is in force;
* ``first_refusal``: one ``policy_reload_failed`` record per refused bundle (by SHA-256 of its
  bytes), whichever worker or poll met it first;
* ``poll``: a conditional fetch; bytes already in force or already refused are not loaded again.

Blocking work (OPA, files) runs in a thread; every fetch failure is counted
(``broker_policy_source_failures_total``) and shown (``broker_policy_source_up``, ``/readyz``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import aiohttp

from broker.config import PolicySettings
from broker.core.errors import ConfigError, UpstreamError
from broker.core.metrics import Metrics
from broker.policy import freshness
from broker.policy.build import load_bundle_bytes
from broker.policy.bundle_source import BundleSource, open_bundle_source
from broker.policy.freshness import (
    CorruptState,
    DowngradeTarget,
    Freshness,
    FreshnessState,
    FreshnessStore,
)
from broker.policy.opa_bundle import MAX_BUNDLE_BYTES
from broker.policy.testing import find_opa
from broker.policy.wasm import CompiledPolicy

log = logging.getLogger(__name__)
SmokeTest = Callable[[CompiledPolicy], CompiledPolicy]
MAX_REFUSED_KEPT = 1024  # refused bundles remembered (not loaded again) per worker


@dataclass(frozen=True)
class LoadedBundle:
    """A bundle that passed every check: what to serve, and what to keep once it serves."""

    compiled: CompiledPolicy
    raw: bytes
    sha256: str
    fresh: Freshness | None  # None: unsigned (no verification key configured)
    downgrade_from: int | None = None  # the floor it goes below (admin downgrade only)
    cached_copy: bool = False  # the replica's last verified bundle, not the source's answer


@dataclass(frozen=True)
class RefusedBundle(Exception):
    """A bundle refused at load: the problem, and which bytes (one record per distinct one)."""

    problem: str
    sha256: str | None
    version: int | None = None

    def __str__(self) -> str:
        return self.problem


@dataclass(frozen=True)
class FloorNotSaved(Exception):
    """The floor (``state.json``) could not be saved: the bundle does not go live."""

    problem: str
    sha256: str

    def __str__(self) -> str:
        return self.problem


@dataclass
class SourceHealth:
    """How the bundle server answered lately (this worker's view)."""

    serving_from: str = "source"  # "source" | "cached copy"
    failures: int = 0  # consecutive fetch failures
    last_success: str | None = None
    last_failure: str | None = None
    last_error: str | None = None  # of the last failed fetch
    refused: str | None = None  # the source serves a bundle that was refused: why

    @property
    def ok(self) -> bool:
        return self.failures == 0 and self.refused is None and self.serving_from == "source"

    @property
    def problem(self) -> str | None:
        if self.failures:
            return self.last_error
        return self.refused


def sha256_of(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


@dataclass
class BundleLoader:
    settings: PolicySettings
    metrics: Metrics
    clock: Callable[[], datetime]
    smoke: SmokeTest
    opa: Path  # compiles a bundle's checked Rego (the pinned opa)
    store: FreshnessStore | None = None  # None: nothing persisted (a test's manager)
    source: BundleSource | None = None
    health: SourceHealth = field(default_factory=SourceHealth)
    in_force: str | None = None  # SHA-256 of the bundle bytes serving
    fresh: Freshness | None = None  # their freshness claims
    known: FreshnessState = field(default_factory=FreshnessState)  # the floor without state.json
    floor_problem: str | None = None  # why the floor could not be saved (None: it was)
    _refused: set[str] = field(default_factory=set)
    _floor_failures: set[str] = field(default_factory=set)  # bundles whose floor was not saved

    @classmethod
    async def open(
        cls,
        settings: PolicySettings,
        metrics: Metrics,
        *,
        clock: Callable[[], datetime],
        smoke: SmokeTest,
        state_dir: Path | None,
        session: aiohttp.ClientSession | None,
        logged: FreshnessState | None = None,
    ) -> BundleLoader:
        """The loader for the configured bundle or bundle server; ``logged``: the version (and
        bundle) of the decision log's last ``policy_change``, the floor's lower bound.

        Raises:
            ConfigError: ``bundle_url`` without a session, an unreadable ``bundle_ca``, or no
                ``opa`` binary.
        """
        binary = str(settings.opa_binary) if settings.opa_binary else None
        opa = await asyncio.to_thread(find_opa, binary)
        source = None
        if settings.bundle_ref is not None:
            if session is None:
                raise ConfigError("policy.bundle_url", "needs an HTTP session")
            tls = await asyncio.to_thread(_tls, settings)  # reads the CA file
            source = open_bundle_source(settings.bundle_ref, session, tls=tls)
        store = FreshnessStore(state_dir) if state_dir is not None else None
        loader = cls(settings, metrics, clock, smoke, opa, store, source)
        loader.known = logged or FreshnessState()
        metrics.policy_floor_saved.set(1)
        return loader

    @property
    def name(self) -> str:
        return self.source.name if self.source is not None else str(self.settings.bundle)

    async def load(
        self,
        fetched: bytes | None = None,
        *,
        downgrade: DowngradeTarget | None = None,
        startup: bool = False,
    ) -> LoadedBundle:
        """The bundle to serve now (see the module docstring).

        Raises:
            RefusedBundle: the bundle was refused (the bytes' SHA-256 says which).
            UpstreamError: the bundle server does not answer (and, at start-up, nothing cached).
        """
        try:
            raw = fetched if fetched is not None else await self._fetch()
        except UpstreamError:
            store = self.store if startup else None
            cached = await asyncio.to_thread(store.cached) if store is not None else None
            if cached is None:
                raise
            log.warning("the bundle server does not answer; starting on the cached copy")
            return await self._verify(cached, cached_copy=True)
        return await self._verify(raw, downgrade=downgrade)

    async def cached_fallback(self) -> LoadedBundle | None:
        """At start-up after the source's bundle was refused: the last verified bundle, if any
        (still verified and fresh), else ``None``."""
        store = self.store
        cached = await asyncio.to_thread(store.cached) if store is not None else None
        if cached is None:
            return None
        try:
            return await self._verify(cached, cached_copy=True)
        except RefusedBundle as exc:
            log.error("the cached bundle is refused too: %s", exc.problem)  # noqa: TRY400
            return None

    async def _fetch(self) -> bytes:
        if self.source is None:
            return await asyncio.to_thread(_read_file, Path(str(self.settings.bundle)))
        try:
            raw = await self.source.fetch()
        except UpstreamError as exc:
            self.failed(exc.message)
            raise
        self.answered()
        return raw

    async def _verify(
        self,
        raw: bytes,
        *,
        downgrade: DowngradeTarget | None = None,
        cached_copy: bool = False,
    ) -> LoadedBundle:
        """``raw`` verified, compiled, smoke-tested and fresh.

        Raises:
            RefusedBundle: any of those failed; the bytes are remembered as refused (a poll
                does not load them again), and the source shows as serving a refused bundle.
        """
        sha = sha256_of(raw)
        try:
            loaded = await asyncio.to_thread(self._verified, raw, sha, downgrade)
        except (ConfigError, UpstreamError) as exc:  # PolicyLoadError, a failed smoke test
            raise self._refusal(exc.message, sha, cached_copy=cached_copy) from exc
        except subprocess.SubprocessError as exc:  # opa did not finish on these bytes
            raise self._refusal(f"opa did not finish: {exc}", sha, cached_copy=cached_copy) from exc
        return replace(loaded, cached_copy=cached_copy)

    def _refusal(self, problem: str, sha: str, *, cached_copy: bool) -> RefusedBundle:
        if len(self._refused) >= MAX_REFUSED_KEPT:
            self._refused.clear()
        self._refused.add(sha)
        if self.source is not None and not cached_copy:
            self.health.refused = f"the bundle server serves a refused bundle: {problem}"
            self._show()
        return RefusedBundle(problem, sha)

    def _floor(self) -> FreshnessState:
        """The replica's floor: ``state.json`` (missing or corrupt: nothing) raised to
        ``known``."""
        if self.store is None:
            return self.known
        try:
            state = self.store.read_state()
        except CorruptState as exc:
            log.warning("%s: read as no state", exc)
            state = None
        if state is None and self.known.version:
            log.warning(
                "no usable policy state beside the log; the floor is version %d (the decision "
                "log's last policy_change, or the last this worker loaded)",
                self.known.version,
            )
        return freshness.merged(state or FreshnessState(), self.known)

    def _verified(self, raw: bytes, sha: str, downgrade: DowngradeTarget | None) -> LoadedBundle:
        """Verify, structure-check, compile, smoke-test and freshness-check (in a thread)."""
        key = self.settings.bundle_verification_key
        compiled = self.smoke(
            load_bundle_bytes(
                raw,
                source=self.name,
                verification_key=key,
                scope=self.settings.bundle_verification_scope,
                opa=self.opa,
            )
        )
        if key is None:
            return LoadedBundle(compiled, raw, sha, None)
        fresh = freshness.claims_of(compiled.claims, source=self.name)
        state = self._floor()
        freshness.check(
            fresh, state, now=self.clock(), sha256=sha, downgrade=downgrade, source=self.name
        )
        below = state.version if fresh.version < state.version else None
        return LoadedBundle(compiled, raw, sha, fresh, downgrade_from=below)

    async def persist(self, loaded: LoadedBundle, *, who: str, reason: str | None) -> None:
        """Before the bundle goes live: keep its bytes, raise (or, downgrading, set) the floor.

        Raises:
            FloorNotSaved: ``<log>.policy/`` cannot be written (shown in ``/readyz`` and
                ``broker_policy_floor_saved`` until a save succeeds).
        """
        if self.store is None or loaded.cached_copy:
            return
        downgrade = (who, reason or "") if loaded.downgrade_from is not None else None
        try:
            await asyncio.to_thread(
                self.store.advance, loaded.fresh, loaded.raw, loaded.sha256, downgrade=downgrade
            )
        except OSError as exc:
            self.floor_problem = f"the policy version floor cannot be saved: {exc}"
            self.metrics.policy_floor_saved.set(0)
            raise FloorNotSaved(self.floor_problem, loaded.sha256) from exc
        self.floor_problem = None
        self._floor_failures.clear()
        self.metrics.policy_floor_saved.set(1)

    def first_floor_failure(self, key: str) -> bool:
        """Whether the floor failed to save for this bundle (``key``: as ``first_refusal``'s)
        for the first time in this worker (the directory that remembers refusals may fail too).
        """
        if key in self._floor_failures:
            return False
        self._floor_failures.add(key)
        return True

    def accepted(self, loaded: LoadedBundle) -> None:
        """The bundle is in force (in this worker)."""
        self.in_force, self.fresh = loaded.sha256, loaded.fresh
        if loaded.fresh is not None:
            self.metrics.policy_bundle_version.set(loaded.fresh.version)
            version = loaded.fresh.version
            self.known = FreshnessState(
                version, max(self.known.highest, version), bundle_sha256=loaded.sha256
            )
        self.health.serving_from = "cached copy" if loaded.cached_copy else "source"
        if not loaded.cached_copy:
            self.health.refused = None
        self._show()

    async def first_refusal(self, key: str) -> bool:
        """Whether this refusal is the first of its bundle (``FreshnessStore.first_refusal``);
        without a store, every refusal is."""
        if self.store is None:
            return True
        try:
            return await asyncio.to_thread(self.store.first_refusal, key)
        except OSError:
            log.exception("could not read the refusals already logged")
            return True

    async def poll(self) -> bytes | None:
        """One conditional fetch: new bytes to load, or ``None`` (unchanged, already in force,
        already refused, or the server failed: counted and shown)."""
        assert self.source is not None  # noqa: S101 - only polled with a source
        behind = await asyncio.to_thread(self._floor_bundle_if_behind)
        if behind is not None:
            return behind
        try:
            fetched = await self.source.changed()
        except UpstreamError as exc:
            self.failed(exc.message)
            log.warning("policy watch: %s (the last good policy keeps serving)", exc.message)
            return None
        if fetched is None:  # unchanged: still what it served
            self.answered()
            return None
        sha = sha256_of(fetched)
        if sha == self.in_force:  # the bundle in force (a server without ETags, or back up)
            self.health.serving_from, self.health.refused = "source", None
            self.answered()
            return None
        self.answered()
        return None if sha in self._refused else fetched

    def _floor_bundle_if_behind(self) -> bytes | None:
        """The replica's floor bundle when another worker put a newer version in force than
        this worker serves, else ``None``.

        Each worker polls on its own: one that missed a version (the storage served it back
        before this worker's poll) would otherwise keep serving the older policy forever,
        since the source then serves what it already has. The floor in ``state.json`` is
        shared by the workers of a replica; its bundle is kept beside it (and verified again by
        the load that follows)."""
        if self.store is None or self.fresh is None:
            return None
        state = self.store.read()
        if state.bundle_sha256 in (None, self.in_force) or state.version <= self.fresh.version:
            return None
        cached = self.store.cached()
        if cached is None or sha256_of(cached) != state.bundle_sha256:
            return None
        log.warning(
            "policy watch: this worker serves version %d, the replica's floor is %d; loading it",
            self.fresh.version,
            state.version,
        )
        return cached

    def answered(self) -> None:
        """The source answered (its bundle is judged by the load that follows)."""
        self.health.failures = 0
        self.health.last_success = self.clock().isoformat()
        self._show()

    def failed(self, problem: str) -> None:
        self.health.failures += 1
        self.health.last_failure = self.clock().isoformat()
        self.health.last_error = problem
        self.metrics.policy_source_failed()

    def _show(self) -> None:
        self.metrics.policy_source(up=self.source is None or self.health.ok)

    def source_health(self) -> tuple[bool, dict[str, object]]:
        """(ok, details): see ``PolicyManager.source_health``."""
        health = self.health
        details: dict[str, object] = {
            "source": self.name,
            "serving_from": health.serving_from if self.source is not None else "file",
            "consecutive_failures": health.failures,
            "last_success": health.last_success,
            "last_failure": health.last_failure,
            "problem": health.problem,
        }
        ok = health.ok or self.source is None
        if self.floor_problem is not None:
            details["problem"], ok = self.floor_problem, False
        if self.fresh is not None:
            details["version"] = self.fresh.version
            details["expires"] = self.fresh.expires_at
            if self.clock().timestamp() >= self.fresh.expires:
                details["problem"] = f"the policy in force expired at {self.fresh.expires_at}"
                ok = False
        return ok, details


def _tls(settings: PolicySettings) -> ssl.SSLContext | None:
    """The TLS context for an HTTPS bundle server with a private CA (``[policy] bundle_ca``).

    Raises:
        ConfigError: the CA file cannot be read.
    """
    if settings.bundle_ca is None:
        return None
    try:
        return ssl.create_default_context(cafile=str(settings.bundle_ca))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("policy.bundle_ca", f"cannot read {settings.bundle_ca}") from exc


def _read_file(path: Path) -> bytes:
    try:
        with path.open("rb") as handle:
            return handle.read(MAX_BUNDLE_BYTES + 1)
    except OSError as exc:
        raise RefusedBundle(f"cannot read the bundle {path}", None) from exc
