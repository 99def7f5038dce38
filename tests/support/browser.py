"""Debian's Chromium, headless, driven by Selenium through Debian's chromedriver (``make test``
installs both; nothing is downloaded: Selenium Manager is never asked, both paths are given).

The browser trusts only the test broker's certificate (by its key's SHA-256,
``--ignore-certificate-errors-spki-list``), reaches nothing but loopback (every other address
goes to a proxy on a closed loopback port, and Chromium's own background traffic is off), and
keeps its console log for the test to read.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_SECONDS = 15
QUIET = (  # no traffic of Chromium's own (updates, safe browsing, metrics, hints)
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-client-side-phishing-detection",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--disable-sync",
    "--no-pings",
    "--no-first-run",
    "--metrics-recording-only",
    "--disable-features=OptimizationHints,MediaRouter,Translate,AutofillServerCommunication",
)


def spki_sha256(certificate_pem: bytes) -> str:
    """The base64 SHA-256 of a certificate's SubjectPublicKeyInfo (Chromium's pin form)."""
    spki = (
        x509.load_pem_x509_certificate(certificate_pem)
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@contextlib.contextmanager
def headless_chromium(server_certificate: Path) -> Iterator[webdriver.Chrome]:
    """A headless Chromium that trusts ``server_certificate``'s key and reaches only loopback."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    with tempfile.TemporaryDirectory(prefix="console-chromium-") as profile:
        for argument in (
            "--headless=new",
            "--no-sandbox",  # root in CI; the page is our own
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1280,900",
            f"--user-data-dir={profile}",  # the SPKI list is honoured only with a profile dir
            f"--ignore-certificate-errors-spki-list={spki_sha256(server_certificate.read_bytes())}",
            "--proxy-server=http://127.0.0.1:9",  # anything not loopback goes nowhere
            *QUIET,
        ):
            options.add_argument(argument)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def wait_for(driver: webdriver.Chrome, script: str, *args: Any) -> Any:
    """The first truthy value of ``script`` (JavaScript returning a value) within the wait."""
    return WebDriverWait(driver, WAIT_SECONDS, poll_frequency=0.1).until(
        lambda d: d.execute_script(script, *args)
    )


def resources(driver: webdriver.Chrome) -> list[str]:
    """Every URL the current page loaded or fetched (Resource Timing), and the page itself."""
    found: list[str] = driver.execute_script(
        "return [location.href, ...performance.getEntriesByType('resource').map(e => e.name)]"
    )
    return found


def console_errors(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    """The browser console's entries at level SEVERE since the last call (CSP violations,
    script errors, failed loads are all SEVERE)."""
    entries = driver.get_log("browser")  # type: ignore[no-untyped-call]  # selenium: untyped
    return [entry for entry in entries if entry.get("level") == "SEVERE"]
