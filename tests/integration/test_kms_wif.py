"""The KEK serves only the attested broker (issue 29, item 3): Cloud KMS through Workload
Identity Federation.

Real: google-auth's identity-pool credentials (they read the attestation token file and make the
RFC 8693 exchange), the google-cloud-kms async client over gRPC with the federated token as call
credentials, the broker's KEK, key service, signers and a running broker, and the CEL of
``deploy/confidential-space/broker/wif-condition.cel`` evaluated by cel-python (``wif.sh`` and
the configuration checks: ``test_kms_wif_deploy.py``). Stand-ins, on loopback: the
STS (``tests/fakes/google_sts.py``), Cloud KMS with IAM (``tests/fakes/google_kms.py``), and the
attestation token, minted by the development issuer in Confidential Space's shape instead of by
Google's attestation service.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from broker.client import BrokerClientError
from broker.config import KeySettings, load_settings
from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.dev.issuer import DevIssuer, Workload
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from broker.signers.results_kms import KmsResultSigner
from tests.fakes.google_kms import FakeKms, KmsIam
from tests.fakes.google_sts import (
    JWT_TOKEN_TYPE,
    REJECTED_BY_CONDITION,
    STS_AUDIENCE,
    FakeSts,
    OidcProvider,
    wif_sh_provider,
)
from tests.integration.conftest import KMS_KEY, RunningBroker, create_test_keys, write_config
from tests.support.constants import ALLOWED, DENIED, KEY
from tests.support.issuers import dev_issuer

ENCRYPTER = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
SIGNER = "roles/cloudkms.signerVerifier"
RESULT_KEY = "projects/broker-test/locations/global/keyRings/broker/cryptoKeys/results"
NOW = datetime(2026, 11, 30, tzinfo=UTC)
ALLOWED_WORKLOAD = Workload(image_digest=ALLOWED)
REFUSED_IMAGES = {
    "another image digest": Workload(image_digest=DENIED),
    "a debug image": Workload(image_digest=ALLOWED, debug=True),
    # dbgstat alone refuses it (a debug image has no support attributes either)
    "dbgstat enabled, even with STABLE": Workload(
        image_digest=ALLOWED, extra_claims={"dbgstat": "enabled"}
    ),
    "an image without STABLE support": Workload(image_digest=ALLOWED, support=("USABLE",)),
}


@dataclass
class Wif:
    """The key owner's project on loopback: an STS whose provider admits ``ALLOWED`` as
    ``wif.sh`` configures it, and a KMS whose key is bound to that digest's principal set."""

    issuer: DevIssuer
    sts: FakeSts
    kms: FakeKms
    iam: KmsIam
    tmp: Path
    made: Iterator[int] = field(default_factory=itertools.count)

    def credentials(
        self, workload: Workload, *, sts: FakeSts | None = None, token: str | None = None
    ) -> Path:
        """The token the launcher writes for ``workload`` (audience STS) and the credential
        configuration ``gcloud … create-cred-config`` writes for it, at a loopback STS."""
        sts = sts or self.sts
        name = str(next(self.made))
        token_file = self.tmp / f"attestation-{name}.jwt"
        token_file.write_text(
            token
            or self.issuer.mint(
                audience=STS_AUDIENCE, nonces=[], workload=workload, now=datetime.now(UTC)
            )
        )
        config = {
            "universe_domain": "googleapis.com",
            "type": "external_account",
            "audience": sts.provider.audience,
            "subject_token_type": JWT_TOKEN_TYPE,
            "token_url": sts.url,
            "credential_source": {"file": str(token_file)},
        }
        path = self.tmp / f"kms-credentials-{name}.json"
        path.write_text(json.dumps(config))
        return path

    def environ(self, credentials: Path) -> dict[str, str]:
        return {
            "BROKER_KEYS_KEK": f"cloudkms:{KMS_KEY}",
            "BROKER_KEYS_KMS_ENDPOINT": self.kms.endpoint,
            "BROKER_KEYS_KMS_CREDENTIALS": str(credentials),
            "BROKER_KEYS_UPSTREAM_TIMEOUT_SECONDS": "5",
        }

    def key_settings(self, credentials: Path) -> KeySettings:
        return KeySettings(
            store=f"sqlite:///{self.tmp / 'keys.db'}",
            kek=f"cloudkms:{KMS_KEY}",
            kms_endpoint=self.kms.endpoint,
            kms_credentials=credentials,
            upstream_timeout_seconds=5,
        )


def provider_for(issuer: DevIssuer, digest: str) -> OidcProvider:
    return wif_sh_provider(issuer.issuer, issuer.jwks(), digest)


@pytest.fixture
async def wif(tmp_path: Path) -> AsyncIterator[Wif]:
    issuer = dev_issuer()
    provider = provider_for(issuer, ALLOWED)
    sts = FakeSts(provider)
    await sts.start()
    kms = FakeKms()
    kms.iam = iam = KmsIam(sts.identities_of)
    kms.create_key(KMS_KEY)
    iam.grant(KMS_KEY, ENCRYPTER, provider.principal_set("image_digest", ALLOWED))
    await kms.start()
    yield Wif(issuer, sts, kms, iam, tmp_path)
    await kms.stop()
    await sts.stop()


async def test_the_attested_image_wraps_and_unwraps_through_wif(wif: Wif) -> None:
    settings = wif.key_settings(wif.credentials(Workload(image_digest=ALLOWED)))
    async with open_key_service(settings) as keys:
        made = await keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
        dek = await keys.unwrap(made)
    async with open_key_service(settings) as keys:  # a restart: a new exchange, the same DEK
        assert await keys.unwrap(await keys.resolve(KEY, None)) == dek
    assert len(dek) == 32
    assert wif.sts.outcomes == ["granted", "granted"]  # one exchange per process, not per RPC
    assert {"Encrypt", "Decrypt"} <= set(wif.kms.calls)
    assert wif.iam.denied == []
    (grant, *_) = wif.sts.grants.values()
    assert grant.attributes == {"image_digest": ALLOWED}
    assert grant.subject == f"gcpcs::{ALLOWED}::100000000001::1234567890123456789"


async def test_a_long_project_id_and_instance_name_still_map_to_a_subject(wif: Wif) -> None:
    """The token's ``sub`` (the VM's selfLink) here is 171 bytes, past the STS's 127-byte limit
    on google.subject; the mapping ``wif.sh`` uses stays under it."""
    workload = Workload(image_digest=ALLOWED, project_id="p" * 30, instance_name="i" * 63)
    async with open_key_service(wif.key_settings(wif.credentials(workload))) as keys:
        await keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    assert wif.sts.outcomes == ["granted"]


@pytest.mark.parametrize("workload", REFUSED_IMAGES.values(), ids=REFUSED_IMAGES.keys())
async def test_another_image_cannot_unwrap_the_attested_images_deks(
    wif: Wif, workload: Workload
) -> None:
    """The DEK exists, wrapped by the attested broker; a modified, debug or unsupported image
    with the same store and configuration gets no token from the STS, so no Decrypt at all."""
    async with open_key_service(wif.key_settings(wif.credentials(ALLOWED_WORKLOAD))) as keys:
        await keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    calls = len(wif.kms.calls)
    async with open_key_service(wif.key_settings(wif.credentials(workload))) as keys:
        record = await keys.resolve(KEY, None)
        with pytest.raises(UpstreamError) as caught:
            await keys.unwrap(record)
    error = caught.value
    assert error.code is ErrorCode.KEK_UNAVAILABLE
    assert error.message.startswith("Cloud KMS (Workload Identity Federation): the STS refused")
    assert "(invalid_grant)" in error.message
    assert wif.sts.outcomes == ["granted", f"invalid_grant: {REJECTED_BY_CONDITION}"]
    assert len(wif.kms.calls) == calls  # the KMS was never asked


async def test_the_key_binding_refuses_an_image_a_permissive_provider_admits(wif: Wif) -> None:
    """Defence in depth: a provider whose condition admits another digest (changed, or another
    pool) gets that image a federated token, and the key's IAM binding still refuses it."""
    async with open_key_service(wif.key_settings(wif.credentials(ALLOWED_WORKLOAD))) as keys:
        await keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    permissive = FakeSts(provider_for(wif.issuer, DENIED))
    await permissive.start()
    try:
        wif.iam.identities_of = lambda t: wif.sts.identities_of(t) or permissive.identities_of(t)
        credentials = wif.credentials(Workload(image_digest=DENIED), sts=permissive)
        async with open_key_service(wif.key_settings(credentials)) as keys:
            record = await keys.resolve(KEY, None)
            with pytest.raises(UpstreamError) as caught:
                await keys.unwrap(record)
    finally:
        await permissive.stop()
    assert permissive.outcomes == ["granted"]
    assert wif.iam.denied == ["Decrypt PERMISSION_DENIED"]
    assert caught.value.code is ErrorCode.KEK_UNAVAILABLE
    assert caught.value.message == (
        "Cloud KMS (Workload Identity Federation): decrypt refused (PERMISSION_DENIED): "
        "these credentials are not granted the resource"
    )


def other_issuer_token(wif: Wif) -> str:
    forger = dev_issuer()  # the same issuer URL, another key
    return forger.mint(
        audience=STS_AUDIENCE, nonces=[], workload=ALLOWED_WORKLOAD, now=datetime.now(UTC)
    )


def broker_audience_token(wif: Wif) -> str:
    """A real token of the right image, but one the broker asked for another audience (e.g.
    its self-attestation): the STS takes only tokens addressed to it."""
    return wif.issuer.mint(
        audience="https://broker.it.invalid", nonces=[], workload=ALLOWED_WORKLOAD, now=NOW
    )


@pytest.mark.parametrize("make_token", [other_issuer_token, broker_audience_token])
async def test_the_sts_refuses_tokens_it_cannot_verify(wif: Wif, make_token: Any) -> None:
    credentials = wif.credentials(ALLOWED_WORKLOAD, token=make_token(wif))
    async with open_key_service(wif.key_settings(credentials)) as keys:
        with pytest.raises(UpstreamError) as caught:
            await keys.create(KEY, Purpose.MODEL_WEIGHTS, now=NOW)
    assert "the STS refused this broker's attestation token (invalid_grant)" in str(
        caught.value.message
    )
    assert wif.sts.outcomes[-1].startswith("invalid_grant: ")
    assert wif.sts.outcomes[-1] != f"invalid_grant: {REJECTED_BY_CONDITION}"  # refused earlier
    assert wif.kms.calls == []


@pytest.mark.parametrize("workload", [ALLOWED_WORKLOAD, REFUSED_IMAGES["another image digest"]])
async def test_a_kms_result_key_serves_only_the_attested_image(
    wif: Wif, workload: Workload
) -> None:
    """The attestation-result signer (and the checkpoint signer, through the same
    ``KmsKeyVersion``) uses the same federated credentials."""
    version = f"{RESULT_KEY}/cryptoKeyVersions/1"
    wif.kms.create_ec_signing_key(version)
    wif.iam.grant(RESULT_KEY, SIGNER, wif.sts.provider.principal_set("image_digest", ALLOWED))
    signer = KmsResultSigner(
        f"cloudkms:{version}",
        endpoint=wif.kms.endpoint,
        timeout_seconds=5,
        credentials_file=wif.credentials(workload),
    )
    try:
        if workload is not ALLOWED_WORKLOAD:
            with pytest.raises(UpstreamError) as caught:
                await signer.open()
            assert caught.value.message.startswith(
                "result signing key: (Workload Identity Federation) the STS refused"
            )
            assert wif.kms.calls == []
            return
        await signer.open()
        raw = await signer.sign(b"claims")
    finally:
        await signer.close()
    private = wif.kms.signing_keys[version]
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    public = private.public_key()
    der = encode_dss_signature(int.from_bytes(raw[:32]), int.from_bytes(raw[32:]))
    public.verify(der, b"claims", ec.ECDSA(hashes.SHA256()))
    assert wif.kms.calls == ["GetPublicKey", "AsymmetricSign"]


async def test_a_release_through_the_broker_uses_the_federated_kek(
    wif: Wif, start_broker: Any
) -> None:
    credentials = wif.credentials(ALLOWED_WORKLOAD)
    broker: RunningBroker = await start_broker(environ=wif.environ(credentials))
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
    assert len(released.dek) == 32
    assert "Decrypt" in wif.kms.calls
    assert wif.iam.denied == []


async def test_a_broker_of_another_image_answers_503_naming_the_federation(
    wif: Wif, start_broker: Any, tmp_path: Path
) -> None:
    """The keys were made by the attested broker; the same store served by another image."""
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "broker", issuer)
    environ = wif.environ(wif.credentials(ALLOWED_WORKLOAD))
    await create_test_keys(await asyncio.to_thread(load_settings, config, environ))
    modified = wif.environ(wif.credentials(REFUSED_IMAGES["another image digest"]))
    broker: RunningBroker = await start_broker(environ=modified, reuse=(config, issuer))
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source())
    error = caught.value
    assert (error.status, error.code) == (503, "kek_unavailable")
    assert "Workload Identity Federation" in str(error)
    assert "Traceback" not in str(error)
    assert "wrapped_key" not in error.details
    assert wif.sts.outcomes[-1] == f"invalid_grant: {REJECTED_BY_CONDITION}"


async def test_a_service_account_key_stops_the_kek_at_start_up(wif: Wif) -> None:
    path = wif.tmp / "sa.json"
    path.write_text(json.dumps({"type": "service_account", "client_email": "x@y"}))
    with pytest.raises(ConfigError) as caught:
        async with open_key_service(wif.key_settings(path)):
            pass
    assert caught.value.key == "keys.kms_credentials"
    assert "type 'service_account'" in caught.value.message
