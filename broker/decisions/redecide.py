"""Attestation results re-decided whenever the policy in force may differ from the one they
were decided under, until that succeeds (issue 27).

* **At start-up**, every unexpired active result in the shared store is re-decided with the
  attestation policy this process starts on (a replica restarted on a stricter bundle revokes
  what it no longer allows before it serves; with ``--workers N`` each worker does, and the
  store's atomic update logs each revocation once).
* **After each policy change** in this worker (``PolicyManager.on_change``).
* **After a failed re-decision** (the attestation store or the policy engine did not answer,
  or a bug), again with exponential backoff (``FIRST_DELAY`` doubling to ``MAX_DELAY``, with
  jitter) until one run succeeds; a later successful run (another change) makes the retry moot.

A failure is never fatal: the policy in force keeps serving, and every release on a result
runs the release policy on it anyway. Re-decision runs on the event loop like a request; its
revocations are ``attestation_revoked`` records naming the trigger (``startup``,
``policy_change``, ``retry``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Protocol

from broker.core.errors import UpstreamError

log = logging.getLogger(__name__)
FIRST_DELAY = 0.5  # seconds before the first retry
MAX_DELAY = 30.0  # seconds between retries, at most


class Revalidate(Protocol):
    def __call__(self, *, who: str, now: datetime, trigger: str) -> Awaitable[int]: ...


class Redecider:
    """Runs ``revalidate`` now, and keeps retrying it in the background after a failure."""

    def __init__(
        self,
        revalidate: Revalidate,
        clock: Callable[[], datetime],
        *,
        first_delay: float = FIRST_DELAY,
        max_delay: float = MAX_DELAY,
    ) -> None:
        self._revalidate = revalidate
        self._clock = clock
        self._first_delay = first_delay
        self._max_delay = max_delay
        self._retry: asyncio.Task[None] | None = None

    @property
    def owed(self) -> bool:
        """A failed re-decision is still being retried."""
        return self._retry is not None and not self._retry.done()

    async def now(self, who: str, trigger: str) -> bool:
        """Re-decide now (the clock read once for the run). On failure a background retry is
        scheduled (one at a time); on success a pending retry is dropped.

        Returns:
            Whether this run succeeded. Never raises (but ``CancelledError``).
        """
        if await self._attempt(who, trigger):
            if self._retry is not None:  # moot: this run decided under the policy in force
                self._retry.cancel()
            return True
        if not self.owed:
            self._retry = asyncio.create_task(self._retry_until_done(who), name="redecide")
        return False

    async def close(self) -> None:
        """Stop retrying (shutdown)."""
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry

    async def _attempt(self, who: str, trigger: str) -> bool:
        try:
            revoked = await self._revalidate(who=who, now=self._clock(), trigger=trigger)
        except asyncio.CancelledError:
            raise
        except UpstreamError as exc:  # the store or the engine did not answer: retried
            log.error(  # noqa: TRY400 - the cause is the store's or engine's, logged by it
                "re-deciding attestation results (%s) failed, will retry: %s", trigger, exc.message
            )
            return False
        except Exception:  # a bug: with its traceback, and retried like an outage
            log.exception("re-deciding attestation results (%s) failed, will retry", trigger)
            return False
        if revoked:
            log.warning("re-deciding attestation results (%s): %d revoked", trigger, revoked)
        return True

    async def _retry_until_done(self, who: str) -> None:
        delay = self._first_delay
        while True:
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))  # noqa: S311 - jitter
            if await self._attempt(who, "retry"):
                return
            delay = min(delay * 2, self._max_delay)
