"""The console's pages over a live broker that holds every kind of record (issue 34): each page
renders (and every record's page), the keys page says what the log says each key version was
released to and what the key store never released, the pages page back through the log in
bounded windows, and the policy history lists every change."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.console import history
from broker.console.reading import MAX_RECORDS
from broker.core.records import RecordType
from tests.integration.attested import DENIED_KEY
from tests.integration.console import Browser, console_broker, every_kind_broker, tables
from tests.integration.every_record import (
    EXTRA_KEY,
    NEWER_TYPE,
    a_bug_after_the_first_key,
    every_kind_of_log,
)
from tests.support.constants import ALLOWED, KEY

TIMES, DASH = "\u00d7", "\u2013"  # as the pages write them
WINDOWED = ("/console/timeline", "/console/denials", "/console/keys")
PAGES = ("/console/", *WINDOWED, "/console/policy")
WINDOW = re.compile(r"Records (\d+)\u2013(\d+) of the (\d+) in this replica's log")


async def test_every_page_renders_over_every_kind_of_record(
    start_broker: Callable[..., Any],
) -> None:
    broker, jti = await every_kind_broker(start_broker)
    records = broker.records()
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        for path in PAGES:
            status, headers, page = await browser.get(path)
            assert status == 200, (path, page)
            assert headers["Content-Type"].startswith("text/html")
            assert "Traceback" not in page
        for record in records:  # every record's own page, whatever its type
            status, _, page = await browser.get(f"/console/record/{record['index']}")
            assert status == 200, (record["type"], page)
            assert f"<td>{record['type']}</td>" in page
        status, _, page = await browser.get("/console/keys")
        found = tables(page)
        by_version = {(row[0], row[1]): row for row in found["key-versions"]}
        released = by_version[(KEY, "1")]
        # a release, a release on the result, its key of a partial one, a KBS guest's resource;
        # one refused (the script reason); one image (a KBS guest has none); three recipient
        # keys (the release's, the result's, the guest's tee-pubkey); two results
        assert released[3:7] == ["4", "1", f"1 {ALLOWED} {TIMES}3", "3"]
        assert released[7] == "2"
        assert by_version[(DENIED_KEY, "1")][3:5] == ["0", "3"]
        never = {(row[0], row[1]) for row in found["never-released"]}
        assert {(DENIED_KEY, "1"), (EXTRA_KEY, "1")} <= never
        assert (KEY, "1") not in never
        attestations = {row[0]: row for row in found["attestations"]}
        assert len(attestations) == 3  # the SDK's (revoked), the hand-made runner's, the guest's
        assert attestations[jti][3] == f"{KEY} v1 {TIMES}2"
        assert "by token:" in attestations[jti][4]
        assert "feeds test" in attestations[jti][4]
        assert [row[2] for row in found["revocations"]] == [jti]
        assert [(row[2], row[3]) for row in found["key-changes"]] == [
            (f"{EXTRA_KEY} v1", "create ok (enabled)")
        ]
        status, _, page = await browser.get(f"/console/keys?key={DENIED_KEY}")
        found = tables(page)
        assert [row[0] for row in found["key-versions"]] == [DENIED_KEY]
        assert [row[0] for row in found["never-released"]] == [DENIED_KEY]
        assert found["attestations"] == [["none among these records"]]


async def test_pages_read_bounded_windows_and_page_back(start_broker: Callable[..., Any]) -> None:
    broker, _ = await every_kind_broker(start_broker)
    records = broker.records()
    size = len(records)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        status, _, body = await browser.get("/console/api/timeline?records=4")
        assert status == 200
        assert json.loads(body)["scanned"] == {"first": size - 4, "end": size, "size": size}
        status, _, page = await browser.get("/console/denials?records=4")
        assert f"Records {size - 4}{DASH}{size - 1} of the {size}" in page
        older = re.search(r'class="older" href="([^"]+)"', page)
        assert older is not None
        assert older.group(1).replace("&amp;", "&") == f"/console/denials?records=4&end={size - 4}"
        status, _, page = await browser.get(f"/console/denials?records=4&end={size - 4}")
        assert f"Records {size - 8}{DASH}{size - 5} of the {size}" in page
        newer = re.search(r'class="newer" href="([^"]+)"', page)
        assert newer is not None
        assert newer.group(1) == "/console/denials?records=4"  # the newest window
        denied = {r["index"] for r in records[size - 8 : size - 4] if r.get("result") == "deny"}
        shown = {int(i) for i in re.findall(r'href="/console/record/(\d+)"', page)}
        assert shown == denied
        for query in (f"records={MAX_RECORDS + 1}", "records=0", "end=-1", "records=1e3"):
            status, _, page = await browser.get(f"/console/keys?{query}")
            assert status == 400, query
            assert 'class="problem"' in page
        status, _, body = await browser.get(f"/console/api/timeline?records={MAX_RECORDS + 1}")
        assert status == 400
        assert '"bad_request"' in body


@pytest.mark.parametrize("path", ["/console/keys", "/console/policy"])
async def test_new_pages_need_a_session(start_broker: Callable[..., Any], path: str) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        status, headers, _ = await Browser(broker, session).get(path)
        assert (status, headers["Location"]) == (303, "/console/login")


async def test_every_record_type_renders_and_every_list_pages_through_the_log(
    start_broker: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log holding every record type a log can hold — every decision and change of a live
    broker, a release cut short by a bug, a repaired torn line, a checkpoint-key hand-over, a
    newer broker's type — served by a broker: every page and every record's page renders; each
    windowed page's older links walk the whole log in windows that neither gap nor overlap, and
    the policy history's walk every policy record once, newest first."""
    source, _ = await every_kind_broker(start_broker)
    await a_bug_after_the_first_key(source, monkeypatch)
    log = tmp_path / "every.log"
    await every_kind_of_log(source.settings.audit.log, log)

    def with_the_log(workdir: Path) -> None:
        shutil.copyfile(log, workdir / "decisions.log")

    broker = await console_broker(start_broker, workdir_setup=with_the_log)
    records = broker.records()
    types = {r["type"] for r in records}
    assert types == {t.value for t in RecordType} - {"unknown"} | {NEWER_TYPE}
    assert "internal_error" in {r.get("code") for r in records}
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        for path in PAGES:
            status, _, page = await browser.get(path)
            assert status == 200, (path, page)
        for record in records:
            status, _, page = await browser.get(f"/console/record/{record['index']}")
            assert status == 200, (record["type"], page)
            assert f"<td>{record['type']}</td>" in page
        for path in WINDOWED:
            windows = await _walk_back(browser, f"{path}?records=7")
            assert windows[0][1] == len(records) - 1  # the newest record first
            assert windows[-1][0] == 0  # back to the first
            for newer, older in itertools.pairwise(windows):
                assert older[1] == newer[0] - 1, (path, windows)  # no gap, no overlap
        monkeypatch.setattr(history, "SHOWN", 1)  # the history pages one record at a time
        listed: list[int] = []
        next_path: str | None = "/console/policy"
        while next_path is not None:
            status, _, page = await browser.get(next_path)
            assert status == 200, page
            listed += [int(row[0]) for row in tables(page)["history"]]
            link = re.search(r'class="older" href="([^"]+)"', page)
            next_path = None if link is None else link.group(1)
            assert len(listed) < 100
        policy = ("policy_change", "policy_reload_failed")
        assert listed == [r["index"] for r in reversed(records) if r["type"] in policy]
        assert len(listed) >= 3  # two brokers' start-ups and a failed reload


async def _walk_back(browser: Browser, path: str) -> list[tuple[int, int]]:
    """The windows (first, last record) a list page shows, following its older links."""
    windows: list[tuple[int, int]] = []
    next_path: str | None = path
    while next_path is not None:
        status, _, page = await browser.get(next_path)
        assert status == 200, (next_path, page)
        assert "Traceback" not in page
        shown = WINDOW.search(page)
        assert shown is not None, next_path
        windows.append((int(shown.group(1)), int(shown.group(2))))
        older = re.search(r'class="older" href="([^"]+)"', page)
        next_path = None if older is None else older.group(1).replace("&amp;", "&")
        assert len(windows) < 100
    return windows
