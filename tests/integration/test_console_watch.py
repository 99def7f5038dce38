"""The console's Watch page (issue 34) over HTTP: it shows the state ``broker audit monitor
--rules`` leaves — the rules as the monitor described them, how far it ran, its hits, each hit on
this replica's log linked to the record's page — says when it has nothing to show, escapes what
a rules file says, and is an auditor's page like the others (session, security headers)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.client import BrokerClientError
from broker.console.web import CSP
from tests.integration.console import OTHER_IMAGE, Browser, console_broker
from tests.integration.watch import covered, log_key, monitor
from tests.support.constants import ALLOWED, KEY

SCRIPT_NAME = "<script>alert(1)</script> llama only to its image"
RULES = f"""
[[rule]]
name = "{SCRIPT_NAME}"
kind = "key_images"
key = "{KEY}"
images = ["{OTHER_IMAGE}"]

[[rule]]
name = "refused reloads"
kind = "record_type"
type = "policy_reload_failed"
"""
INLINE = re.compile(r"<script(?![^>]*\bsrc=)|\sstyle=|\son[a-z]+=")


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_watch_page_shows_the_monitors_rules_and_hits(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    state = tmp_path / "monitor.json"
    broker = await console_broker(start_broker, environ={"BROKER_AUDIT_WATCH_STATE": str(state)})
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        status, headers, _ = await browser.get("/console/watch")
        assert (status, headers["Location"]) == (303, "/console/login")  # a page: log in first
        await browser.login()
        status, headers, page = await browser.get("/console/watch")
        assert status == 200
        assert headers["Content-Security-Policy"] == CSP
        assert "does not exist yet: broker audit monitor --rules has not run" in page

        async with broker.client() as client:
            await client.release(KEY, broker.token_source())
            with pytest.raises(BrokerClientError):
                await client.release(KEY, broker.token_source(digest=OTHER_IMAGE))
        await covered(broker)
        (released,) = [r["index"] for r in broker.records() if r.get("result") == "allow"]
        (tmp_path / "rules.toml").write_text(RULES)
        key = await log_key(broker)
        log = str(broker.settings.audit.log)
        watch = ["--state", str(state), "--rules", str(tmp_path / "rules.toml"), log]
        code, hits, report = await asyncio.to_thread(monitor, *watch, "--key", key)
        assert code == 4, report
        assert [(h["rule"], h["index"]) for h in hits] == [(SCRIPT_NAME, released)]

        status, _, page = await browser.get("/console/watch")
        assert status == 200
        assert not INLINE.search(page)  # the rule's name, from the rules file, is text
        assert "&lt;script&gt;alert(1)&lt;/script&gt; llama only to its image" in page
        assert f"{KEY} released only to 1 image(s)" in page  # watch.describe, as the monitor ran
        assert "any policy_reload_failed record" in page
        assert str((tmp_path / "rules.toml").absolute()) in page
        origin = broker.settings.audit.origin
        hit_rows = page.split('id="hits"')[1]
        assert f'<a href="/console/record/{released}">{released}</a>' in hit_rows
        assert f"{KEY} released to image {ALLOWED}, not in the list" in hit_rows
        assert origin in page.split('id="progress"')[1]

        # the hit's record page is the one linked: the release, its proof verified there
        status, _, record_page = await browser.get(f"/console/record/{released}")
        assert (status, ALLOWED in record_page) == (200, True)

        state.write_text('{"version": 2, "logs": {}}')  # a monitor run without --rules
        status, _, page = await browser.get("/console/watch")
        assert "holds no watch rules: run broker audit monitor with --rules" in page
        state.write_text('{"watch": {"rules": [{"name": 1}], "hits": [{"index": "x"}, 3]}}')
        status, _, page = await browser.get("/console/watch")  # entries that do not read
        assert status == 200
        assert page.count("<td colspan=") == 3  # no rule, no log, no hit shown


async def test_watch_page_without_a_state_configured_says_so(
    start_broker: Callable[..., Any],
) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        status, _, page = await browser.get("/console/watch")
        assert status == 200
        assert "no [audit] watch_state in this broker&#39;s configuration" in page
        assert 'href="/console/watch" aria-current="page"' in page
