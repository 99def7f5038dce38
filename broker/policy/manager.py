"""Loading the policy in force, and replacing it without ever letting a bad one go live.

A reload (SIGHUP, ``POST /v1/admin/policy/reload``, or a change seen by polling every
``reload_seconds``) runs, off the event loop: for a directory, one read, ``opa check
--strict``, the structure rules, the policy's own Rego tests (``opa test``) and ``opa build -t
wasm`` on those bytes; for a bundle, one read and the broker's own verification of its
signature; then a smoke evaluation of a fixed input that must produce a decision; for a signed
bundle, its version floor saved beside the log. Only then is the engine swapped, atomically.
Any failure keeps the last good policy serving, logs OPA's message verbatim, shows in
``/readyz`` and ``/metrics``, and appends a ``policy_reload_failed`` record (trigger, who,
problem, the digest that stays live).

Every policy that goes live is in the log: a ``policy_change`` record (old and new digest,
revision, source digest, trigger, who) written before the swap, and at start-up whenever the
policy in force differs from the last one the log names (a new bundle, new directory contents,
a new replica). The log decides under its lock whether the record is new, so the workers of one
broker write one record per change.

Bundles are held to TUF's rule (``freshness.py``, ``bundle_loader.py``): a signed bundle older
than the one the replica loaded, or expired, is refused (one record per distinct bundle), the
replica starts on its last verified bundle while the bundle server is down, and a deliberate
downgrade goes only through the admin API (``allow_downgrade`` naming ``to_version``, with a
reason, logged with who). The floor is saved before the policy goes live (a floor that cannot be
saved refuses the reload), and at start-up it is at least the version of the log's last
``policy_change``.

The OPA server engine (``engine = "opa"``) has nothing to reload here: the sidecar loads its
own bundles.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from broker.config import PolicySettings
from broker.core.errors import ConfigError, UpstreamError
from broker.core.metrics import Metrics
from broker.policy import records
from broker.policy.build import compile_policy_dir
from broker.policy.bundle import load_policy_dir
from broker.policy.bundle_loader import BundleLoader, FloorNotSaved, LoadedBundle, RefusedBundle
from broker.policy.engine import PolicyEngine
from broker.policy.freshness import DowngradeTarget, FreshnessState
from broker.policy.records import ReloadOutcome
from broker.policy.testing import find_opa
from broker.policy.wasm import (
    CompiledPolicy,
    PolicyLoadError,
    WasmPolicyEngine,
    WasmPolicyInstance,
)
from broker.policy.workers import WorkerGroup, WorkerReport

log = logging.getLogger(__name__)
ChangeLog = Callable[[Mapping[str, Any]], Awaitable[object]]
ChangeListener = Callable[[str], Awaitable[object]]  # called with who changed the policy
SYSTEM_WHO = "broker"
SMOKE_INPUT: dict[str, Any] = {
    "schema": "broker.input/v1",
    "request": {"key": "smoke/test", "version": 1, "purpose": "generic"},
    "tee": {},
    "gpus": [],
    "claims": {},
}


@dataclass(frozen=True)
class BrokerReload:
    """A reload as the whole broker (every worker) took it."""

    outcome: ReloadOutcome  # this worker's
    reports: tuple[WorkerReport, ...]  # every worker that confirmed
    silent: tuple[int, ...]  # workers that did not confirm in time

    @property
    def digests(self) -> set[str]:
        return {r.digest for r in self.reports}

    @property
    def refused(self) -> list[WorkerReport]:
        return [r for r in self.reports if not r.ok]

    @property
    def agreed(self) -> bool:
        """Every worker confirmed, none refused, and all serve one digest."""
        return not self.silent and not self.refused and len(self.digests) == 1

    def describe(self) -> dict[str, Any]:
        return {
            **self.outcome.describe(),
            "workers": [r.describe() for r in self.reports],
            **({"silent_workers": list(self.silent)} if self.silent else {}),
        }


@dataclass
class PolicyManager:
    settings: PolicySettings
    metrics: Metrics
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    workers: WorkerGroup | None = None  # with --workers N: the group to keep on one policy
    state_dir: Path | None = None  # <log>.policy: version floor and last verified bundle
    engine: PolicyEngine | None = None
    last_reload: ReloadOutcome | None = None
    _change_log: ChangeLog | None = None
    _policy_log: ChangeLog | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _watch_stamp: str | None = None
    _handled_generation: int = 0
    _answered: tuple[int, ReloadOutcome] | None = None  # the last request generation answered
    _bundles: BundleLoader | None = None  # [policy] bundle or bundle_url
    _on_change: list[ChangeListener] = field(default_factory=list)

    def on_change(self, listener: ChangeListener) -> None:
        """Call ``listener(who)`` after each reload that put another policy in force (in this
        worker): attestation results re-decided under it (``AttestService.revalidate``)."""
        self._on_change.append(listener)

    @property
    def digest(self) -> str:
        return self.engine.digest if self.engine is not None else "none"

    async def open(
        self,
        change_log: ChangeLog,
        policy_log: ChangeLog | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        logged: FreshnessState | None = None,
    ) -> PolicyEngine:
        """Load the configured policy (start-up: a policy that does not load stops the broker),
        and log it as a ``policy_change`` when the log names another one last.

        Args:
            change_log: appends a record (failed reloads).
            policy_log: appends a ``policy_change`` record unless the log's last one names the
                same digest (``DecisionLog.append_policy_change``); default ``change_log``.
            session: fetches ``bundle_url`` (an HTTPS bundle server).
            logged: the version and bundle of the log's last ``policy_change`` (the floor is
                at least that, whatever ``<log>.policy/state.json`` says or lacks).

        Raises:
            ConfigError / PolicyLoadError: with OPA's message.
        """
        self._change_log = change_log
        self._policy_log = policy_log or change_log
        uses_bundle = self.settings.bundle_url is not None or self.settings.bundle is not None
        if uses_bundle and self.settings.engine == "wasm":
            self._bundles = await BundleLoader.open(
                self.settings,
                self.metrics,
                clock=self.clock,
                smoke=_smoke_tested,
                state_dir=self.state_dir,
                session=session,
                logged=logged,
            )
        # The reload request this start-up answers is read BEFORE the policy: a request written
        # while the policy loads is not answered by it (the worker would confirm an admin's
        # reload with the policy from before it); it arrives as SIGHUP once this worker serves.
        answered = None
        if self.workers is not None:
            answered = await asyncio.to_thread(self.workers.read_request)
        if self.settings.engine == "opa":
            digest = await asyncio.to_thread(self._dir_digest_or_url)
            from broker.policy.opa_server import OpaServerEngine  # noqa: PLC0415 - engine = "opa" only

            engine = OpaServerEngine(
                str(self.settings.opa_url),
                timeout_seconds=self.settings.eval_timeout_ms / 1000,
                digest=digest,
            )
            await engine.open()
            self.engine = engine
        else:
            before = await asyncio.to_thread(self._stamp_before_load)
            compiled, bundle = await self._load_at_startup()
            await self._persist_at_startup(bundle)
            try:
                await self._record_change(None, compiled, "startup", SYSTEM_WHO, bundle)
            except UpstreamError:
                # The log cannot write: it now refuses every record, so no decision is made
                # (and nothing released) under a policy the log does not name.
                log.critical(
                    "policy %s could not be logged; nothing will be decided", compiled.digest
                )
            if bundle is not None and self._bundles is not None:
                self._bundles.accepted(bundle)
            self.engine = WasmPolicyEngine(compiled)
            self._watch_stamp = _stamp_of(compiled, before)
        self.metrics.policy_info(self.digest)
        if answered is not None:
            self._handled_generation = answered.generation
            await self._report(answered.generation, ok=True, problem=None)
        return self.engine

    async def close(self) -> None:
        if self.settings.engine == "opa":  # the OPA server engine holds an HTTP session
            from broker.policy.opa_server import OpaServerEngine  # noqa: PLC0415

            if isinstance(self.engine, OpaServerEngine):
                await self.engine.close()

    async def reload(
        self,
        *,
        trigger: str,
        who: str = SYSTEM_WHO,
        fetched: bytes | None = None,
        downgrade: DowngradeTarget | None = None,
        reason: str | None = None,
        generation: int | None = None,
    ) -> ReloadOutcome:
        """Check, test, save the floor and swap; on any failure the last good policy keeps
        serving. ``fetched``: the bundle server's new bytes, already fetched by the poll.
        ``downgrade`` (admin API only, with a ``reason``): the signed bundle it names (version,
        optionally bytes) may go live although older than the one in force; any other bundle
        is refused; logged with who and why.
        ``generation``: the workers' reload request this reload answers (``on_signal``); only
        such a reload reports to the other workers, so a poll that runs just before or after
        cannot answer for an admin's request (it once turned an allowed downgrade into 409)."""
        async with self._lock:
            previous = self.digest
            outcome = ReloadOutcome(ok=True, trigger=trigger, time=self._now(), digest=previous)
            refused: str | None = None  # the refused bundle's SHA-256
            if not isinstance(self.engine, WasmPolicyEngine):
                outcome.problem = "engine opa: the OPA server loads its own policy"
                outcome.ok = False
            else:
                try:
                    before = await asyncio.to_thread(self._stamp_before_load)
                    compiled, bundle = await self._load(fetched, downgrade=downgrade)
                    stamp = _stamp_of(compiled, before)
                    if bundle is not None and self._bundles is not None:
                        # The floor first: durable before the policy serves, or no swap.
                        await self._bundles.persist(bundle, who=who, reason=reason)
                    if compiled.digest != previous:
                        # The record first: a change that cannot be logged does not go live.
                        await self._record_change(
                            previous, compiled, trigger, who, bundle, reason=reason
                        )
                        self.engine.swap(compiled)
                        outcome.changed = True
                        outcome.previous = previous
                        outcome.digest = compiled.digest
                    if bundle is not None and self._bundles is not None:
                        self._bundles.accepted(bundle)
                    self._watch_stamp = stamp
                except (ConfigError, UpstreamError, OSError, RefusedBundle, FloorNotSaved) as exc:
                    outcome.ok = False
                    outcome.problem = getattr(exc, "message", str(exc))
                    refused = exc.sha256 if isinstance(exc, RefusedBundle | FloorNotSaved) else None
                    log.error(  # noqa: TRY400 - the message is OPA's
                        "policy reload (%s) failed; keeping %s:\n%s",
                        trigger,
                        previous,
                        outcome.problem,
                    )
                    await self._record_failure(
                        outcome, who, refused, here_only=isinstance(exc, FloorNotSaved)
                    )
            outcome.version = self._version()
            self.last_reload = outcome
            self.metrics.policy_reloaded(outcome.ok, self.digest)
            if outcome.changed:
                await self._changed(who)
            if generation is not None:
                self._handled_generation = max(self._handled_generation, generation)
                self._answered = (generation, outcome)
                await self._report(generation, ok=outcome.ok, problem=outcome.problem)
            return outcome

    async def reload_everywhere(
        self,
        *,
        trigger: str,
        who: str,
        downgrade: DowngradeTarget | None = None,
        reason: str | None = None,
    ) -> BrokerReload:
        """Reload in every worker of this broker and wait for each to confirm (admin API).

        A single process reloads itself. Under a supervisor: record the request (with the
        ``downgrade`` target and ``reason``), SIGHUP the supervisor (every worker, this one
        included, reloads through ``on_signal``), and wait until every worker reports this
        request's generation.
        """
        group = self.workers
        if group is None or group.count == 1 or group.supervisor_pid is None:
            outcome = await self.reload(
                trigger=trigger, who=who, downgrade=downgrade, reason=reason
            )
            report = WorkerReport(
                0, 0, self._handled_generation, self.digest, outcome.ok, outcome.problem
            )
            return BrokerReload(outcome, (report,), ())
        previous = self.digest
        generation = await asyncio.to_thread(
            group.request, trigger, who, downgrade=downgrade, reason=reason
        )
        group.signal_all()
        reports, silent = await group.confirmed(generation)
        answered = self._answered
        mine = answered[1] if answered is not None and answered[0] >= generation else None
        if mine is None:  # this worker never answered
            mine = ReloadOutcome(
                ok=False, trigger=trigger, time=self._now(), digest=self.digest, previous=previous
            )
        outcome = ReloadOutcome(
            ok=mine.ok,
            trigger=trigger,
            time=mine.time,
            digest=self.digest,
            previous=previous,
            changed=self.digest != previous,
            problem=mine.problem,
            version=self._version(),
        )
        return BrokerReload(outcome, tuple(reports), tuple(silent))

    async def on_signal(self) -> ReloadOutcome:
        """SIGHUP: a reload requested through the admin API (the request file names its trigger
        and who) or a plain ``kill -HUP`` / ``systemctl reload``."""
        trigger, who = "sighup", "signal:SIGHUP"
        downgrade: DowngradeTarget | None = None
        reason: str | None = None
        generation: int | None = None
        if self.workers is not None:
            request = await asyncio.to_thread(self.workers.read_request)
            generation = request.generation
            if request.generation > self._handled_generation:
                trigger, who = request.trigger, request.who
                downgrade, reason = request.downgrade, request.reason
        return await self.reload(
            trigger=trigger,
            who=who,
            downgrade=downgrade,
            reason=reason,
            generation=generation,
        )

    async def _changed(self, who: str) -> None:
        for listener in self._on_change:
            try:
                await listener(who)
            except UpstreamError as exc:  # the new policy serves; the attestation listener
                # (decisions.redecide.Redecider) retries a failed re-decision itself, with backoff
                log.error("after the policy change, re-deciding results failed: %s", exc.message)  # noqa: TRY400

    async def _report(self, generation: int, *, ok: bool, problem: str | None) -> None:
        if self.workers is None:
            return
        try:
            await asyncio.to_thread(
                self.workers.report,
                generation=generation,
                digest=self.digest,
                ok=ok,
                problem=problem,
            )
        except OSError:
            log.exception("could not report the policy in force to the other workers")

    async def watch(self) -> None:
        """Poll the policy source every ``reload_seconds``; reload when it changed."""
        interval = self.settings.reload_seconds
        if interval <= 0 or self.settings.engine != "wasm":
            return
        while True:
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))  # noqa: S311 - jitter
            try:
                await self._poll_once()
            except Exception:  # a bug in one poll must not end polling for good
                log.exception("policy watch: the poll failed; polling goes on")

    async def _poll_once(self) -> None:
        if self._bundles is not None and self._bundles.source is not None:
            fetched = await self._bundles.poll()
            if fetched is not None:
                await self.reload(trigger="poll", fetched=fetched)
            return
        try:
            stamp = await asyncio.to_thread(self._stamp)
        except (ConfigError, OSError) as exc:
            log.warning("policy watch: %s", exc)
            return
        if stamp != self._watch_stamp:
            outcome = await self.reload(trigger="poll")
            if not outcome.ok:
                self._watch_stamp = stamp  # do not retry the same broken files in a loop

    async def _persist_at_startup(self, bundle: LoadedBundle | None) -> None:
        """The start-up bundle's floor saved; if it cannot be, the broker still starts (the
        log's ``policy_change`` names its version, the floor at the next start) and says so in
        ``/readyz`` and ``broker_policy_floor_saved``."""
        if bundle is None or self._bundles is None:
            return
        try:
            await self._bundles.persist(bundle, who=SYSTEM_WHO, reason=None)
        except FloorNotSaved as exc:
            log.error("at start-up: %s (the log names the version in force)", exc.problem)  # noqa: TRY400

    async def _load_at_startup(self) -> tuple[CompiledPolicy, LoadedBundle | None]:
        """``_load``, except that a bundle server that is down, or serves a bundle that is
        refused, leaves the replica on its last verified bundle (refusal logged once).

        Raises:
            ConfigError / PolicyLoadError / UpstreamError: nothing to start on.
        """
        try:
            return await self._load(startup=True)
        except RefusedBundle as exc:
            fallback = await self._bundles.cached_fallback() if self._bundles else None
            if fallback is None or self._bundles is None or self._bundles.source is None:
                raise PolicyLoadError(exc.problem) from exc
            outcome = ReloadOutcome(
                ok=False, trigger="startup", time=self._now(), digest=fallback.compiled.digest
            )
            outcome.problem = exc.problem + " (starting on the cached copy)"
            log.error("policy at start-up refused: %s", outcome.problem)  # noqa: TRY400
            await self._record_failure(outcome, SYSTEM_WHO, exc.sha256)
            self.last_reload = outcome
            return fallback.compiled, fallback

    async def _load(
        self,
        fetched: bytes | None = None,
        *,
        downgrade: DowngradeTarget | None = None,
        startup: bool = False,
    ) -> tuple[CompiledPolicy, LoadedBundle | None]:
        """The policy to serve: a bundle (from the bundle server, these bytes or fetched now,
        or the configured file), or the configured directory."""
        if self._bundles is None:
            return await asyncio.to_thread(self._prepare), None
        bundle = await self._bundles.load(fetched, downgrade=downgrade, startup=startup)
        return bundle.compiled, bundle

    def source_health(self) -> tuple[bool, dict[str, object]]:
        """(ok, details) of where the policy comes from, for ``/readyz`` and the metrics.

        ``ok`` is false while the bundle server fails or serves a refused bundle, while the
        replica serves its cached copy, or once the signed bundle in force has expired; the
        last good policy keeps serving. Details: ``source``, ``serving_from`` ("source",
        "cached copy", "file" or "directory"), ``consecutive_failures``, ``last_success``,
        ``last_failure``, ``problem`` and, for signed bundles, ``version`` and ``expires``.
        """
        if self._bundles is not None:
            return self._bundles.source_health()
        return True, {
            "source": str(self.settings.dir),
            "serving_from": "directory",
            "consecutive_failures": 0,
            "last_success": None,
            "last_failure": None,
            "problem": None,
        }

    def _version(self) -> int | None:
        fresh = self._bundles.fresh if self._bundles is not None else None
        return fresh.version if fresh is not None else None

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.settings.engine,
            "digest": self.digest,
            "last_reload": None if self.last_reload is None else self.last_reload.describe(),
        }

    # --- blocking helpers (run in a thread) ---------------------------------------------------

    def _prepare(self) -> CompiledPolicy:
        """Compile and test the configured directory; raise on any problem. It is read once and
        checked, tested and compiled by OPA from those bytes."""
        opa = find_opa(str(self.settings.opa_binary) if self.settings.opa_binary else None)
        return _smoke_tested(compile_policy_dir(self.settings.dir, opa=opa, run_tests=True))

    def _stamp_before_load(self) -> str | None:
        """A bundle file's stamp, taken before it is read (a file replaced after this is seen by
        the next poll); a directory's comes from the bytes compiled (``_stamp_of``)."""
        return self._stamp() if self._bundles is not None else None

    def _stamp(self) -> str:
        if self._bundles is not None and self._bundles.source is not None:
            return self._bundles.name  # the source's own ETag / generation says what changed
        if self.settings.bundle is not None:
            stat = Path(self.settings.bundle).stat()
            return f"{stat.st_mtime_ns}:{stat.st_size}"
        return load_policy_dir(self.settings.dir).digest

    def _dir_digest_or_url(self) -> str:
        if self.settings.dir.is_dir():
            return load_policy_dir(self.settings.dir).digest
        return f"opa:{self.settings.opa_url}"

    def _now(self) -> str:
        return self.clock().isoformat()

    async def _record_change(
        self,
        old: str | None,
        compiled: CompiledPolicy,
        trigger: str,
        who: str,
        bundle: LoadedBundle | None = None,
        *,
        reason: str | None = None,
    ) -> None:
        if self._policy_log is None:
            return
        entry = records.change_record(
            old,
            compiled,
            time=self._now(),
            trigger=trigger,
            who=who,
            source=self._source_name(),
            fresh=bundle.fresh if bundle is not None else None,
            bundle_sha256=bundle.sha256 if bundle is not None else None,
            downgrade_from=bundle.downgrade_from if bundle is not None else None,
            reason=reason,
        )
        await self._policy_log(entry)

    async def _record_failure(
        self,
        outcome: ReloadOutcome,
        who: str,
        refused: str | None = None,
        *,
        here_only: bool = False,
    ) -> None:
        """A refused reload is in the log too, once per refused bundle (``refused``: the
        bundle's SHA-256) however many polls and workers meet it; an admin's attempt is
        recorded once per request; a floor that cannot be saved (``here_only``: the directory
        that remembers refusals may fail too) once per bundle and worker. If even that cannot
        be written, the server log says so and the last good policy keeps serving."""
        if self._change_log is None:
            return
        if refused is not None and self._bundles is not None:
            key = refused
            if outcome.trigger not in ("poll", "startup", "sighup"):
                key += f":{outcome.trigger}:{self._handled_generation or outcome.time}"
            if here_only:
                first = self._bundles.first_floor_failure(key)
            else:
                first = await self._bundles.first_refusal(key)
            if not first:
                return
        fresh = self._bundles.fresh if self._bundles is not None else None
        entry = records.failure_record(
            outcome,
            who=who,
            source=self._source_name(),
            worker=0 if self.workers is None else self.workers.index,
            refused=refused,
            active_version=fresh.version if fresh is not None else None,
        )
        try:
            await self._change_log(entry)
        except UpstreamError:
            log.exception("the failed reload could not be logged")

    def _source_name(self) -> str:
        if self._bundles is not None:
            return self._bundles.name
        return str(self.settings.dir)


def _stamp_of(compiled: CompiledPolicy, before: str | None) -> str:
    """What the watcher compares with: for a directory, the digest of the very bytes compiled
    (re-reading the directory after the compile would mark a change made meanwhile as seen)."""
    if before is not None:
        return before
    return compiled.source_digest or compiled.digest


def _smoke_tested(compiled: CompiledPolicy) -> CompiledPolicy:
    """``compiled``, once a fresh instance of it (the live one untouched) decided a fixed input.

    Raises:
        ConfigError: when it produces no ``allow`` decision.
    """
    result = WasmPolicyInstance(compiled).evaluate(SMOKE_INPUT)
    if result is None or not isinstance(result, dict) or "allow" not in result:
        raise ConfigError("policy", "smoke evaluation produced no allow decision")
    return compiled
