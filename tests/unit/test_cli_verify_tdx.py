"""``broker verify tdx QUOTE --collateral FILE`` (issue 33), in process, and the ``[tdx]``
configuration section."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from broker.config import load_settings
from broker.core.errors import ConfigError
from tests.support.cli import run
from tests.support.tdx_samples import TDX_FIXTURES

QUOTE = str(TDX_FIXTURES / "tdx_quote")
COLLATERAL = str(TDX_FIXTURES / "tdx_quote_collateral.json")


def test_verify_tdx_prints_the_policy_input_fragment() -> None:
    ran = run("verify", "tdx", QUOTE, "--collateral", COLLATERAL, "--at", "2025-07-01T00:00:00Z")
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["kind"] == "tdx"
    assert report["tee"]["tcb_status"] == "UpToDate"
    assert report["report_data"] == report["tee"]["measurements"]["report_data"]
    assert report["skipped"] == ["report data binding"]


@pytest.mark.parametrize("form", ["hex", "evidence"])
def test_verify_tdx_reads_hex_and_the_guest_evidence_object(tmp_path: Path, form: str) -> None:
    raw = Path(QUOTE).read_bytes()
    path = tmp_path / "quote"
    if form == "hex":
        path.write_text(raw.hex() + "\n")
    else:
        path.write_text(json.dumps({"quote": base64.b64encode(raw).decode(), "cc_eventlog": None}))
    ran = run(
        "verify", "tdx", str(path), "--collateral", COLLATERAL, "--at", "2025-07-01T00:00:00Z"
    )
    assert ran.returncode == 0, ran.stdout


def test_verify_tdx_past_next_update_exits_1_with_the_code() -> None:
    ran = run("verify", "tdx", QUOTE, "--collateral", COLLATERAL, "--at", "2025-08-01T00:00:00Z")
    assert ran.returncode == 1
    assert json.loads(ran.stdout)["error"]["code"] == "tdx_collateral_expired"


def test_verify_tdx_without_collateral_is_a_usage_error() -> None:
    ran = run("verify", "tdx", QUOTE)
    assert ran.returncode == 2
    assert "--collateral" in ran.stderr


CONFIG = """
[server]
listen = "127.0.0.1:8443"
audience = "https://broker.example"
tls_cert = "x.pem"
tls_key = "x.pem"

[[issuers]]
kind = "gca"
issuer = "https://confidentialcomputing.googleapis.com"
jwks_file = "x.pem"

[policy]
dir = "."

[audit]
log = "decisions.log"
"""


def test_tdx_section_reads_and_checks_its_fields(tmp_path: Path) -> None:
    (tmp_path / "x.pem").write_text("x")
    (tmp_path / "collateral").mkdir()
    path = tmp_path / "broker.toml"
    path.write_text(CONFIG)
    assert not load_settings(path, environ={}).tdx.enabled
    assert load_settings(path, environ={}).tdx.root_certificate.is_file()  # the shipped root
    path.write_text(CONFIG + '[tdx]\ncollateral_dir = "collateral"\nrefresh_seconds = 60\n')
    tdx = load_settings(path, environ={}).tdx
    assert (tdx.enabled, tdx.collateral_dir, tdx.refresh_seconds) == (
        True,
        tmp_path / "collateral",
        60,
    )
    for bad, key in (
        ('pccs_url = "http://pccs.example"', "tdx.pccs_url"),
        ('collateral_dir = "missing"', "tdx.collateral_dir"),
        ('root_certificate = "missing.pem"', "tdx.root_certificate"),
        ("refresh_seconds = 0", "tdx"),
    ):
        path.write_text(CONFIG + f"[tdx]\n{bad}\n")
        with pytest.raises(ConfigError) as caught:
            load_settings(path, environ={})
        assert caught.value.key == key
