"""``[sealed]`` (the broker's self-attestation) and the development launcher's request checks.

The end-to-end behaviour runs against real processes in
tests/integration/test_broker_attestation.py; these are the pure parts.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from broker.api.self_attestation import BoundKeys, LauncherError, unverified_expiry
from broker.config import Settings, load_settings
from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import ConfigError
from broker.dev.launcher import request_problem

BASE = """
[server]
listen = "127.0.0.1:8443"
audience = "https://broker.example"
tls_cert = "cert.pem"
tls_key = "key.pem"

[[issuers]]
kind = "gca"
issuer = "https://confidentialcomputing.googleapis.com"
jwks_file = "jwks.json"

[policy]
dir = "policies"

[audit]
log = "decisions.log"
"""


def load(directory: Path, text: str) -> Settings:
    for name in ("cert.pem", "key.pem", "jwks.json"):
        (directory / name).write_text("x")
    (directory / "policies").mkdir(exist_ok=True)
    (directory / "broker.toml").write_text(text)
    return load_settings(directory / "broker.toml", environ={})


def test_sealed_is_off_by_default(tmp_path: Path) -> None:
    assert load(tmp_path, BASE).sealed.launcher_socket is None


def test_sealed_socket_relative_to_config_and_audience_defaults(tmp_path: Path) -> None:
    settings = load(
        tmp_path, BASE + '[sealed]\nlauncher_socket = "run/teeserver.sock"\nmake_keys = false\n'
    )
    assert settings.sealed.launcher_socket == (tmp_path / "run" / "teeserver.sock").resolve()
    assert settings.sealed.token_audience == "https://broker.example"


def test_sealed_broker_over_plain_http_refused(tmp_path: Path) -> None:
    text = BASE.replace('tls_key = "key.pem"', 'tls_key = "key.pem"\ninsecure_http = true')
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text + '[sealed]\nlauncher_socket = "/run/x.sock"\n')
    assert caught.value.key == "sealed.launcher_socket"


def test_unknown_sealed_key_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, BASE + '[sealed]\nlauncher = "/run/x.sock"\n')
    assert caught.value.key == "sealed.launcher"


def test_nonces_are_hex_sha256_of_each_spki() -> None:
    keys = BoundKeys({"tls": b"tls-spki", "statement": b"statement-spki"})
    assert keys.nonces() == [
        hashlib.sha256(b"tls-spki").hexdigest(),
        hashlib.sha256(b"statement-spki").hexdigest(),
    ]
    assert {k: b64url_decode(v) for k, v in keys.published().items()} == keys.spki


def test_token_without_exp_refused() -> None:
    header = b64url_encode(json.dumps({"alg": "RS256"}).encode())
    with pytest.raises(LauncherError):
        unverified_expiry(f"{header}.{b64url_encode(b'{}')}.sig")
    claims = b64url_encode(json.dumps({"exp": 1_800_000_000}).encode())
    assert unverified_expiry(f"{header}.{claims}.sig") == datetime.fromtimestamp(1_800_000_000, UTC)


@pytest.mark.parametrize(
    ("audience", "kind", "nonces"),
    [
        ("", "OIDC", []),  # no audience
        ("https://a", "PKI", []),  # the development launcher mints OIDC only
        ("https://a", "OIDC", ["short"]),  # under 8 bytes
        ("https://a", "OIDC", ["x" * 89]),  # over 88 bytes
        ("https://a", "OIDC", ["0" * 64] * 7),  # too many
    ],
)
def test_dev_launcher_refuses_what_the_launcher_refuses(
    audience: str, kind: str, nonces: list[str]
) -> None:
    assert request_problem(audience, kind, nonces) is not None
    assert request_problem("https://a", "OIDC", ["0" * 64] * 4) is None
