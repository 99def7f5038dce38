"""The console's reads, kept off the release path: threads of its own, a few at a time.

A console page may read up to 100,000 records (``reading.MAX_RECORDS``), index a million-record
log's policy records, or re-decide 20,000 decisions with a candidate. None of that runs on the
event loop's default executor, which the release path's ``asyncio.to_thread`` calls share
(attestation verifiers, stores): it runs on ``THREADS`` threads of the console's own
(``ConsoleWork.run``), at most ``READS`` at once per worker process. A further page waits for
its turn up to ``WAIT_SECONDS``, then is refused — ``503 console_busy`` with ``Retry-After``,
on the console's problem page (JSON for the data routes) — rather than queue without bound.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from aiohttp import web

from broker.core.errors import ErrorCode, UpstreamError

READS = 2  # console reads running at once, per worker process
THREADS = 2  # the console's own threads, per worker process
WAIT_SECONDS = 15.0  # a page's wait for its turn before 503 console_busy
RETRY_AFTER_SECONDS = 5

T = TypeVar("T")


class ConsoleBusy(UpstreamError):
    """Every console read slot of this worker stayed taken for ``WAIT_SECONDS`` (503)."""

    default_code = ErrorCode.CONSOLE_BUSY

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)


class ConsoleWork:
    """The console's threads and its read slots (one per worker process: an app's)."""

    def __init__(self, reads: int = READS, threads: int = THREADS) -> None:
        self._slots = asyncio.Semaphore(reads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="console")
        self._wait = WAIT_SECONDS  # read when made: a test may shorten it

    async def run(self, blocking: Callable[..., T], *args: object) -> T:
        """``blocking(*args)`` on a console thread, once a slot is free.

        Raises:
            ConsoleBusy: no slot within ``WAIT_SECONDS``.
        """
        try:
            async with asyncio.timeout(self._wait):
                await self._slots.acquire()
        except TimeoutError:
            raise ConsoleBusy(
                "the console is busy with other pages on this replica; try again shortly"
            ) from None
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, functools.partial(blocking, *args))
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stop taking work; reads still running finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


CONSOLE_WORK: web.AppKey[ConsoleWork] = web.AppKey("console_work", ConsoleWork)


async def console_read(request: web.Request, blocking: Callable[..., T], *args: object) -> T:
    """``blocking(*args)`` as console work of this request's app (``ConsoleWork.run``)."""
    return await request.app[CONSOLE_WORK].run(blocking, *args)
