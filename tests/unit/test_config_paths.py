"""Paths in a config file are relative to that file, wherever the broker is started from; an
empty ``BROKER_…`` variable counts as unset.

The findings: ``[keys] store = "sqlite:///dev/keys.db"`` was ``/dev/keys.db`` and
``kek = "local:dev/kek.key"`` relative to the working directory (``broker dev init ./dev``); an
exported but empty ``BROKER_SERVER_LISTEN=`` replaced the file's value with "".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.config import Settings, load_settings
from broker.core.errors import ConfigError
from broker.policy.build import default_freshness
from tests.unit.test_config import BASE

RELATIVE = BASE.replace('"sqlite:///tmp/keys.db"', '"sqlite:///state/keys.db"').replace(
    '"local:/tmp/kek.key"', '"local:state/kek.key"'
)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    directory = tmp_path / "etc"
    directory.mkdir()
    for name in ("cert.pem", "key.pem", "jwks.json"):
        (directory / name).write_text("x")
    (directory / "policies").mkdir()
    path = directory / "broker.toml"
    path.write_text(RELATIVE + '\n[nonces]\nstore = "sqlite:///state/nonces.db"\n')
    return path


def load_from(cwd: Path, config: Path, environ: dict[str, str] | None = None) -> Settings:
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        return load_settings(Path(os.path.relpath(config, cwd)), environ or {})
    finally:
        os.chdir(previous)


def test_key_store_and_kek_paths_are_relative_to_the_config_file_not_to_slash_or_cwd(
    config: Path, tmp_path: Path
) -> None:
    state = config.parent / "state"
    for cwd in (tmp_path, config.parent, Path("/")):
        settings = load_from(cwd, config)
        assert settings.keys.store == f"sqlite:///{state / 'keys.db'}"
        assert settings.keys.kek == f"local:{state / 'kek.key'}"
        assert settings.nonces.store == f"sqlite://{state / 'nonces.db'}"
        assert settings.audit.log == config.parent / "decisions.log"


def test_absolute_forms_stay_absolute(config: Path, tmp_path: Path) -> None:
    environ = {
        "BROKER_KEYS_STORE": f"sqlite:///{tmp_path / 'abs.db'}",  # four slashes: absolute
        "BROKER_KEYS_KEK": f"local:{tmp_path / 'abs.key'}",
        "BROKER_KEYS_KEK_PREVIOUS": "local:old.key,cloudkms:projects/p/locations/l/keyRings/r/"
        "cryptoKeys/k",
    }
    settings = load_from(tmp_path, config, environ)
    assert settings.keys.store == f"sqlite:///{tmp_path / 'abs.db'}"
    assert settings.keys.kek == f"local:{tmp_path / 'abs.key'}"
    assert settings.keys.kek_previous == (
        f"local:{config.parent / 'old.key'}",
        "cloudkms:projects/p/locations/l/keyRings/r/cryptoKeys/k",
    )


def test_a_relative_store_that_used_to_mean_an_existing_absolute_file_is_refused(
    config: Path, tmp_path: Path
) -> None:
    """An older broker read ``sqlite:///PATH`` as ``/PATH``: silently opening a new, empty store
    beside the config instead would lose every key; the error says how to write it."""
    existing = tmp_path / "old-keys.db"
    existing.write_bytes(b"")
    legacy = "sqlite://" + str(existing)  # sqlite:///tmp/…: an older broker's absolute path
    with pytest.raises(ConfigError, match="four slashes") as caught:
        load_from(tmp_path, config, {"BROKER_KEYS_STORE": legacy})
    assert caught.value.key == "keys.store"
    assert f'"sqlite:///{existing}"' in caught.value.message


def test_an_empty_environment_variable_counts_as_unset(config: Path, tmp_path: Path) -> None:
    environ = {"BROKER_SERVER_LISTEN": "", "BROKER_KEYS_STORE": "", "BROKER_AUDIT_LOG": ""}
    settings = load_from(tmp_path, config, environ)
    assert settings.server.listen == "127.0.0.1:8443"
    assert settings.keys.store == f"sqlite:///{config.parent / 'state' / 'keys.db'}"
    assert settings.audit.log == config.parent / "decisions.log"
    set_one = load_from(tmp_path, config, {"BROKER_SERVER_LISTEN": "127.0.0.1:9443"})
    assert set_one.server.listen == "127.0.0.1:9443"


def test_an_empty_source_date_epoch_counts_as_unset() -> None:
    """``SOURCE_DATE_EPOCH=`` (exported empty by some CI templates) used to fail `policy build`."""
    assert default_freshness({"SOURCE_DATE_EPOCH": ""}, 1000.0).version == 1000
    assert default_freshness({"SOURCE_DATE_EPOCH": "77"}, 1000.0).version == 77
