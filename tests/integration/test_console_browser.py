"""The auditor console in a real browser (issue 34, item 4): Debian's headless Chromium against a
live broker with records of several types. It logs in, pins the log key, sees the checkpoint
verified in the page (Ed25519 and SHA-256 in WebCrypto) and, after new records, a consistency
proof verified; a checkpoint whose signature has one byte flipped, and an older genuine one (a
shrunk tree), are shown as FAILED and leave this browser's state alone; a record's inclusion
proof verifies in the page; a deny reason holding ``<script>`` is shown as text; the timeline
draws; a candidate policy uploaded from a file input is compared; it logs out. No page loads
anything from another origin, and the console log has no error (a CSP violation would be one)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from broker.client import BrokerClientError
from broker.crypto.checkpoint import NoteSigner
from tests.integration.conftest import RunningBroker
from tests.integration.console import (
    AUDITOR_TOKEN,
    KEY_ADMIN_TOKEN,
    OTHER_IMAGE,
    XSS_REASON,
    candidate_bundle,
    console_broker,
    with_xss_reason,
)
from tests.integration.watch import log_key, monitor
from tests.support.browser import (
    CHROMEDRIVER,
    CHROMIUM,
    console_errors,
    headless_chromium,
    resources,
    wait_for,
)
from tests.support.constants import ALLOWED, KEY

SHOTS = os.environ.get("CONSOLE_SCREENSHOTS", "")
WATCH_RULES = f"""
[[rule]]
name = "llama only to the other image"
kind = "key_images"
key = "{KEY}"
images = ["{OTHER_IMAGE}"]
"""
VERDICT = """const v = document.querySelector('tr.log .verdict');
return v && /^(verified|FAILED)/.test(v.textContent) ? v.textContent : null;"""
PROOF = """const p = document.getElementById('proof');
return p && /^(verified|FAILED|not yet)/.test(p.textContent) ? p.textContent : null;"""
UNPINNED = """const v = document.querySelector('tr.log .verdict');
return v && v.textContent.startsWith('not pinned') ? v.textContent : null;"""
GREW = """return fetch('/v1/log/checkpoint').then((r) => r.text())
  .then((note) => Number(note.split('\\n')[1]) > arguments[0]);"""
# Injected before any page script (DevTools), in place of a tampering server: the page's own
# fetch of a checkpoint returns what TAMPER makes of it.
INTERCEPT = """(() => {
  const original = window.fetch;
  const tamper = TAMPER;
  window.fetch = async (input, init) => {
    const response = await original(input, init);
    const url = typeof input === "string" ? input : input.url;
    if (!url.includes("/v1/log/checkpoint")) return response;
    return new Response(tamper(await response.text()), {status: 200});
  };
})();"""
FLIP_A_SIGNATURE_BYTE = """(note) => {
  const lines = note.split("\\n");
  const i = lines.findIndex((l) => l.startsWith("\\u2014 "));
  const [dash, name, blob] = lines[i].split(" ");
  const raw = Uint8Array.from(atob(blob), (c) => c.charCodeAt(0));
  raw[20] ^= 0x01;
  lines[i] = `${dash} ${name} ${btoa(String.fromCharCode(...raw))}`;
  return lines.join("\\n");
}"""
ADD_A_WITNESS_LINE = (
    """(note) => `${note}\\u2014 witness.example/w1 ${btoa("\\x00".repeat(68))}\\n`"""
)
PIN_PROBLEM = """const p = document.getElementById('pin-problem');
return p && p.textContent ? p.textContent : null;"""


async def _records(broker: RunningBroker) -> None:
    """A release allowed, one denied (its reason holds a script), a key created, a policy
    reload refused; the start-up's policy_change is already there."""
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
        with pytest.raises(BrokerClientError):
            await client.release(KEY, broker.token_source(digest=OTHER_IMAGE))
    broken = broker.workdir / "policies" / "broker" / "broken.rego"
    broken.write_text("package broker.release\nthis is not rego\n")
    async with aiohttp.ClientSession() as session:
        for path, body, expected in (
            ("/v1/admin/keys", {"name": "models/console-extra", "purpose": "model-weights"}, 201),
            ("/v1/admin/policy/reload", None, 409),
        ):
            async with session.post(
                broker.url + path,
                json=body,
                headers={"Authorization": f"Bearer {KEY_ADMIN_TOKEN}"},
                ssl=broker.client_tls,
            ) as response:
                assert response.status == expected, await response.text()
    broken.unlink()


async def _one_more_release(broker: RunningBroker) -> None:
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())


def _intercept(driver: WebDriver, tamper: str) -> str:
    added = driver.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument",
        {"source": INTERCEPT.replace("TAMPER", tamper)},
    )
    return str(added["identifier"])


def _stop_intercepting(driver: WebDriver, identifier: str) -> None:
    driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": identifier})


def _shot(driver: WebDriver, name: str) -> None:
    """With ``CONSOLE_SCREENSHOTS=DIR``, the page as shown, as DIR/NAME.png (docs/console.md's
    screenshots are taken so: ``CONSOLE_SCREENSHOTS=docs/img/console pytest`` this file)."""
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(Path(SHOTS) / f"{name}.png"))


def _browse(
    broker: RunningBroker,
    run: Callable[[Coroutine[Any, Any, None]], None],
    key: str,
    old: str,
    candidate: Path,
) -> None:
    """The auditor's visit (blocking: a thread). ``old``: an earlier genuine checkpoint;
    ``candidate``: a bundle that withdraws the key's image, to compare."""
    seen: list[str] = []
    origin = broker.settings.audit.origin
    another_key = NoteSigner(origin, Ed25519PrivateKey.generate()).verifier_key()
    with headless_chromium(broker.workdir / "tls" / "server.pem") as driver:
        driver.get(broker.url + "/console/")
        assert driver.current_url == broker.url + "/console/login"
        _shot(driver, "login")
        driver.find_element(By.ID, "token").send_keys(AUDITOR_TOKEN)
        driver.find_element(By.ID, "login").click()
        wait_for(driver, "return location.pathname === '/console/'")
        assert wait_for(driver, UNPINNED).startswith("not pinned")
        driver.find_element(By.ID, "pin-key").send_keys(key)
        driver.find_element(By.ID, "pin").click()
        verdict = wait_for(driver, VERDICT)
        assert verdict.startswith("verified: signed by the pinned key; the first checkpoint"), (
            verdict
        )
        first_size = int(driver.find_element(By.CSS_SELECTOR, "tr.log .size").text)
        seen += resources(driver)

        run(_one_more_release(broker))  # the log grows: the next visit checks a proof
        wait_for(driver, GREW, first_size)
        driver.refresh()
        verdict = wait_for(driver, VERDICT)
        assert verdict.startswith(
            f"verified: signed by the pinned key; consistent with size {first_size}"
        ), verdict
        seen += resources(driver)
        _shot(driver, "health")

        flipped = _intercept(driver, FLIP_A_SIGNATURE_BYTE)
        driver.refresh()
        assert wait_for(driver, VERDICT) == "FAILED: the signature does not verify"
        _shot(driver, "health-failed")
        _stop_intercepting(driver, flipped)
        shrunk = _intercept(driver, f"() => {json.dumps(old)}")
        driver.refresh()
        verdict = wait_for(driver, VERDICT)
        assert verdict.startswith("FAILED: the log shrank"), verdict
        _stop_intercepting(driver, shrunk)
        driver.refresh()  # the failures left this browser's state as it was
        assert wait_for(driver, VERDICT).startswith(
            "verified: signed by the pinned key; consistent"
        )
        witnessed = _intercept(driver, ADD_A_WITNESS_LINE)  # a cosignature: named, not verified
        driver.refresh()
        assert wait_for(driver, VERDICT).startswith("verified: signed by the pinned key")
        signers = driver.find_element(By.CSS_SELECTOR, "tr.log .signers").text
        assert signers == f"{origin} (verified), witness.example/w1 (not verified)", signers
        _stop_intercepting(driver, witnessed)
        driver.find_element(By.ID, "pin-key").send_keys(another_key)  # same origin, other key
        driver.find_element(By.ID, "pin").click()
        problem = wait_for(driver, PIN_PROBLEM)
        assert problem.startswith(f"not pinned: another key is pinned for {origin}"), problem
        driver.refresh()  # the pin stayed
        assert wait_for(driver, VERDICT).startswith("verified: signed by the pinned key")

        driver.get(broker.url + "/console/denials")
        texts = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#reasons td.reason")]
        assert XSS_REASON in texts  # shown as text, not run
        assert driver.title != "pwned"
        assert not driver.find_elements(By.CSS_SELECTOR, "#results script")
        seen += resources(driver)
        _shot(driver, "denials")
        driver.find_element(By.CSS_SELECTOR, "#refusals a").click()
        proof = wait_for(driver, PROOF)
        assert proof.startswith("verified: record"), proof
        assert XSS_REASON in [e.text for e in driver.find_elements(By.CSS_SELECTOR, "li.reason")]
        seen += resources(driver)
        _shot(driver, "record")
        shrunk = _intercept(driver, f"() => {json.dumps(old)}")  # signed, but older than seen
        driver.refresh()
        proof = wait_for(driver, PROOF)
        assert proof.startswith("FAILED: the log shrank"), proof
        _stop_intercepting(driver, shrunk)

        driver.get(broker.url + f"/console/timeline?key={KEY}")
        assert int(wait_for(driver, "return document.getElementById('chart').dataset.points")) > 0
        assert driver.find_elements(By.CSS_SELECTOR, "#chart canvas")
        markers = {
            e.get_attribute("class")
            for e in driver.find_elements(By.CSS_SELECTOR, "#markers tbody tr")
        }
        assert {"marker-policy_change", "marker-policy_reload_failed"} <= markers
        seen += resources(driver)
        _shot(driver, "timeline")

        driver.get(broker.url + "/console/keys")
        rows = driver.find_elements(By.CSS_SELECTOR, "#key-versions tbody tr td:first-child")
        assert KEY in [e.text for e in rows]
        seen += resources(driver)
        _shot(driver, "keys")

        driver.get(broker.url + "/console/policy")  # a candidate compared, in the browser
        history = [
            e.text for e in driver.find_elements(By.CSS_SELECTOR, "#history td:nth-child(3)")
        ]
        assert history == ["policy_reload_failed", "policy_change"]
        driver.find_element(By.ID, "bundle").send_keys(str(candidate))
        driver.find_element(By.ID, "compare").click()
        wait_for(driver, "return document.getElementById('replay-output') !== null")
        assert int(driver.find_element(By.CSS_SELECTOR, "#summary .summary-allow_to_deny").text)
        seen += resources(driver)
        _shot(driver, "policy")

        driver.get(broker.url + "/console/watch")  # the monitor's hits, as it left them
        hits = driver.find_elements(By.CSS_SELECTOR, "#hits tbody td.detail")
        assert [e.text for e in hits] == [f"{KEY} released to image {ALLOWED}, not in the list"]
        seen += resources(driver)
        _shot(driver, "watch")

        driver.find_element(By.ID, "logout").click()
        wait_for(driver, "return location.pathname === '/console/login'")
        driver.get(broker.url + "/console/")
        assert driver.current_url == broker.url + "/console/login"
        assert console_errors(driver) == []
    assert len(seen) > 10  # pages, scripts, styles, checkpoints and proofs
    assert [url for url in seen if not url.startswith(broker.url + "/")] == []


async def test_the_console_verifies_in_a_real_browser(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    assert CHROMIUM.exists(), "install Debian's chromium (`make test` does)"
    assert CHROMEDRIVER.exists(), "install Debian's chromium-driver (`make test` does)"
    state = tmp_path / "monitor.json"  # the watch monitor's, shown on the Watch page
    broker = await console_broker(
        start_broker,
        workdir_setup=with_xss_reason,
        environ={"BROKER_AUDIT_WATCH_STATE": str(state)},
    )
    await _records(broker)
    history = broker.settings.audit.log.with_name(broker.settings.audit.log.name + ".checkpoints")
    for _ in range(100):  # a checkpoint covering the records (checkpoint_seconds = 0.2)
        notes = [json.loads(line) for line in history.read_text().splitlines()]
        if notes[-1]["size"] == len(broker.records()):
            break
        await asyncio.sleep(0.1)
    old = next(n["note"] for n in notes if n["size"] < notes[-1]["size"])  # genuine, smaller
    signer = await asyncio.to_thread(  # what `broker audit key` prints, pinned out of band
        NoteSigner.from_pem, broker.settings.audit.origin, broker.workdir / "log-ed25519.pem"
    )
    rules = tmp_path / "rules.toml"
    rules.write_text(WATCH_RULES)
    log = str(broker.settings.audit.log)
    code, _, report = await asyncio.to_thread(
        monitor, "--state", str(state), "--rules", str(rules), log, "--key", await log_key(broker)
    )
    assert code == 4, report  # the allowed release is a hit: its image is not in the list
    loop = asyncio.get_running_loop()

    def run(coroutine: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)

    candidate = tmp_path / "candidate.tar.gz"
    candidate.write_bytes(
        await asyncio.to_thread(
            candidate_bundle, broker.workdir / "policies", tmp_path, withdraw=KEY
        )
    )
    await asyncio.to_thread(_browse, broker, run, signer.verifier_key(), old, candidate)
