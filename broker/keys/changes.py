"""Key changes recorded around the store: an intent, the change, then its outcome.

Every key change (``keys/service.py``: create, import, rotate, enable, disable, destroy, rewrap;
``cli/keys_transfer.py``: restore, migrate-store) is two ``key_admin`` records in the decision
log: the intent, written before the store is touched (a change the log cannot take is not made)
and marked ``phase: intent`` (logs older than that marker have intents without it), then the
outcome, the same action with ``result`` and ``intent`` (the intent's leaf index):

* ``ok``: the store made the change;
* ``error`` (with ``code`` and ``message``): the store did not make it (another replica won the
  race, the store refused or failed and a re-read shows the change absent, a bug);
* ``unknown`` (with ``code``): the change failed in a way that may have reached the store, and
  the store could not be read back to tell, or reads back partly made (a copy cut short).

An intent without an outcome (the process killed, the outcome's append failed) means unknown:
the store says. A change whose commit failed ambiguously (a timeout after the database may have
committed) is re-read: the store showing exactly the change is ``ok`` (and the caller gets no
error), anything else ``error``, a failed re-read ``unknown``; a refusal (``conflict``) is an
answer and is not re-read, unless the change (a copy of many versions) had already written part
of itself: then it is re-read like any other failure, and the outcome lists what it wrote. The
change runs shielded from its caller's cancellation (an admin hanging up cannot leave it half
done), and its result is always retrieved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from broker.core.errors import BrokerError, Conflict, ErrorCode, UpstreamError
from broker.core.records import CHANGE_INTENT, ChangeResult, RecordType

OK, ERROR, UNKNOWN = ChangeResult.OK, ChangeResult.ERROR, ChangeResult.UNKNOWN
log = logging.getLogger(__name__)


class Logged(Protocol):
    """What appending a record gives back (``DecisionLog.append_entry``'s ``Appended``)."""

    @property
    def index(self) -> int: ...


ChangeLogger = Callable[[Mapping[str, Any]], Awaitable[Logged]]
# the store re-read after a failed commit: True it shows the change, False it shows it was not
# made, None it shows neither (changed since, or partly made: whether this change was made
# cannot be told)
Check = Callable[[], Awaitable[bool | None]]
# what a commit that failed had already written, for its outcome (empty: nothing)
Written = Callable[[], Mapping[str, Any]]


def key_admin_entry(
    action: str, fields: Mapping[str, Any], *, now: datetime, who: str
) -> dict[str, Any]:
    """A ``key_admin`` record as every writer writes it (never key material)."""
    head = {"type": RecordType.KEY_ADMIN, "action": action, "time": now.isoformat(), "who": who}
    return {**head, **fields}


@dataclass(frozen=True)
class Recorder:
    """Writes one change's records to ``change_log`` (nothing when there is none)."""

    change_log: ChangeLogger | None
    action: str
    fields: Mapping[str, Any]  # what both records say about the change
    now: datetime
    who: str

    async def intent(self) -> int | None:
        """Record the change before it is made; its leaf index.

        Raises:
            UpstreamError: ``audit_log_unavailable`` saying the change was not made.
        """
        if self.change_log is None:
            return None
        try:
            logged = await self.change_log(self._entry({"phase": CHANGE_INTENT}))
        except UpstreamError as exc:
            if exc.code is not ErrorCode.AUDIT_LOG_UNAVAILABLE:
                raise
            raise UpstreamError(
                f"the key change ({self.action}) could not be recorded durably in the decision "
                "log, so it was not made",
                code=ErrorCode.AUDIT_LOG_UNAVAILABLE,
            ) from exc
        return logged.index

    async def outcome(
        self,
        intent: int | None,
        result: ChangeResult,
        detail: Mapping[str, Any] | None = None,
        failure: BaseException | None = None,
    ) -> None:
        """Record how the change ended (best effort: without it, the intent alone stands for
        unknown and the store says)."""
        if self.change_log is None or intent is None:
            return
        extra: dict[str, Any] = {"result": result, "intent": intent, **(detail or {})}
        if failure is not None:
            extra |= _described(failure)
        try:
            await self.change_log(self._entry(extra))
        except Exception:
            log.exception(
                "key %s (intent %s): outcome %s not recorded", self.action, intent, result
            )

    def _entry(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        return key_admin_entry(self.action, {**self.fields, **extra}, now=self.now, who=self.who)


async def recorded(
    recorder: Recorder,
    commit: Callable[[], Awaitable[Mapping[str, Any]]],
    check: Check,
    written: Written | None = None,
) -> Mapping[str, Any]:
    """The intent, ``commit`` (what it returns goes into the ``ok`` outcome), the outcome;
    shielded from the caller's cancellation. ``check`` re-reads the store after a commit that
    failed in a way that may have reached it; ``written`` (for a change made in several
    writes) says what a failed commit had written: a refusal after a write is re-read too.

    Raises:
        UpstreamError: ``audit_log_unavailable`` when the intent cannot be recorded (nothing
            made); the commit's own error when the change is not made or its fate is unknown.
    """
    task = asyncio.ensure_future(_run(recorder, commit, check, written))
    task.add_done_callback(_retrieve)  # a caller gone: its failure is in the log, not lost
    return await asyncio.shield(task)


async def _run(
    recorder: Recorder,
    commit: Callable[[], Awaitable[Mapping[str, Any]]],
    check: Check,
    written: Written | None,
) -> Mapping[str, Any]:
    intent = await recorder.intent()
    try:
        detail = await commit()
    except Exception as exc:
        wrote = {} if written is None else dict(written())
        if isinstance(exc, Conflict) and not wrote:  # the store's answer: not made
            await recorder.outcome(intent, ERROR, failure=exc)
            raise
        result = await _reread(check)
        await recorder.outcome(intent, result, wrote, failure=None if result == OK else exc)
        if result == OK:  # it reached the store after all (a lost reply)
            return {}
        raise
    await recorder.outcome(intent, OK, detail)
    return detail


async def _reread(check: Check) -> ChangeResult:
    try:
        shows = await check()
    except Exception:
        log.warning("a key change failed and the store could not be read back", exc_info=True)
        return UNKNOWN
    return {True: OK, False: ERROR, None: UNKNOWN}[shows]


def _described(failure: BaseException) -> dict[str, Any]:
    """The code and message of a failure (a bug's own text stays out of the log)."""
    if isinstance(failure, BrokerError):
        return {"code": failure.code.value, "message": failure.message}
    return {"code": ErrorCode.INTERNAL.value, "message": "the change failed"}


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
