"""The development-issuer guards hold however a host name is spelled (issue 27, item 10).

Two guards: a broker trusts a development issuer (a ``*.invalid`` host) only while it listens
on loopback (``config.py``), and the development issuer itself mints only under a ``.invalid``
URL and never under Google's (``dev/issuer.py``). Both compared names as written, so a trailing
dot (``dev.invalid.``, the same fully qualified name) or another case slipped past.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import is_development_issuer, is_loopback, load_settings
from broker.core.errors import ConfigError
from broker.core.hostnames import normal_host
from broker.dev.issuer import DevIssuer, DevModeRequired

CONFIG = """
[server]
listen = "{listen}"
audience = "https://broker.example"
tls_cert = "cert.pem"
tls_key = "key.pem"

[[issuers]]
kind = "gca"
issuer = "{issuer}"
jwks_file = "jwks.json"

[policy]
dir = "policies"

[keys]
store = "sqlite:///tmp/keys.db"
kek = "local:/tmp/kek.key"

[audit]
log = "decisions.log"
"""


def load(tmp_path: Path, *, issuer: str, listen: str) -> None:
    for name in ("cert.pem", "key.pem", "jwks.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "policies").mkdir(exist_ok=True)
    path = tmp_path / "broker.toml"
    path.write_text(CONFIG.format(issuer=issuer, listen=listen))
    load_settings(path, environ={})


def refused_off_loopback(tmp_path: Path, issuer: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, issuer=issuer, listen="0.0.0.0:8443")
    assert caught.value.key == "issuers[0].issuer"
    assert "development issuer" in caught.value.message


TRAILING_DOT = [
    "https://dev-attestation.invalid./confidential-space",
    "https://dev-attestation.invalid.:443/confidential-space",
    "https://invalid./x",
]
OTHER_CASE = [
    "https://DEV-ATTESTATION.INVALID/confidential-space",
    "https://dev-attestation.Invalid./confidential-space",
    "https://dev-attestation\uff0e\uff49\uff4e\uff56\uff41\uff4c\uff49\uff44/x",  # full-width
    "https://dev-attestation\u3002invalid/x",  # ideographic full stop
    "https://dev-attestation%2EINVALID/x",  # percent-encoded, as URL parsers decode it
]


@pytest.mark.parametrize("issuer", TRAILING_DOT)
def test_dev_issuer_guard_trailing_dot_bypass_refused(tmp_path: Path, issuer: str) -> None:
    refused_off_loopback(tmp_path, issuer)
    with pytest.raises(DevModeRequired):  # and the dev issuer never mints as Google's
        DevIssuer(dev_mode=True, issuer="https://confidentialcomputing.googleapis.com./")


@pytest.mark.parametrize("issuer", OTHER_CASE)
def test_dev_issuer_guard_uppercase_bypass_refused(tmp_path: Path, issuer: str) -> None:
    refused_off_loopback(tmp_path, issuer)
    with pytest.raises(DevModeRequired):
        DevIssuer(dev_mode=True, issuer="https://ConfidentialComputing.GoogleAPIs.com")


@pytest.mark.parametrize(
    "issuer",
    ["https://example.com/x", "https://dev.invalid.example.com/", "https://invalidx.com/"],
)
def test_dev_issuer_refuses_to_mint_outside_the_invalid_domain(issuer: str) -> None:
    with pytest.raises(DevModeRequired):
        DevIssuer(dev_mode=True, issuer=issuer)


@pytest.mark.parametrize("issuer", ["https://dev-attestation.invalid./x", "https://X.INVALID"])
def test_development_issuer_in_any_spelling_still_serves_on_loopback(
    tmp_path: Path, issuer: str
) -> None:
    assert is_development_issuer(issuer)
    load(tmp_path, issuer=issuer, listen="127.0.0.1:8443")  # the guard still lets dev work
    DevIssuer(dev_mode=True, issuer=issuer)


def test_real_issuers_are_not_development_issuers() -> None:
    for issuer in (
        "https://confidentialcomputing.googleapis.com",
        "https://portal.trustauthority.intel.com",
        "https://nras.attestation.nvidia.com",
        "https://invalid.example.com",
    ):
        assert not is_development_issuer(issuer)
    assert is_development_issuer("https://[not-an-address/")  # unreadable: the cautious answer


@pytest.mark.parametrize(
    ("spelling", "loopback"),
    [
        ("localhost.", True),
        ("LOCALHOST", True),
        ("127.000.000.001", True),
        ("0x7f.1", True),
        ("[0:0::1]", True),
        ("127.0.0.1.evil.example", False),
        ("localhost.evil.example", False),
        ("0.0.0.0", False),
        ("1.2.3.4.5", False),
    ],
)
def test_loopback_is_judged_on_the_normal_spelling(spelling: str, loopback: bool) -> None:
    assert is_loopback(spelling) is loopback


def test_one_spelling_per_name() -> None:
    assert normal_host("Dev-Attestation.INVALID.") == "dev-attestation.invalid"
    assert normal_host("b\u00fccher.example") == normal_host("xn--bcher-kva.example")
    assert normal_host("2130706433") == "127.0.0.1"
    for unreadable in ("", ".", "a..b", "256.1.1.1", "08.1", "x" * 64 + ".example", "a%ffb"):
        with pytest.raises(ValueError, match="not"):
            normal_host(unreadable)
