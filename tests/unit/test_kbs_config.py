"""``[kbs]`` is checked when the configuration loads (issue 33): off by default; on, it needs
``[attest]``; the development switch only on loopback; ``[kbs.resources]`` maps
``<repository>/<type>/<tag>`` to a key (and version) and is read from the file only."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import Settings
from tests.unit.test_config import BASE, error_key, load

ATTEST = '[attest]\nenabled = true\nsigning_key = "ear.pem"\n'
KBS = "[kbs]\nenabled = true\n"
RESOURCES = (
    '[kbs.resources]\n"default/llama/dek" = "models/llama"\n"default/llama/v3" = "models/llama@3"\n'
)


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    for name in ("cert.pem", "key.pem", "jwks.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "policies").mkdir()
    return tmp_path


def _load(directory: Path, text: str, environ: dict[str, str] | None = None) -> Settings:
    settings = load(directory, text, environ)
    assert isinstance(settings, Settings)
    return settings


def test_the_facade_is_off_by_default_and_refuses_sample_evidence(config_dir: Path) -> None:
    kbs = _load(config_dir, BASE).kbs
    assert (kbs.enabled, kbs.allow_sample_evidence, kbs.deny_status) == (False, False, 403)
    assert kbs.resources == ()
    assert (kbs.auth_rate_per_ip, kbs.auth_rate_burst) == (10.0, 20)  # handshakes per address


def test_resources_map_paths_to_keys_and_versions(config_dir: Path) -> None:
    kbs = _load(config_dir, BASE + ATTEST + KBS + RESOURCES).kbs
    assert kbs.resources == (
        ("default/llama/dek", "models/llama", None),
        ("default/llama/v3", "models/llama", 3),
    )


@pytest.mark.parametrize(
    ("text", "environ", "key"),
    [
        (BASE + KBS, {}, "kbs.enabled"),  # no [attest]: no tokens
        (
            BASE + ATTEST + KBS + "allow_sample_evidence = true\n",
            {"BROKER_SERVER_LISTEN": "0.0.0.0:8443"},
            "kbs.allow_sample_evidence",
        ),
        (BASE + ATTEST + KBS + "deny_status = 500\n", {}, "kbs.deny_status"),
        (BASE + ATTEST + KBS + "token_ttl_seconds = 901\n", {}, "kbs.token_ttl_seconds"),
        (BASE + ATTEST + KBS + "session_ttl_seconds = 1\n", {}, "kbs.session_ttl_seconds"),
        (BASE + ATTEST + KBS + '[kbs.resources]\n"a/b" = "models/x"\n', {}, "kbs.resources.a/b"),
        (
            BASE + ATTEST + KBS + '[kbs.resources]\n"a/b/../c" = "models/x"\n',
            {},
            "kbs.resources.a/b/../c",
        ),
        (
            BASE + ATTEST + KBS + '[kbs.resources]\n"a/b/c" = "Models/X"\n',
            {},
            "kbs.resources.a/b/c",
        ),
        (
            BASE + ATTEST + KBS + '[kbs.resources]\n"a/b/c" = "models/x@0"\n',
            {},
            "kbs.resources.a/b/c",
        ),
        (BASE + ATTEST + KBS + '[kbs.resources]\n"a/b/c" = 3\n', {}, "kbs.resources.a/b/c"),
        (BASE + ATTEST + KBS, {"BROKER_KBS_RESOURCES": "a/b/c"}, "kbs.resources"),
        (BASE + ATTEST + KBS + "unknown = 1\n", {}, "kbs.unknown"),
        (BASE + ATTEST + KBS + "auth_rate_per_ip = -1\n", {}, "kbs.auth_rate_per_ip"),
        (BASE + ATTEST + KBS, {"BROKER_KBS_AUTH_RATE_BURST": "0"}, "kbs.auth_rate_burst"),
    ],
)
def test_a_bad_kbs_section_names_its_key(
    config_dir: Path, text: str, environ: dict[str, str], key: str
) -> None:
    assert error_key(config_dir, text, environ) == key


def test_the_development_switch_loads_on_loopback(config_dir: Path) -> None:
    kbs = _load(config_dir, BASE + ATTEST + KBS + "allow_sample_evidence = true\n").kbs
    assert kbs.allow_sample_evidence is True
