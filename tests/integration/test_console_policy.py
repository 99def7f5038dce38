"""The console's policy history and candidate comparison (issue 34): every policy change and
failed reload with who, trigger and digest; a candidate bundle uploaded by an auditor re-decides
the logged decisions as ``broker policy replay`` does, and never becomes the broker's policy;
the upload is bounded and Origin-checked, and a bundle that does not load is said so in the
page."""

from __future__ import annotations

import asyncio
import html
import io
import json
import logging
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.console import policy
from broker.console.policy import MAX_CANDIDATE_BYTES
from broker.policy import opa_bundle
from tests.integration.console import (
    KEY_ADMIN_TOKEN,
    Browser,
    candidate_bundle,
    console_broker,
    tables,
    with_xss_reason,
)
from tests.policy_helpers import SHIPPED
from tests.support.bundle_server import SCOPE, WIDENING_MODULE, build, opa_built, signing_keys
from tests.support.cli import run
from tests.support.constants import KEY


async def _upload(
    browser: Browser, bundle: bytes, *, records: str = "", origin: str = "own"
) -> tuple[int, str]:
    form = aiohttp.FormData()
    form.add_field(
        "bundle", io.BytesIO(bundle), filename="candidate.tar.gz", content_type="application/gzip"
    )
    if records:
        form.add_field("records", records)
    async with browser.session.post(
        browser.broker.url + "/console/policy/compare",
        data=form,
        headers=browser.headers(origin),
        ssl=browser.broker.client_tls,
        allow_redirects=False,
    ) as response:
        return response.status, await response.text()


async def test_history_and_a_candidate_compared_never_made_live(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    broker = await console_broker(start_broker, workdir_setup=with_xss_reason)
    async with broker.client() as client:
        for _ in range(3):
            await client.release(KEY, broker.token_source())
    broken = broker.workdir / "policies" / "broker" / "broken.rego"
    broken.write_text("package broker.release\nthis is not rego\n")
    policies = broker.workdir / "policies"
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        async with session.post(
            broker.url + "/v1/admin/policy/reload",
            headers={"Authorization": f"Bearer {KEY_ADMIN_TOKEN}"},
            ssl=broker.client_tls,
        ) as response:
            assert response.status == 409
        broken.unlink()
        await browser.login()
        status, _, page = await browser.get("/console/policy")
        assert status == 200
        history = tables(page)["history"]
        assert [row[2:4] for row in history] == [
            ["policy_reload_failed", "admin"],
            ["policy_change", "startup"],
        ]
        assert history[0][4].startswith("token:")
        assert "opa check --strict failed" in history[0][8]
        in_force = re.search(r'id="in-force">([^<]+)<', page)
        assert in_force is not None
        assert history[1][6].startswith(in_force.group(1))

        same = await asyncio.to_thread(candidate_bundle, policies, tmp_path / "same", withdraw=None)
        status, page = await _upload(browser, same)
        assert status == 200, page
        summary = tables(page)["summary"][0]
        assert summary[:3] == ["3", "3", "0"]  # three releases re-decided alike
        withdrawn = await asyncio.to_thread(
            candidate_bundle, policies, tmp_path / "w", withdraw=KEY
        )
        status, page = await _upload(browser, withdrawn)
        assert status == 200, page
        found = tables(page)
        assert found["summary"][0][:3] == ["3", "0", "3"]  # allow_to_deny
        assert {row[3] for row in found["changes"]} == {KEY}
        assert {row[4] for row in found["changes"]} == {"allow_to_deny"}
        assert "Compare only." in page
        # what `broker policy replay` prints for the same records, line for line
        bundle = tmp_path / "withdrawn.tar.gz"
        bundle.write_bytes(withdrawn)
        replayed = await asyncio.to_thread(
            run, "policy", "replay", "--log", str(broker.settings.audit.log),
            "--policy", str(bundle),
        )  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
        assert _printed(page) == replayed.stdout.splitlines()
        assert len(replayed.stdout.splitlines()) == 4  # three changes and the summary
        command = re.search(r'id="replay-command">([^<]+)<', page)
        assert command is not None
        assert html.unescape(command.group(1)).startswith(
            f"broker policy replay --log {broker.settings.audit.log} --policy candidate.tar.gz"
        )
        status, page = await _upload(browser, withdrawn, records="3")
        # the newest three records: two releases and the failed reload
        assert tables(page)["summary"][0][:3] == ["2", "0", "2"]

        # never made live: the broker still releases, under the policy it had
        async with broker.client() as client:
            released = await client.release(KEY, broker.token_source())
        assert released.key == KEY
        status, _, page = await browser.get("/console/policy")
        assert f'id="in-force">{in_force.group(1)}<' in page
        assert [row[2] for row in tables(page)["history"]] == [
            "policy_reload_failed",
            "policy_change",
        ]
        replayed = await asyncio.to_thread(
            run, "policy", "replay", "--log", str(broker.settings.audit.log),
            "--policy", str(bundle),
        )  # fmt: skip
        summary_line = json.loads(replayed.stdout.splitlines()[-1])["summary"]
        assert summary_line["allow_to_deny"] == 4  # the three compared, and the one since

        # a policy record written after the history was first read joins it
        broken.write_text("package broker.release\nthis is not rego either\n")
        async with session.post(
            broker.url + "/v1/admin/policy/reload",
            headers={"Authorization": f"Bearer {KEY_ADMIN_TOKEN}"},
            ssl=broker.client_tls,
        ) as response:
            assert response.status == 409
        status, _, page = await browser.get("/console/policy")
        history = tables(page)["history"]
        assert [row[2] for row in history] == [
            "policy_reload_failed",
            "policy_reload_failed",
            "policy_change",
        ]
        assert int(history[0][0]) == len(broker.records()) - 1


def _printed(page: str) -> list[str]:
    found = re.search(r'<pre id="replay-output"><code>(.*?)</code></pre>', page, re.DOTALL)
    assert found is not None
    return html.unescape(found.group(1)).splitlines()


async def test_a_bad_candidate_is_refused_in_the_page(start_broker: Callable[..., Any]) -> None:
    broker = await console_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        status, page = await _upload(browser, b"not a bundle")
        assert status == 400
        assert 'id="compare-problem"' in page
        assert "the uploaded candidate" in page
        status, page = await _upload(browser, b"x" * (MAX_CANDIDATE_BYTES + 1))
        assert status == 413
        assert f"bundle is larger than {MAX_CANDIDATE_BYTES} bytes" in page
        widening = opa_bundle.pack(
            await asyncio.to_thread(opa_built, SHIPPED, {"broker/widen.rego": WIDENING_MODULE})
        )  # held to the structure rules as a reload would be
        status, page = await _upload(browser, widening)
        assert status == 400
        assert "the uploaded candidate" in page
        assert 'id="comparison"' not in page
        status, body = await _upload(browser, b"not a bundle", origin="https://evil.example")
        assert status == 403
        assert '"origin_refused"' in body
        browser.cookie = None
        status, _ = await _upload(browser, b"not a bundle")
        assert status == 303  # no session: to the log-in page


async def test_a_signed_candidate_is_verified_with_the_brokers_bundle_key(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    """On a broker that loads signed bundles, a signed candidate is checked with its key (one
    signed by another key is refused); an unsigned one is compared and said unverified."""

    def signed_policy(workdir: Path) -> None:
        signing_keys(workdir)
        build(workdir, "v1", allowed=True)

    broker = await console_broker(
        start_broker,
        workdir_setup=signed_policy,
        environ={
            "BROKER_POLICY_BUNDLE": "bundle-v1.tar.gz",
            "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": "verify.pem",
            "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
        },
    )
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    withdrawn, digest = await asyncio.to_thread(build, broker.workdir, "v2", allowed=False)
    other = tmp_path / "other"
    other.mkdir()
    await asyncio.to_thread(signing_keys, other)
    shutil.copytree(broker.workdir / "policies", other / "policies")
    forged, _ = await asyncio.to_thread(build, other, "v2", allowed=False)
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        status, page = await _upload(browser, withdrawn)
        assert status == 200, page
        assert f'id="candidate-digest">{digest}<' in page
        assert "(revision v2), signature verified" in " ".join(page.split())
        assert tables(page)["summary"][0][:3] == ["1", "0", "1"]
        assert "--verification-key KEY.pem --scope SCOPE" in page
        status, page = await _upload(browser, forged)
        assert status == 400
        assert "the uploaded candidate: bundle signature does not verify" in page
        assert 'id="comparison"' not in page
        unsigned = dict(opa_bundle.unpack(withdrawn, source="t"))
        del unsigned[opa_bundle.SIGNATURES]
        status, page = await _upload(browser, opa_bundle.pack(unsigned))
        assert status == 200, page
        assert f'id="candidate-digest">{digest}<' in page  # a signature is not policy
        assert "not verified" in " ".join(page.split())


CONFLICT_MODULE = f"""package broker.key_policies.conflict

import rego.v1

applies_to := [{json.dumps(KEY)}]

level := 1 if input.request.key
level := 2 if input.request.key

deny contains "never" if level == 3
"""


async def test_a_candidate_that_fails_at_run_time_is_its_problem_said_in_the_page(
    start_broker: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Two values for one complete rule: the candidate compiles, then stops on the first
    decision it re-decides. A 400 naming the record and OPA's message, logged at INFO as the
    candidate's problem — not ``policy_unavailable``, not an ERROR of the broker's policy."""
    broker = await console_broker(start_broker)
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    (first,) = [r["index"] for r in broker.records() if r["type"] == "release"]
    conflicting = opa_bundle.pack(
        await asyncio.to_thread(opa_built, SHIPPED, {"broker/conflict.rego": CONFLICT_MODULE})
    )
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            status, page = await _upload(browser, conflicting)
    assert status == 400, page
    problem = re.search(r'id="compare-problem">([^<]+)<', page)
    assert problem is not None
    assert html.unescape(problem.group(1)) == (
        f"the candidate failed on record {first}: "
        "policy/broker/conflict.rego:8:1: var assignment conflict"
    )
    assert 'id="comparison"' not in page
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    (said,) = [r for r in caplog.records if r.name == "broker.console.policy"]
    assert said.levelno == logging.INFO
    assert f"failed on record {first}" in said.getMessage()


async def test_a_comparison_stops_at_its_deadline_and_says_where(
    start_broker: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy, "COMPARE_SECONDS", 0.0)  # past after the first record
    broker = await console_broker(start_broker)
    async with broker.client() as client:
        for _ in range(3):
            await client.release(KEY, broker.token_source())
    first = next(r["index"] for r in broker.records() if r["type"] == "release")
    same = await asyncio.to_thread(
        candidate_bundle, broker.workdir / "policies", tmp_path, withdraw=None
    )
    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        status, page = await _upload(browser, same)
    assert status == 200, page
    stopped = re.search(r'id="compare-stopped">([^<]+)<', page)
    assert stopped is not None
    assert " ".join(stopped.group(1).split()).startswith(
        f"Stopped after 1 decision records (through record {first}): a comparison runs at most 0 s"
    )
    assert tables(page)["summary"][0][:2] == ["1", "1"]  # the one record compared


async def test_an_upload_still_arriving_holds_no_other_comparison_up(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    """The form is read before the comparison lock is taken: while one auditor's upload is
    half sent, another's candidate is compared (not ``429``)."""
    broker = await console_broker(start_broker)
    same = await asyncio.to_thread(
        candidate_bundle, broker.workdir / "policies", tmp_path, withdraw=None
    )
    boundary = "slowupload"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="bundle"; filename="c.tar.gz"\r\n'
        "Content-Type: application/gzip\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    arrived = asyncio.Event()

    async def slowly() -> AsyncIterator[bytes]:
        yield head + same[:100]
        await arrived.wait()  # the rest only once the other comparison is answered
        yield same[100:] + tail

    async with aiohttp.ClientSession() as session:
        browser = Browser(broker, session)
        await browser.login()
        slow = asyncio.create_task(
            session.post(
                broker.url + "/console/policy/compare",
                data=slowly(),
                headers={
                    **browser.headers(),
                    "Content-Type": f"multipart/form-data; boundary={boundary}",
                },
                ssl=broker.client_tls,
                allow_redirects=False,
            )
        )
        await asyncio.sleep(0.3)  # its head is in: the server reads its form
        status, page = await _upload(browser, same)
        arrived.set()
        async with await slow as response:
            late = response.status, await response.text()
    assert status == 200, page
    assert late[0] == 200, late[1]
