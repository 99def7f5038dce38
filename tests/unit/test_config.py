from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import load_settings
from broker.core.errors import ConfigError

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

[keys]
store = "sqlite:///tmp/keys.db"
kek = "local:/tmp/kek.key"

[audit]
log = "decisions.log"
"""


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    for name in ("cert.pem", "key.pem", "jwks.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "policies").mkdir()
    return tmp_path


def load(directory: Path, text: str, environ: dict[str, str] | None = None) -> object:
    path = directory / "broker.toml"
    path.write_text(text)
    return load_settings(path, environ=environ or {})


def error_key(directory: Path, text: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load(directory, text, environ)
    return caught.value.key


def test_valid_config_resolves_paths_against_its_directory(config_dir: Path) -> None:
    settings = load(config_dir, BASE)
    assert settings.server.tls_cert == config_dir / "cert.pem"  # type: ignore[attr-defined]
    assert settings.audit.log == config_dir / "decisions.log"  # type: ignore[attr-defined]
    assert settings.server.nonce_ttl_seconds == 120  # type: ignore[attr-defined]


def test_environment_overrides_file(config_dir: Path) -> None:
    settings = load(
        config_dir,
        BASE,
        {"BROKER_SERVER_LISTEN": "127.0.0.1:9000", "BROKER_SERVER_NONCE_TTL_SECONDS": "30"},
    )
    assert settings.server.port == 9000  # type: ignore[attr-defined]
    assert settings.server.nonce_ttl_seconds == 30  # type: ignore[attr-defined]


def test_bad_environment_value_names_the_key(config_dir: Path) -> None:
    key = error_key(config_dir, BASE, {"BROKER_SERVER_MAX_BODY_BYTES": "lots"})
    assert key == "server.max_body_bytes"


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('listen = "127.0.0.1:8443"', 'listen = "nonsense"', "server.listen"),
        ('audience = "https://broker.example"', 'audience = ""', "server.audience"),
        ('tls_cert = "cert.pem"', 'tls_cert = "missing.pem"', "server.tls_cert"),
        ('kind = "gca"', 'kind = "tpm"', "issuers[0].kind"),
        ('jwks_file = "jwks.json"', 'jwks_url = "http://keys.example/jwks"', "issuers[0].jwks_url"),
        (
            'jwks_file = "jwks.json"',
            'jwks_file = "jwks.json"\nalgorithms = ["HS256"]',
            "issuers[0].algorithms",
        ),
        ('jwks_file = "jwks.json"', 'jwks_file = "jwks.json"\ncolour = "red"', "issuers[0].colour"),
        ('store = "sqlite:///tmp/keys.db"', 'store = "mongodb://x"', "keys.store"),
        ('dir = "policies"', 'dir = "nowhere"', "policy.dir"),
    ],
)
def test_bad_values_name_the_key(config_dir: Path, old: str, new: str, key: str) -> None:
    assert old in BASE
    assert error_key(config_dir, BASE.replace(old, new)) == key


def test_tls_required_by_default(config_dir: Path) -> None:
    text = BASE.replace('tls_cert = "cert.pem"\n', "")
    assert error_key(config_dir, text) == "server.tls_cert"


def test_insecure_http_refused_off_loopback(config_dir: Path) -> None:
    text = BASE.replace(
        'listen = "127.0.0.1:8443"', 'listen = "0.0.0.0:8080"\ninsecure_http = true'
    )
    assert error_key(config_dir, text) == "server.insecure_http"


def test_insecure_http_allowed_on_loopback(config_dir: Path) -> None:
    text = BASE.replace('tls_cert = "cert.pem"\ntls_key = "key.pem"', "insecure_http = true")
    assert load(config_dir, text).server.insecure_http is True  # type: ignore[attr-defined]


def test_no_issuers_refused(config_dir: Path) -> None:
    text = BASE.split("[[issuers]]", maxsplit=1)[0] + "[policy]" + BASE.split("[policy]")[1]
    assert error_key(config_dir, text) == "issuers"


def test_dpop_public_urls_default_to_the_audience_and_refuse_what_is_not_a_base_url(
    config_dir: Path,
) -> None:
    """``[server] public_urls``: what a DPoP proof's htu may name (never the request's Host)."""
    settings = load(config_dir, BASE)
    assert settings.server.public_base_urls == ("https://broker.example",)  # type: ignore[attr-defined]
    listed = BASE.replace(
        'audience = "https://broker.example"',
        'audience = "https://broker.example"\n'
        'public_urls = ["https://broker.example", "https://keys.example/broker"]',
    )
    settings = load(config_dir, listed)
    assert settings.server.public_base_urls == (  # type: ignore[attr-defined]
        "https://broker.example",
        "https://keys.example/broker",
    )
    environ = {"BROKER_SERVER_PUBLIC_URLS": "https://a.example,https://b.example:8443"}
    settings = load(config_dir, BASE, environ)
    assert settings.server.public_base_urls == (  # type: ignore[attr-defined]
        "https://a.example",
        "https://b.example:8443",
    )
    for bad in (
        "http://broker.example",  # plain HTTP off loopback
        "https://broker.example:99999",
        "https://u@broker.example",
        "https://broker.example/?q=1",
        "/v1/release",
    ):
        environ = {"BROKER_SERVER_PUBLIC_URLS": bad}
        assert error_key(config_dir, BASE, environ) == "server.public_urls", bad


def test_signed_bundles_need_a_scope_naming_the_environment(config_dir: Path) -> None:
    """An empty scope accepts a bundle signed for any environment (or none): refused at start.
    ``bundle_ca`` is a path relative to the config file, for an https bundle server only."""
    for name in ("b.tar.gz", "v.pem", "ca.pem"):
        (config_dir / name).write_text("x")
    signed = BASE.replace(
        'dir = "policies"', 'bundle = "b.tar.gz"\nbundle_verification_key = "v.pem"'
    )
    assert error_key(config_dir, signed) == "policy.bundle_verification_scope"
    settings = load(
        config_dir, signed.replace('"v.pem"', '"v.pem"\nbundle_verification_scope = "prod"')
    )
    assert settings.policy.bundle_verification_scope == "prod"  # type: ignore[attr-defined]
    unsigned = BASE.replace('dir = "policies"', 'bundle_ca = "ca.pem"')
    assert error_key(config_dir, unsigned) == "policy.bundle_ca"  # no https bundle_url
    with_url = load(
        config_dir, unsigned, {"BROKER_POLICY_BUNDLE_URL": "https://bundles.example/p.tar.gz"}
    )
    assert with_url.policy.bundle_ca == config_dir / "ca.pem"  # type: ignore[attr-defined]


def test_snp_section_defaults_paths_and_checks(config_dir: Path) -> None:
    assert load(config_dir, BASE).snp.kds_url is None  # type: ignore[attr-defined]
    (config_dir / "snp-certs").mkdir()
    (config_dir / "arks.pem").write_text("x")
    snp = load(  # type: ignore[attr-defined]
        config_dir,
        BASE + '[snp]\nkds_url = "https://kdsintf.amd.com"\ncerts_dir = "snp-certs"\n'
        'roots = "arks.pem"\nmax_vmpl = 1\n',
    ).snp
    assert (snp.certs_dir, snp.roots, snp.max_vmpl) == (
        config_dir / "snp-certs",
        config_dir / "arks.pem",
        1,
    )
    for bad, key in (
        ('kds_url = "http://kds.example"', "snp.kds_url"),
        ('certs_dir = "missing"', "snp.certs_dir"),
        ('roots = "missing.pem"', "snp.roots"),
        ("max_vmpl = 4", "snp.max_vmpl"),
        ("kds_timeout_seconds = 0", "snp.kds_timeout_seconds"),
        ("kds = 1", "snp.kds"),
    ):
        assert error_key(config_dir, BASE + f"[snp]\n{bad}\n") == key
    env = {"BROKER_SNP_KDS_URL": "http://127.0.0.1:8080"}  # loopback http: a test KDS
    assert load(config_dir, BASE, env).snp.kds_url == "http://127.0.0.1:8080"  # type: ignore[attr-defined]
