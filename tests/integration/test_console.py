"""The auditor console over HTTP (issue 34): log-in with an auditor token only, a strict session
cookie, CSRF refused, log-out that holds for every worker, the security headers on every answer,
and pages that read the log through the query code."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from broker.client import BrokerClientError
from broker.console.web import CSP
from tests.integration.console import (
    AUDITOR_TOKEN,
    COOKIE,
    FULL_ADMIN_TOKEN,
    KEY_ADMIN_TOKEN,
    OTHER_IMAGE,
    XSS_REASON,
    Browser,
    console_broker,
    with_xss_reason,
)
from tests.support.constants import KEY


async def test_console_is_absent_without_an_auditor_token(
    start_broker: Callable[..., Any],
) -> None:
    broker = await start_broker()  # no [admin] tokens at all
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        for path in ("/console/login", "/console/", "/console/static/verify.js"):
            status, headers, _ = await browser.get(path)
            assert status == 404, path
            assert headers["Content-Security-Policy"] == CSP


async def test_login_logout_and_the_session_cookie(start_broker: Callable[..., Any]) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        browser = Browser(broker, session)
        status, headers, _ = await browser.get("/console/")
        assert (status, headers["Location"]) == (303, "/console/login")
        status, headers, page = await browser.get(f"/console/login?token={AUDITOR_TOKEN}")
        assert status == 200
        assert "Set-Cookie" not in headers  # a token in a URL logs nobody in
        assert headers["Content-Security-Policy"] == CSP
        assert headers["Cache-Control"] == "no-store"
        assert not re.search(r"<script(?![^>]*\bsrc=)|\sstyle=|\son[a-z]+=", page)
        status, response, _ = await browser.post("/console/login", {"token": KEY_ADMIN_TOKEN})
        assert status == 401
        assert "Set-Cookie" not in response.headers  # key-admin is not auditor
        status, response, page = await browser.post("/console/login", {"token": FULL_ADMIN_TOKEN})
        assert status == 401
        assert "Set-Cookie" not in response.headers  # more than auditor: not in a browser
        assert "use an auditor-only token" in page
        jar = await browser.login()
        cookie = jar[COOKIE]
        assert cookie["httponly"]
        assert cookie["secure"]
        assert cookie["samesite"] == "Strict"
        assert cookie["path"] == "/"
        assert not cookie["domain"]
        assert 0 < int(cookie["max-age"]) <= 900
        assert AUDITOR_TOKEN not in cookie.value
        status, headers, page = await browser.get("/console/")
        assert status == 200, page
        assert broker.settings.audit.origin in page
        status, _, _ = await browser.get("/console/api/timeline")
        assert status == 200
        status, response, _ = await browser.post("/console/logout")
        assert (status, response.headers["Location"]) == (303, "/console/login")
        status, headers, _ = await browser.get("/console/")  # the same cookie, replayed
        assert (status, headers["Location"]) == (303, "/console/login")
        status, _, body = await browser.get("/console/api/timeline")
        assert status == 401
        assert '"unauthorized"' in body


@pytest.mark.parametrize("origin", ["https://evil.example", "null", None])
async def test_cross_origin_login_refused(start_broker: Callable[..., Any], origin: str) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        status, response, body = await browser.post(
            "/console/login", {"token": AUDITOR_TOKEN}, origin=origin
        )
        assert status == 403
        assert '"origin_refused"' in body
        assert "Set-Cookie" not in response.headers


async def test_cross_origin_logout_refused(start_broker: Callable[..., Any]) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        status, _, _ = await browser.post("/console/logout", origin="https://evil.example")
        assert status == 403
        status, _, _ = await browser.get("/console/")
        assert status == 200  # still logged in: the forged log-out did nothing


async def test_forged_cookie_is_no_session(start_broker: Callable[..., Any]) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        assert browser.cookie is not None
        browser.cookie = browser.cookie[:-3] + ("AAA" if browser.cookie[-3:] != "AAA" else "BBB")
        status, headers, _ = await browser.get("/console/")
        assert (status, headers["Location"]) == (303, "/console/login")


@pytest.mark.parametrize("deployment", ["workers"], indirect=True)
async def test_a_session_holds_for_every_worker_and_so_does_its_logout(
    start_broker: Callable[..., Any],
) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
    seen = []
    for _ in range(12):  # a new connection each time: the kernel spreads them over the workers
        async with aiohttp.ClientSession() as session:
            replay = Browser(broker, session)
            replay.cookie = browser.cookie
            seen.append((await replay.get("/console/"))[0])
    assert seen == [200] * 12
    async with aiohttp.ClientSession() as session:
        browser.session = session
        assert (await browser.post("/console/logout"))[0] == 303
    for _ in range(12):
        async with aiohttp.ClientSession() as session:
            replay = Browser(broker, session)
            replay.cookie = browser.cookie
            seen.append((await replay.get("/console/"))[0])
    assert seen[12:] == [303] * 12


async def test_pages_read_the_log_and_escape_what_it_says(start_broker: Callable[..., Any]) -> None:
    broker = await console_broker(start_broker, workdir_setup=with_xss_reason)
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
        with pytest.raises(BrokerClientError):
            await client.release(KEY, broker.token_source(digest=OTHER_IMAGE))
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        status, _, body = await browser.get(f"/console/api/timeline?key={KEY}")
        assert status == 200
        data = json.loads(body)
        assert (data["totals"]["allow"], data["totals"]["deny"]) == (1, 1)
        assert sum(data["series"]["deny"]) == 1
        assert "policy_change" in {m["type"] for m in data["markers"]}  # the start-up's
        status, _, body = await browser.get("/console/api/timeline?key=models/none")
        assert json.loads(body)["totals"]["allow"] == 0
        status, _, page = await browser.get("/console/denials")
        assert status == 200
        assert XSS_REASON not in page
        assert "&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;" in page
        (denied,) = [r for r in broker.records() if r.get("result") == "deny"]
        status, _, page = await browser.get(f"/console/record/{denied['index']}")
        assert status == 200
        assert "<script>document" not in page
        assert f"broker audit prove {denied['index']} --log" in page
        status, _, _ = await browser.get("/console/record/999999")
        assert status == 404
        status, _, body = await browser.get("/console/api/timeline?interval=7")
        assert status == 400
        assert '"bad_request"' in body
