"""The console's reads are bounded per worker (``broker/console/work.py``): however many pages
are opened at once, at most two reads of the log run at the same time, on the console's own
threads (never the default executor the release path shares); a page that cannot get a turn
within the wait is ``503 console_busy`` on the console's problem page (JSON on a data route).

The broker runs in this process, so each page's read is instrumented in place: a counter of the
reads running at once, and the name of the thread each runs on."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from broker.console import denials, keys, timeline, work
from tests.integration.console import Browser, console_broker

PAGES = ("/console/timeline", "/console/denials", "/console/keys")


class Counted:
    """Each read instrumented: how many run at once (the most seen), and on which threads;
    each holds its thread for ``seconds`` so that the pages opened together overlap."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.running = 0
        self.most = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def wrap(self, read: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            with self._lock:
                self.running += 1
                self.most = max(self.most, self.running)
                self.threads.add(threading.current_thread().name)
            try:
                time.sleep(self.seconds)
                return read(*args)
            finally:
                with self._lock:
                    self.running -= 1

        return counted


def instrument(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Counted:
    counted = Counted(seconds)
    for module in (timeline, denials, keys):
        monkeypatch.setattr(module, "_read", counted.wrap(module._read))
    return counted


async def test_pages_opened_at_once_run_two_reads_at_a_time_on_the_consoles_threads(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = instrument(monkeypatch, 0.3)
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        opened = await asyncio.gather(*(browser.get(PAGES[n % 3]) for n in range(9)))
        data = await browser.get("/console/api/timeline")
    assert [status for status, _, _ in opened] == [200] * 9
    assert data[0] == 200
    assert counted.most == work.READS == 2  # nine pages at once: two reads at a time
    assert counted.threads
    assert all(name.startswith("console") for name in counted.threads), counted.threads


async def test_a_page_that_gets_no_turn_in_time_is_console_busy(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(work, "WAIT_SECONDS", 0.3)  # read when the app starts
    counted = instrument(monkeypatch, 1.5)  # two reads hold both turns past the wait
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        holding = [asyncio.create_task(browser.get(page)) for page in PAGES[:2]]
        await asyncio.sleep(0.2)
        status, headers, page = await browser.get("/console/denials")
        data_status, data_headers, body = await browser.get("/console/api/timeline")
        held = await asyncio.gather(*holding)
    assert (status, headers["Retry-After"]) == (503, "5")
    assert headers["Content-Type"].startswith("text/html")
    assert 'id="problem"' in page
    assert "the console is busy" in page
    assert 'id="logout"' in page  # the console's own page, for the logged-in auditor
    assert (data_status, data_headers["Retry-After"]) == (503, "5")
    assert '"code": "console_busy"' in body
    assert [s for s, _, _ in held] == [200, 200]  # those that had their turn are answered
    assert counted.most == 2
