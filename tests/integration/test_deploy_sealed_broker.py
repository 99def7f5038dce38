"""deploy/confidential-space/broker/ (issue 29, item 1): what the operator can change after launch
cannot weaken a decision.

The launch policy (image.json labels) lets the operator set exactly the variables listed in
``HARMLESS`` through ``tee-env-*``, each with the reason it cannot weaken a decision; adding one
to the image without a reason here fails. The baked configuration (broker.toml) makes its keys in
the TEE, reaches its KEK only through Workload Identity Federation, loads only signed policy
bundles and has no admin token; and it loads, as the image would, with the allowed overrides.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.config import load_settings
from tests.support.processes import ROOT

HERE = ROOT / "deploy" / "confidential-space" / "broker"
HARMLESS = {
    # DPoP proofs and the TLS certificate's names: a wrong value only makes clients fail
    "BROKER_SERVER_PUBLIC_URLS": "where clients reach the broker",
    # bundles must carry the signature of the key in the image, for its scope, unexpired, and
    # never older than one this VM loaded (a recreated VM has no floor: docs/threat-model.md)
    "BROKER_POLICY_BUNDLE_URL": "where signed policy bundles are fetched",
}


def test_the_launch_policy_allows_only_harmless_overrides() -> None:
    labels = json.loads((HERE / "image.json").read_text())["labels"]
    allowed = set(labels["tee.launch_policy.allow_env_override"].split(","))
    assert allowed == set(HARMLESS)
    assert labels["tee.launch_policy.allow_cmd_override"] == "false"
    assert labels["tee.launch_policy.log_redirect"] == "debugonly"
    assert labels["tee.launch_policy.monitoring_memory_allow"] == "debugonly"


def test_the_baked_configuration_is_sealed() -> None:
    config = tomllib.loads((HERE / "broker.toml").read_text())
    image = json.loads((HERE / "image.json").read_text())
    assert image["cmd"][-1] == "/etc/broker/broker.toml"
    server, keys, audit = config["server"], config["keys"], config["audit"]
    assert "tls_cert" not in server
    assert "tls_key" not in server
    assert "signing_key" not in audit
    assert "signing_key" not in keys
    assert config["sealed"]["launcher_socket"] == "/run/container_launcher/teeserver.sock"
    assert config["sealed"].get("make_keys", True) is True
    assert keys["kek"].startswith("cloudkms:")
    assert keys["kms_credentials"]
    assert config["policy"]["bundle_verification_key"]
    assert config["policy"]["bundle_url"]
    admin = config["admin"]  # the model owner's token only, for its keys: no one can order a
    assert "token_sha256" not in admin  # policy reload or a downgrade (every role)
    assert [token["roles"] for token in admin["tokens"]] == [["key-admin"]]


def test_the_baked_configuration_loads_with_the_allowed_overrides(tmp_path: Path) -> None:
    """As the image holds it: its files at their paths (here under ``tmp_path``), the two
    variables the operator may set."""
    text = (HERE / "broker.toml").read_text().replace("/etc/broker/", f"{tmp_path}/")
    text = text.replace("/var/lib/broker/", f"{tmp_path}/state/")
    (tmp_path / "broker.toml").write_text(text)
    (tmp_path / "policy-signing.pub.pem").write_bytes(
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (tmp_path / "kms-credentials.json").write_text(
        json.dumps(
            {
                "type": "external_account",
                "audience": "//iam.googleapis.com/projects/1/locations/global/"
                "workloadIdentityPools/broker-pool/providers/broker-attestation",
                "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
                "token_url": "https://sts.googleapis.com/v1/token",
                "credential_source": {
                    "file": "/run/container_launcher/attestation_verifier_claims_token"
                },
            }
        )
    )
    settings = load_settings(
        tmp_path / "broker.toml",
        {
            "BROKER_SERVER_PUBLIC_URLS": "https://broker.example.com,https://10.0.0.2:8443",
            "BROKER_POLICY_BUNDLE_URL": "gs://other-bucket/prod.tar.gz",
        },
    )
    assert settings.sealed.make_keys
    assert settings.policy.bundle_url == "gs://other-bucket/prod.tar.gz"
    assert settings.server.tls_cert is None
    assert settings.audit.signing_key is None
