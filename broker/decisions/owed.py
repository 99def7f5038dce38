"""The owed-record pass (issue 30 review): every process writes, on its own, the revocation
records their revokers could not write, independent of any policy re-decision.

A revocation takes effect first and leaves its ``attestation_revoked`` record owed in the store
entry (``results.py``). Each process runs ``AttestationResults.write_owed`` every
``PASS_INTERVAL`` (jittered, so workers and replicas do not all claim at once), and ``SOON``
after a record it revoked was not written (``AttestationResults.on_owed``). A pass that fails
(the store or the log down, or a bug) is logged and the next one tries again; nothing here is
ever fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from datetime import datetime

from broker.attestation.stored import RECORD_GRACE
from broker.core.errors import UpstreamError

log = logging.getLogger(__name__)
PASS_INTERVAL = RECORD_GRACE.total_seconds() / 2  # seconds between passes, ±20 %
SOON = 2.0  # seconds after a failed record before this process's next pass


class OwedRecordPass:
    """Runs ``write(now)`` every ``interval`` seconds, and ``soon`` seconds after ``wake``."""

    def __init__(
        self,
        write: Callable[[datetime], Awaitable[int]],
        clock: Callable[[], datetime],
        *,
        interval: float = PASS_INTERVAL,
        soon: float = SOON,
    ) -> None:
        self._write = write
        self._clock = clock
        self._interval = interval
        self._soon = soon
        self._woken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run passes in the background until ``close``; the first one ``soon`` from now
        (records a stopped process left owed)."""
        if self._task is None:
            self._woken.set()
            self._task = asyncio.create_task(self._run(), name="owed-records")

    def wake(self) -> None:
        """A record was not written: a pass ``soon``, not a whole interval later."""
        self._woken.set()

    async def close(self) -> None:
        """Stop (shutdown); a record being written is finished (``results.py`` shields it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def once(self) -> int:
        """One pass now: how many records it wrote. Never raises (but ``CancelledError``)."""
        try:
            written = await self._write(self._clock())
        except asyncio.CancelledError:
            raise
        except UpstreamError as exc:  # the store did not answer: the next pass
            log.warning("writing owed revocation records failed, will retry: %s", exc.message)
            return 0
        except Exception:  # a bug: with its traceback, and the next pass tries again
            log.exception("writing owed revocation records failed, will retry")
            return 0
        if written:
            log.warning("%d owed revocation record(s) written late", written)
        return written

    async def _run(self) -> None:
        while True:
            jitter = self._interval * random.uniform(0.8, 1.2)  # noqa: S311 - not a secret
            try:
                async with asyncio.timeout(jitter):
                    await self._woken.wait()
            except TimeoutError:
                pass
            else:
                await asyncio.sleep(self._soon)
            self._woken.clear()
            await self.once()
