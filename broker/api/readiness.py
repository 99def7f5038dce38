"""``/readyz`` answers from state a background task keeps, never from calls made per request.

Every ``[server] health_interval_seconds`` (default 5 s) one round of checks runs: one cheap
call to the key store (``has_purpose``: a filtered one-row query, or one ``ListSecrets`` of
page size 1 on Secret Manager; no key version is read), one to the nonce store (``check``:
``SELECT 1`` or ``PING``), and the policy source's health as the policy watch last saw it (no
call). Each round is bounded by ``CHECK_TIMEOUT_SECONDS``. A request then costs a dict read,
so however often ``/readyz`` is hit, each store sees at most one call per interval per worker
(``--workers N``: each worker keeps its own state, N calls per interval).

Status: ``not_ready`` (503) when a store does not answer, the declared features cannot work
(query keys without ``[keys] signing_key``) or the checks have not run for
``stale_after`` seconds; ``degraded`` (200) when the policy source fails while the last good
policy keeps serving, or the identity CA (``[identity]``) expired or expires within
``max_lifetime_seconds``; else ``ready``. What is cheap and in memory (the policy digest in force,
the decision log's size, the last reload) is read live.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from broker.audit.log import DecisionLog
from broker.core.errors import UpstreamError
from broker.core.metrics import Metrics
from broker.keys.service import KeyService
from broker.policy.engine import PolicyEngine
from broker.policy.manager import PolicyManager
from broker.stores.nonces import NonceStore

log = logging.getLogger(__name__)
Status = Literal["ready", "degraded", "not_ready"]
CHECK_TIMEOUT_SECONDS = 10.0  # one round of checks, all stores together


@dataclass(frozen=True)
class HealthRound:
    """What one round of background checks found."""

    taken: float  # time.monotonic() when the round ended
    checked_at: str  # the broker's clock, RFC 3339
    checks: dict[str, object]
    problems: tuple[str, ...] = ()  # not ready
    warnings: tuple[str, ...] = ()  # degraded


@dataclass(frozen=True)
class Report:
    """What ``/readyz`` says: ``status`` to anyone, the rest to admins."""

    status: Status
    checks: dict[str, object]
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    checked_at: str
    age_seconds: float


@dataclass
class Readiness:
    """The background checks and the state they leave; ``report`` reads it."""

    facts: dict[str, str]
    policies: PolicyManager
    policy: PolicyEngine
    decisions: DecisionLog
    keys: KeyService
    nonces: NonceStore
    statement_key_set: bool
    clock: Callable[[], datetime]
    interval: float = 5.0
    # [sealed]: whether the broker's own attestation token has expired at a given time
    attestation_expired: Callable[[datetime], bool] | None = None
    # each round's findings exported: the stores' and the log writer's state, the log's size
    metrics: Metrics | None = None
    # [identity]: what is wrong with the identity CA's validity at a given time, if anything
    identity_ca_warning: Callable[[datetime], str | None] | None = None
    _last: HealthRound | None = field(default=None, init=False)

    @property
    def stale_after(self) -> float:
        """Seconds after which state no round refreshed is not trusted (the task is stuck)."""
        return 3 * self.interval + CHECK_TIMEOUT_SECONDS

    async def run(self) -> None:
        """Refresh every ``interval`` seconds until cancelled (the first round ran at start)."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a bug: logged; the state goes stale and /readyz says not_ready
                log.exception("the readiness checks failed")

    async def refresh(self) -> HealthRound:
        """One round: one call per store, bounded in time; never raises (a failing store is a
        problem in the state, not an exception)."""
        checks: dict[str, object] = {}
        problems: list[str] = []
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_SECONDS):
                keys, nonces = await asyncio.gather(
                    self.keys.has_query_keys(), self.nonces.check(), return_exceptions=True
                )
        except TimeoutError:
            keys = nonces = TimeoutError()
        checks["key_store"] = _answer(keys, "the key store does not answer", problems)
        checks["nonce_store"] = _answer(nonces, "the nonce store does not answer", problems)
        if keys is True and not self.statement_key_set:
            problems.append(
                "query key(s) but no [keys] signing_key: their public halves cannot be "
                "published with a signed statement"
            )
        ok, source = self.policies.source_health()
        checks["policy_source"] = {"ok": ok, **{k: _plain(v) for k, v in source.items()}}
        warnings = () if ok else ("the policy source fails; the last good policy is serving",)
        now = self.clock()
        if self.attestation_expired is not None and self.attestation_expired(now):
            warnings = (*warnings, "the broker's attestation token expired: renewals fail")
        ca_warning = None if self.identity_ca_warning is None else self.identity_ca_warning(now)
        if ca_warning is not None:  # degraded: only workload certificates are affected
            warnings = (*warnings, ca_warning)
        state = HealthRound(
            taken=time.monotonic(),
            checked_at=now.isoformat(),
            checks=checks,
            problems=tuple(problems),
            warnings=warnings,
        )
        self._last = state
        if self.metrics is not None:
            self.metrics.health_round(
                nonce_store=checks["nonce_store"] == "ok",
                key_store=checks["key_store"] == "ok",
                log_records=self.decisions.committed_size,
                log_writing=not self.decisions.refusing,
            )
        return state

    def report(self, now: float) -> Report:
        """The state as of ``now`` (``time.monotonic()``), with the live in-memory facts."""
        return judge(self._last, now, self.stale_after, {**self.facts, **self._live()})

    def _live(self) -> dict[str, object]:
        """In memory, free to read per request."""
        live: dict[str, object] = {
            "policy": self.policy.digest,
            "audit_log": f"{self.decisions.head.size} records",
        }
        reload = self.policies.last_reload
        if reload is not None:
            live["policy_last_reload"] = (
                f"{'ok' if reload.ok else 'failed'} at {reload.time} ({reload.trigger})"
                + ("" if reload.ok else "; the last good policy is serving")
            )
        return live


def judge(
    state: HealthRound | None, now: float, stale_after: float, live: dict[str, object]
) -> Report:
    """The verdict on the last round as of ``now`` (pure): ``not_ready`` with any problem,
    including a round older than ``stale_after`` seconds or none at all (the task is stuck or
    gone: fail closed); else ``degraded`` with any warning; else ``ready``."""
    age = float("inf") if state is None else max(0.0, now - state.taken)
    problems = () if state is None else state.problems
    if age > stale_after:
        problems = (*problems, f"the health checks have not run for {stale_after:.0f} s")
    warnings = () if state is None else state.warnings
    status: Status = "not_ready" if problems else "degraded" if warnings else "ready"
    return Report(
        status=status,
        checks={**live, **({} if state is None else state.checks)},
        problems=problems,
        warnings=warnings,
        checked_at="" if state is None else state.checked_at,
        age_seconds=-1.0 if state is None else round(age, 3),
    )


def _answer(result: object, problem: str, problems: list[str]) -> str:
    """``ok``, or ``problem`` (also added to ``problems``) for a failed call."""
    if isinstance(result, UpstreamError | TimeoutError):
        problems.append(problem)
        return "does not answer"
    if isinstance(result, BaseException):  # a bug, not an outage: loud in the log, not ready
        log.error("readiness check failed", exc_info=result)
        problems.append(problem)
        return "check failed"
    return "ok"


def _plain(value: object) -> object:
    """A JSON value (datetimes and other objects as text)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)
