"""The workload-certificate CA's key where the broker's other signing keys live (issue 32): EC
P-256 on a PKCS#11 token (SoftHSM2) and in Cloud KMS (the real google-cloud-kms client over gRPC
to the loopback KMS). For each, the broker starts only on a CA certificate of that very key in a
chain that links; the SVIDs it issues are signed by that key and chain to the bundle's root
(checked with ``cryptography``); each issuance is recorded. The PEM form: test_identity.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import SignatureAlgorithmOID

from broker.config import load_settings
from broker.core.errors import ConfigError
from broker.dev.identity_ca import make_dev_identity_chain
from tests.fakes.google_kms import FakeKms
from tests.integration.attested import Runner, attest_broker
from tests.integration.conftest import RunningBroker, write_config
from tests.integration.identity import (
    IDENTITY_TOML,
    SPIFFE_ID,
    TRUST_DOMAIN,
    ask_identity,
    bundle,
    make_csr,
    with_identity,
)
from tests.support.hsm_custody import make_p256_key_pair
from tests.support.issuers import dev_issuer

CA_VERSION = (
    "projects/broker-test/locations/global/keyRings/broker/cryptoKeys/identity-ca/"
    "cryptoKeyVersions/1"
)


@dataclass(frozen=True)
class CaKey:
    """An ``[identity] ca_key`` kept outside the broker, and its public half as read there."""

    ref: str
    public: ec.EllipticCurvePublicKey
    environ: dict[str, str]
    kms: FakeKms | None = None


@pytest.fixture(params=["pkcs11", "cloudkms"])
def ca_key(request: pytest.FixtureRequest) -> CaKey:
    """A new P-256 key pair on the session's SoftHSM2 token, or a new EC_SIGN_P256_SHA256
    version in the loopback KMS (``[keys] kms_endpoint`` pointed at it)."""
    if request.param == "pkcs11":
        softhsm: str = request.getfixturevalue("softhsm")
        uri = softhsm.replace("object=kek", "object=identity-ca-" + uuid.uuid4().hex[:8])
        return CaKey(uri, make_p256_key_pair(uri), {})
    kms: FakeKms = request.getfixturevalue("fake_kms")
    kms.create_ec_signing_key(CA_VERSION)
    public = kms.signing_keys[CA_VERSION].public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    environ = {
        "BROKER_KEYS_KMS_ENDPOINT": kms.endpoint,
        "BROKER_KEYS_UPSTREAM_TIMEOUT_SECONDS": "2",
    }
    return CaKey("cloudkms:" + CA_VERSION, public, environ, kms)


async def _start(
    start_broker: Callable[..., Any], ca_key: CaKey, setup: Callable[[Path], None]
) -> RunningBroker:
    """A broker whose ``[identity] ca_key`` is ``ca_key``; ``setup`` writes its CA chain."""
    toml = IDENTITY_TOML.replace('"identity/ca.key"', json.dumps(ca_key.ref))
    assert toml != IDENTITY_TOML
    return await attest_broker(
        start_broker, extra_toml=toml, workdir_setup=setup, environ=ca_key.environ
    )


async def test_svids_are_signed_by_the_ca_key_where_it_lives(
    start_broker: Callable[..., Any], ca_key: CaKey
) -> None:
    """The broker starts on the key's own CA certificate; the leaf verifies with the public half
    read from the token / the KMS and chains to the bundle's root; the issuance is recorded."""
    broker = await _start(
        start_broker, ca_key, functools.partial(with_identity, ca_key=ca_key.public)
    )
    assert not (broker.workdir / "identity" / "ca.key").exists()  # no CA key in any file
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        key, csr = make_csr()
        status, body, _ = await ask_identity(runner, session, csr)
        assert status == 201, body
        roots_pem = await bundle(broker, session, "pem")
    leaf, *intermediates = x509.load_pem_x509_certificates(body["certificates"].encode())
    (root,) = x509.load_pem_x509_certificates(roots_pem.encode())
    # 1. the leaf's signature: made by the key the token / the KMS holds
    assert leaf.signature_algorithm_oid == SignatureAlgorithmOID.ECDSA_WITH_SHA256
    ca_key.public.verify(leaf.signature, leaf.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    # 2. the chain it came with: that key's intermediate, then the bundle's root
    assert [c.public_key() for c in intermediates] == [ca_key.public]
    assert leaf.issuer == intermediates[0].subject
    store = x509.verification.Store([root])
    verifier = x509.verification.PolicyBuilder().store(store).build_client_verifier()
    verified = verifier.verify(leaf, intermediates)
    assert verified.chain == [leaf, *intermediates, root]
    assert [str(u.value) for u in verified.subjects or ()] == [SPIFFE_ID]
    certified = leaf.public_key()
    assert isinstance(certified, ec.EllipticCurvePublicKey)
    assert certified.public_numbers() == key.public_key().public_numbers()
    # 3. the issuance is recorded, under the serial the certificate carries
    (record,) = [r for r in broker.records() if r["type"] == "identity"]
    assert (record["result"], record["code"]) == ("allow", None)
    assert record["spiffe_id"] == SPIFFE_ID
    assert record["serial"] == format(leaf.serial_number, "x") == body["serial"]
    assert record["index"] == body["log_index"]
    if ca_key.kms is not None:  # one AsymmetricSign: the leaf (the result key is a PEM here)
        assert ca_key.kms.calls.count("AsymmetricSign") == 1


async def test_a_ca_certificate_of_another_key_stops_start_up(
    start_broker: Callable[..., Any], ca_key: CaKey
) -> None:
    """``ca_certificates`` certifies a development key (a PEM file), not the token's or the
    KMS's: the broker does not start, and says which setting is wrong."""
    with pytest.raises(ConfigError) as caught:
        await _start(start_broker, ca_key, with_identity)
    assert caught.value.key == "identity.ca_key"
    assert "is not the key of the first certificate in ca_certificates" in caught.value.message


def _with_a_foreign_root(ca_key: CaKey, workdir: Path) -> None:
    """The intermediate for the right key, followed by another development root."""
    with_identity(workdir, ca_key.public)
    other = make_dev_identity_chain(
        workdir / "other", TRUST_DOMAIN, ca_key.public, now=datetime.now(UTC)
    )
    chain = workdir / "identity" / "ca-chain.pem"
    intermediate = x509.load_pem_x509_certificates(chain.read_bytes())[0]
    chain.write_bytes(
        intermediate.public_bytes(serialization.Encoding.PEM) + other.root.read_bytes()
    )


async def test_a_chain_that_does_not_link_stops_start_up(
    start_broker: Callable[..., Any], ca_key: CaKey
) -> None:
    with pytest.raises(ConfigError) as caught:
        await _start(start_broker, ca_key, functools.partial(_with_a_foreign_root, ca_key))
    assert caught.value.key == "identity.ca_certificates"
    assert "do not chain" in caught.value.message


async def test_a_ca_key_that_is_not_there_stops_start_up(
    start_broker: Callable[..., Any], ca_key: CaKey
) -> None:
    """``ca_key`` names no key (another label on the token, another KMS version): the broker
    does not start, and the error names ``identity.ca_key`` (it named ``attest.signing_key``,
    or was Cloud KMS's NotFound with a traceback) and the key it did not find."""
    if ca_key.kms is None:
        missing = "absent-" + uuid.uuid4().hex[:8]
        ref = re.sub(r"object=[^?;]+", f"object={missing}", ca_key.ref)
    else:
        missing = CA_VERSION.removesuffix("/1") + "/2"
        ref = "cloudkms:" + missing
    absent = dataclasses.replace(ca_key, ref=ref)
    with pytest.raises(ConfigError) as caught:
        await _start(start_broker, absent, functools.partial(with_identity, ca_key=ca_key.public))
    assert caught.value.key == "identity.ca_key"
    assert missing in caught.value.message


@pytest.mark.parametrize("ca_key", ["cloudkms"], indirect=True)
async def test_a_ca_key_the_kms_cannot_use_issues_no_certificate(
    start_broker: Callable[..., Any], ca_key: CaKey
) -> None:
    """After start-up the KMS goes down, then the version is deleted: each request is refused
    with 503 ``identity_ca_unavailable`` (a deleted version was Cloud KMS's NotFound, a 500
    ``internal_error``), recorded, and no certificate is issued."""
    assert ca_key.kms is not None
    broker = await _start(
        start_broker, ca_key, functools.partial(with_identity, ca_key=ca_key.public)
    )
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        _, csr = make_csr()
        ca_key.kms.unavailable = True
        down = await ask_identity(runner, session, csr)
        ca_key.kms.unavailable = False
        del ca_key.kms.signing_keys[CA_VERSION]
        gone = await ask_identity(runner, session, csr)
    for status, body, _ in (down, gone):
        assert (status, body["error"]["code"]) == (503, "identity_ca_unavailable"), body
        assert "certificates" not in body
    records = [r for r in broker.records() if r["type"] == "identity"]
    assert [(r["code"], r["serial"]) for r in records] == [("identity_ca_unavailable", None)] * 2
    assert all(r["result"] != "allow" for r in records)


def test_a_sealed_broker_reaches_a_kms_ca_key_only_through_federation(tmp_path: Path) -> None:
    """A broker in a TEE presents its attestation to Cloud KMS (Workload Identity Federation),
    for the CA key as for its other KMS keys: without ``kms_credentials`` it does not load
    (the CA key was not counted, so it went with the VM's service account)."""
    toml = IDENTITY_TOML.replace('"identity/ca.key"', json.dumps("cloudkms:" + CA_VERSION))
    config = write_config(tmp_path / "broker", dev_issuer(), extra_toml=toml)
    environ = {"BROKER_ATTEST_ENABLED": "true", "BROKER_ATTEST_SIGNING_KEY": "ear-signing.pem"}
    assert load_settings(config, environ).identity.ca_key == "cloudkms:" + CA_VERSION
    sealed = {
        **environ,
        "BROKER_SEALED_LAUNCHER_SOCKET": str(tmp_path / "teeserver.sock"),
        "BROKER_SEALED_MAKE_KEYS": "false",
    }
    with pytest.raises(ConfigError) as caught:
        load_settings(config, sealed)
    assert caught.value.key == "keys.kms_credentials"
    assert "Workload Identity Federation" in caught.value.message
