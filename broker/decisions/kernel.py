"""The decision kernel: every decision the broker makes on a request runs here, once.

A decision path is a **plan** (``Plan``): how its request is parsed, how it is decided, what its
record holds beyond the common envelope, and what its answer is. The kernel runs every plan the
same way and so keeps the broker's central promise in one place:

1. **Shielded.** The run is one task the caller's cancellation cannot cut: a client that hangs
   up cannot leave a decision unlogged, nor "log, then release" half done.
2. **Parse, then decide.** Whatever either raises ends the decision: a ``BrokerError`` with its
   own code; anything else is a bug, logged here with its traceback and recorded as
   ``internal_error`` (the client and the record see no detail). On any error, whatever the
   plan made to answer with (a wrapped key, a signed result) is withdrawn: it is never answered
   and the record never says ``allow`` for it (``Plan.withdraw``).
3. **One record, total.** The envelope (type, decision id, request id, time, result, code,
   message) and the plan's body. If building it fails (a bug), a minimal record is written
   instead and the decision becomes ``internal_error``, withdrawn like any other.
4. **Durable before the answer.** The record is appended (written and fsync'd) before anything
   is answered; if the log cannot take it, the plan's work is withdrawn and the log's
   ``audit_log_unavailable`` (503) is the answer.
5. **Counted.** Every decision of every plan in its family's counter and latency histogram
   (``broker_release_*``, ``broker_attest_*``), a log that failed included.
6. **Answered.** A refusal carries its record's ``log_index`` (the client asks for its inclusion
   proof); otherwise the plan's answer, built before the record was written, gets its place in
   the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar

from prometheus_client import Counter, Histogram

from broker.audit.log import Appended, DecisionLog
from broker.core.encoding import canonical_members
from broker.core.errors import BrokerError, InternalFailure
from broker.core.metrics import Metrics
from broker.core.records import record_head

log = logging.getLogger(__name__)
U = TypeVar("U")  # what arrived, unverified
Q = TypeVar("Q")  # the request, parsed
F = TypeVar("F")  # what the plan learns while deciding (its record's material)
A = TypeVar("A")  # the answer


class Family(Enum):
    """Which metrics count a plan's decisions."""

    RELEASE = "release"  # broker_release_decisions_total, broker_release_seconds
    ATTEST = "attest"  # broker_attest_decisions_total, broker_attest_seconds


def outcome_of(error: BrokerError | None) -> str:
    """``allow``; ``deny`` when the requester is at fault (4xx or policy); ``error`` when we or
    an upstream are (5xx)."""
    if error is None:
        return "allow"
    return "deny" if error.status < 500 else "error"


def code_of(error: BrokerError | None) -> str:
    """The code a metric counts: the error's, or ``ok``."""
    return "ok" if error is None else error.code.value


class Stopwatch:
    """Where one decision's time went: ``(stage, seconds)`` in order (``Server-Timing``)."""

    def __init__(self) -> None:
        self.started = self._mark = time.perf_counter()
        self.stages: list[tuple[str, float]] = []

    def lap(self, stage: str) -> None:
        """The time since the previous lap (or the start) belongs to ``stage``."""
        now = time.perf_counter()
        self.stages.append((stage, now - self._mark))
        self._mark = now


@dataclass
class Case(Generic[U, Q, F]):
    """One request being decided: what arrived, what it parsed as, what the plan learned, and
    the error that ended it (``None`` while it stands)."""

    decision_id: str
    request_id: str
    now: datetime  # the one clock reading of this request
    unverified: U
    facts: F
    request: Q | None = None
    error: BrokerError | None = None
    watch: Stopwatch = field(default_factory=Stopwatch)


class Plan(ABC, Generic[U, Q, F, A]):
    """One decision path, run by ``Kernel.run``. The kernel calls, in this order: ``facts``,
    ``parse``, ``decide``, (``withdraw`` on an error), ``body``, ``tally``, ``refusal``, then
    ``placed`` when nothing was refused."""

    record_type: ClassVar[str]  # the record's ``type``
    family: ClassVar[Family] = Family.RELEASE

    @abstractmethod
    def facts(self) -> F:
        """An empty bag for what deciding learns (must not fail)."""

    @abstractmethod
    def parse(self, unverified: U) -> Q:
        """The request's shape, typed (nothing verified yet). Raises: ``InputError``."""

    @abstractmethod
    async def decide(self, case: Case[U, Q, F], request: Q) -> A:
        """Verify and decide, keeping in ``case.facts`` what the record needs as it is learned;
        return the answer (its log position still unknown). Raises: ``BrokerError``."""

    @abstractmethod
    def body(self, case: Case[U, Q, F]) -> dict[str, Any]:
        """The record's members beyond the envelope, from whatever was learned (total)."""

    @abstractmethod
    async def placed(self, case: Case[U, Q, F], answer: A, appended: Appended) -> A:
        """``answer`` with its record's place in the log (no decision is made here)."""

    def withdraw(self, case: Case[U, Q, F]) -> None:
        """An error ended the decision: mark anything it made as not released (the answer
        itself is dropped by the kernel)."""

    def result(self, case: Case[U, Q, F]) -> str:
        """The record's ``result``."""
        return outcome_of(case.error)

    def minimal(self, case: Case[U, Q, F]) -> dict[str, Any]:
        """Members of the minimal record beyond the envelope (building ``body`` failed)."""
        return {}

    def tally(self, case: Case[U, Q, F]) -> Iterable[tuple[str, str]]:
        """(outcome, code) of each decision the record holds, for the metrics."""
        return [(outcome_of(case.error), code_of(case.error))]

    def refusal(self, case: Case[U, Q, F]) -> BrokerError | None:
        """The error to answer with, if nothing is answered otherwise."""
        return case.error


class Kernel:
    """Runs plans: shield, parse, decide, record, append, count, answer."""

    def __init__(self, audit: DecisionLog, metrics: Metrics) -> None:
        self._audit = audit
        self._metrics: dict[Family, tuple[Counter, Histogram]] = {
            Family.RELEASE: (metrics.decisions, metrics.release_latency),
            Family.ATTEST: (metrics.attest_decisions, metrics.attest_latency),
        }

    async def run(
        self, plan: Plan[U, Q, F, A], unverified: U, *, now: datetime, request_id: str
    ) -> A:
        """Decide ``unverified`` with ``plan``; cancelling the caller does not interrupt it.

        Raises:
            BrokerError: the refusal, once its record is durable (``details["log_index"]``);
                ``audit_log_unavailable`` when the record could not be made durable.
        """
        task = asyncio.ensure_future(self._run(plan, unverified, now, request_id))
        return await asyncio.shield(task)

    async def _run(self, plan: Plan[U, Q, F, A], unverified: U, now: datetime, rid: str) -> A:
        case: Case[U, Q, F] = Case(str(uuid.uuid4()), rid, now, unverified, plan.facts())
        answer = await self._decide(plan, case)
        record = self._record(plan, case)
        if case.error is not None:
            answer = None
        case.watch.lap("record")
        try:
            appended = await self._audit.append_entry(record)
        except Exception as exc:  # the log did not take it: nothing decided may leave
            failure = exc if isinstance(exc, BrokerError) else InternalFailure("internal error")
            self._count(plan, case, [(outcome_of(failure), code_of(failure))], failure)
            raise
        case.watch.lap("log")
        self._count(plan, case, plan.tally(case), case.error)
        refusal = plan.refusal(case)
        if refusal is None and answer is None:
            refusal = InternalFailure("internal error")  # unreachable: no error, no answer
        if refusal is not None:
            refusal.details["log_index"] = appended.index  # the client asks for its proof
            raise refusal
        assert answer is not None  # noqa: S101 - for the type checker: refused above otherwise
        try:  # the decision is durable and allowed: the answer leaves whatever happens here
            return await plan.placed(case, answer, appended)
        except Exception:
            log.exception("%s %s: placing the answer failed", plan.record_type, case.decision_id)
            return answer

    async def _decide(self, plan: Plan[U, Q, F, A], case: Case[U, Q, F]) -> A | None:
        try:
            case.request = request = plan.parse(case.unverified)
            case.watch.lap("parse")
            return await plan.decide(case, request)
        except BrokerError as exc:
            self._fail(plan, case, exc)
        except Exception:  # a bug: recorded, nothing released, details only in the server log
            log.exception("%s %s: unexpected failure", plan.record_type, case.decision_id)
            self._fail(plan, case, InternalFailure("internal error"))
        return None

    @staticmethod
    def _fail(plan: Plan[U, Q, F, A], case: Case[U, Q, F], error: BrokerError) -> None:
        """End the decision with ``error``: whatever the plan made is withdrawn."""
        case.error = error
        try:
            plan.withdraw(case)
        except Exception:  # a bug in withdrawing: the answer is dropped all the same
            log.exception("%s %s: withdrawing failed", plan.record_type, case.decision_id)

    def _record(self, plan: Plan[U, Q, F, A], case: Case[U, Q, F]) -> dict[str, Any]:
        """The envelope and the plan's body; if building it fails (a bug), or it cannot be
        encoded as the log writes it (canonical JSON, a part the plan encoded once spliced in:
        ``canonical_members``), a minimal record."""
        try:
            record = {**self._envelope(plan, case, plan.result(case)), **plan.body(case)}
            canonical_members(record)  # encodable: else the log's writer would fail on it, for good
            return record
        except Exception:
            log.exception("%s %s: building the record failed", plan.record_type, case.decision_id)
            self._fail(plan, case, InternalFailure("internal error"))
            envelope = self._envelope(plan, case, outcome_of(case.error))
            del envelope["message"]  # the minimal record names its code only
            return {**envelope, **plan.minimal(case)}

    @staticmethod
    def _envelope(plan: Plan[U, Q, F, A], case: Case[U, Q, F], result: str) -> dict[str, Any]:
        error = case.error
        return record_head(  # the envelope every reader parses back (audit/envelope.py)
            plan.record_type,
            decision_id=case.decision_id,
            request_id=case.request_id,
            time=case.now,
            result=result,
            code=error.code.value if error else None,
            message=error.message if error else None,
        )

    def _count(
        self,
        plan: Plan[U, Q, F, A],
        case: Case[U, Q, F],
        decided: Iterable[tuple[str, str]],
        error: BrokerError | None,
    ) -> None:
        decisions, latency = self._metrics[plan.family]
        for outcome, code in decided:
            decisions.labels(outcome, code).inc()
        latency.labels(outcome_of(error)).observe(time.perf_counter() - case.watch.started)
