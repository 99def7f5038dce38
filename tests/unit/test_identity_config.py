"""``[identity]`` is checked when the configuration loads (issue 32): off by default; on, it needs
``[attest]``, a SPIFFE trust domain, the CA's chain and key, and a sane lifetime. The CA's files
themselves are read at start-up (``signers/identity_ca.py``), also checked here."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from broker.config import Settings
from broker.core.errors import ConfigError
from broker.crypto.keyfiles import p256_private_key_file
from broker.dev.identity_ca import make_dev_identity_ca
from broker.signers.identity_ca import load_ca
from broker.signers.results import LocalResultSigner
from tests.unit.test_config import BASE, error_key, load

ATTEST = '[attest]\nenabled = true\nsigning_key = "ear.pem"\n'
IDENTITY = (
    '[identity]\nenabled = true\ntrust_domain = "runners.example"\n'
    'ca_certificates = "identity/ca-chain.pem"\nca_key = "identity/ca.key"\n'
)


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    for name in ("cert.pem", "key.pem", "jwks.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "policies").mkdir()
    return tmp_path


def _load(directory: Path, text: str) -> Settings:
    settings = load(directory, text)
    assert isinstance(settings, Settings)
    return settings


def test_identity_is_off_by_default(config_dir: Path) -> None:
    settings = _load(config_dir, BASE)
    assert settings.identity.enabled is False


def test_a_complete_identity_section_loads_with_paths_made_absolute(config_dir: Path) -> None:
    settings = _load(config_dir, BASE + ATTEST + IDENTITY)
    assert settings.identity.trust_domain == "runners.example"
    assert settings.identity.ca_certificates == str(config_dir / "identity" / "ca-chain.pem")
    assert settings.identity.ca_key == str(config_dir / "identity" / "ca.key")
    assert settings.identity.max_lifetime_seconds == 3600


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (BASE + IDENTITY, "identity.enabled"),  # no [attest]
        (
            BASE + ATTEST + IDENTITY.replace("runners.example", "Runners/Example"),
            "identity.trust_domain",
        ),
        (BASE + ATTEST + IDENTITY.replace("runners.example", ".example"), "identity.trust_domain"),
        (BASE + ATTEST + IDENTITY.replace('ca_key = "identity/ca.key"\n', ""), "identity.ca_key"),
        (
            BASE + ATTEST + IDENTITY.replace('ca_certificates = "identity/ca-chain.pem"\n', ""),
            "identity.ca_certificates",
        ),
        (BASE + ATTEST + IDENTITY + "max_lifetime_seconds = 10\n", "identity.max_lifetime_seconds"),
    ],
    ids=["no-attest", "bad-domain", "dot-domain", "no-key", "no-chain", "short-lifetime"],
)
def test_a_bad_identity_section_is_refused_at_load(config_dir: Path, text: str, key: str) -> None:
    assert error_key(config_dir, text) == key


def test_the_ca_key_must_be_the_first_certificates(tmp_path: Path) -> None:
    ca = make_dev_identity_ca(tmp_path, "runners.example", now=datetime.now(UTC))
    signer = LocalResultSigner(p256_private_key_file(ca.key, "identity.ca_key"))
    loaded = load_ca(
        trust_domain="runners.example",
        signer=signer,
        chain_file=ca.chain,
        previous_files=[],
        max_lifetime=timedelta(hours=1),
        now=datetime.now(UTC),
    )
    assert len(loaded.chain) == 2
    assert len(loaded.intermediates) == 1
    assert loaded.bundle(datetime.now(UTC))["keys"][0]["use"] == "x509-svid"  # type: ignore[index]
    with pytest.raises(ConfigError) as caught:
        load_ca(
            trust_domain="runners.example",
            signer=LocalResultSigner(ec.generate_private_key(ec.SECP256R1())),
            chain_file=ca.chain,
            previous_files=[],
            max_lifetime=timedelta(hours=1),
            now=datetime.now(UTC),
        )
    assert caught.value.key == "identity.ca_key"
    with pytest.raises(ConfigError) as caught:  # the root is no issuing CA here: wrong order
        load_ca(
            trust_domain="runners.example",
            signer=signer,
            chain_file=ca.root,
            previous_files=[],
            max_lifetime=timedelta(hours=1),
            now=datetime.now(UTC),
        )
    assert caught.value.key == "identity.ca_key"
