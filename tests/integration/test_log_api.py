"""The read-only audit API (public key, checkpoints and proofs; entries for role auditor), and
log_index and leaf_hash in release answers — checked with the broker's own verifiers against
the signed checkpoint, and by the runner SDK's ``prove``."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.client import BrokerClientError, ProofError
from broker.crypto.checkpoint import NoteSigner, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import leaf_hash, verify_consistency, verify_inclusion
from tests.integration.conftest import RunningBroker
from tests.support.constants import KEY

AUDITOR = "auditor-token-3c2b"
KEY_ADMIN = "key-admin-token-77e0"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture
async def audited(start_broker: Any) -> RunningBroker:
    roles = "".join(
        f'\n[[admin.tokens]]\nsha256 = "{digest(t)}"\nroles = ["{r}"]\n'
        for t, r in ((AUDITOR, "auditor"), (KEY_ADMIN, "key-admin"))
    )
    return await start_broker(extra_toml=roles)  # type: ignore[no-any-return]


async def get(broker: RunningBroker, path: str, token: str = AUDITOR) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            broker.url + path, headers={"Authorization": f"Bearer {token}"}, ssl=broker.client_tls
        ) as response,
    ):
        return response.status, await response.text()


async def verifier_for(broker: RunningBroker) -> NoteVerifier:
    signer = await asyncio.to_thread(
        NoteSigner.from_pem, broker.settings.audit.origin, broker.workdir / "log-ed25519.pem"
    )
    return NoteVerifier.parse(signer.verifier_key())


async def test_release_answers_carry_their_log_index_and_its_proof_verifies(
    audited: RunningBroker,
) -> None:
    async with audited.client() as client:
        released = await client.release(KEY, audited.token_source())
        with pytest.raises(BrokerClientError) as denied:
            await client.release(KEY, audited.token_source("sha256:" + "0" * 64))
    allow_index = released.log_index
    deny_index = denied.value.details["log_index"]
    assert deny_index == allow_index + 1
    for state in ("allow", "deny"):
        index = allow_index if state == "allow" else deny_index
        await audited_proof(audited, index, expected_result=state)


async def audited_proof(broker: RunningBroker, index: int, *, expected_result: str) -> None:
    verifier = await verifier_for(broker)
    status, note = await get(broker, "/v1/log/checkpoint")
    assert status == 200
    checkpoint = parse_checkpoint(verifier.open(note), origin=verifier.name)
    if checkpoint.size <= index:  # published every 0.2 s: wait for one that covers it
        for _ in range(150):
            await asyncio.sleep(0.1)
            _, note = await get(broker, "/v1/log/checkpoint")
            checkpoint = parse_checkpoint(verifier.open(note), origin=verifier.name)
            if checkpoint.size > index:
                break
    status, lines = await get(broker, f"/v1/log/entries?start={index}&end={index + 1}")
    assert status == 200
    record = lines.splitlines()[0].encode()
    assert json.loads(record)["result"] == expected_result
    status, body = await get(
        broker, f"/v1/log/proof/inclusion?index={index}&tree_size={checkpoint.size}"
    )
    proof = [base64.b64decode(h) for h in json.loads(body)["hashes"]]
    assert verify_inclusion(leaf_hash(record), index, checkpoint.size, proof, checkpoint.root)


async def test_consistency_between_two_checkpoints_through_the_api(
    audited: RunningBroker,
) -> None:
    verifier = await verifier_for(audited)
    async with audited.client() as client:
        await client.release(KEY, audited.token_source())
    first = await checkpoint_covering(audited, verifier, 1)
    async with audited.client() as client:
        for _ in range(3):
            await client.release(KEY, audited.token_source())
    for _ in range(150):
        await asyncio.sleep(0.1)
        second = parse_checkpoint(verifier.open((await get(audited, "/v1/log/checkpoint"))[1]))
        if second.size >= first.size + 3:
            break
    status, body = await get(
        audited, f"/v1/log/proof/consistency?first={first.size}&second={second.size}"
    )
    assert status == 200
    proof = [base64.b64decode(h) for h in json.loads(body)["hashes"]]
    assert verify_consistency(first.size, second.size, first.root, second.root, proof)


async def checkpoint_covering(broker: RunningBroker, verifier: NoteVerifier, size: int) -> Any:
    for _ in range(150):
        checkpoint = parse_checkpoint(verifier.open((await get(broker, "/v1/log/checkpoint"))[1]))
        if checkpoint.size >= size:
            return checkpoint
        await asyncio.sleep(0.1)
    raise AssertionError(f"no checkpoint covered {size} records")


@pytest.mark.parametrize(
    ("path", "public"),
    [
        ("/v1/log/checkpoint", True),
        ("/v1/log/entries", False),
        ("/v1/log/proof/inclusion?index=0&tree_size=1", True),
        ("/v1/log/proof/consistency?first=1&second=1", True),
    ],
)
async def test_proofs_are_public_and_records_need_the_auditor_role(
    audited: RunningBroker, path: str, public: bool
) -> None:
    async with audited.client() as client:
        await client.release(KEY, audited.token_source())  # one record to prove
    async with (
        aiohttp.ClientSession() as session,
        session.get(audited.url + path, ssl=audited.client_tls) as response,
    ):
        anonymous = response.status
    status, body = await get(audited, path, token=KEY_ADMIN)
    if public:  # hashes only: no credential needed, and a wrong one is not asked for
        assert (anonymous, status) == (200, 200)
    else:
        assert anonymous == 401
        assert (status, json.loads(body)["error"]["code"]) == (401, "unauthorized")
    assert (await get(audited, path))[0] == 200


async def test_the_log_key_is_served_and_a_runner_proves_its_release(
    audited: RunningBroker,
) -> None:
    status, body = await get(audited, "/v1/log/key", token="")
    served = json.loads(body)
    pinned = (await verifier_for(audited)).name
    assert status == 200
    assert served["name"] == pinned == audited.settings.audit.origin
    NoteVerifier.parse(served["verifier_key"])  # a well-formed note verifier key
    log_key = served["verifier_key"]  # a runner pins it out of band; here: the one just checked
    async with audited.client() as client:
        released = await client.release(KEY, audited.token_source())
        proven = await client.prove(released, log_key)
        assert proven.tree_size > released.log_index
        assert verify_inclusion(
            released.leaf_hash, released.log_index, proven.tree_size, proven.proof, proven.root
        )
        record = (await get(audited, f"/v1/log/entries?start={released.log_index}"))[1]
        assert leaf_hash(record.splitlines()[0].encode()) == released.leaf_hash  # its record
        forged = dataclasses.replace(released, leaf_hash=bytes(32))
        with pytest.raises(ProofError, match="does not include"):
            await client.prove(forged, log_key)
        stranger = NoteSigner(audited.settings.audit.origin, ed25519.Ed25519PrivateKey.generate())
        with pytest.raises(ProofError, match="does not verify"):
            await client.prove(released, stranger.verifier_key())


@pytest.mark.parametrize(
    "query",
    [
        "/v1/log/proof/inclusion?index=5&tree_size=5",
        "/v1/log/proof/inclusion?index=0&tree_size=999999",
        "/v1/log/proof/inclusion?index=-1&tree_size=1",
        "/v1/log/proof/inclusion?tree_size=1",
        "/v1/log/proof/consistency?first=0&second=1",
        "/v1/log/proof/consistency?first=2&second=1",
        "/v1/log/entries?start=99999",
        "/v1/log/entries?start=x",
    ],
)
async def test_impossible_proof_requests_are_400(audited: RunningBroker, query: str) -> None:
    status, body = await get(audited, query)
    assert (status, json.loads(body)["error"]["code"]) == (400, "bad_request")


SIGNING_VERSION = (
    "projects/broker-test/locations/global/keyRings/broker/cryptoKeys/log-signing/"
    "cryptoKeyVersions/1"
)


async def test_checkpoints_signed_by_a_cloud_kms_key(start_broker: Any, fake_kms: Any) -> None:
    fake_kms.create_signing_key(SIGNING_VERSION)
    broker: RunningBroker = await start_broker(
        environ={
            "BROKER_KEYS_KMS_ENDPOINT": fake_kms.endpoint,
            "BROKER_AUDIT_SIGNING_KEY": f"cloudkms:{SIGNING_VERSION}",
            "BROKER_KEYS_UPSTREAM_TIMEOUT_SECONDS": "1",
            "BROKER_ADMIN_TOKEN_SHA256": digest(AUDITOR),
        }
    )
    public = fake_kms.signing_keys[SIGNING_VERSION].public_key()
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    from broker.crypto.checkpoint import verifier_key_text  # noqa: PLC0415

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    verifier = NoteVerifier.parse(verifier_key_text(broker.settings.audit.origin, raw))
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
    checkpoint = await checkpoint_covering(broker, verifier, released.log_index + 1)
    assert checkpoint.size >= 1
    assert "AsymmetricSign" in fake_kms.calls
    fake_kms.unavailable = True  # signing fails: releases go on, the next checkpoint waits
    async with broker.client() as client:
        assert (
            await client.release(KEY, broker.token_source())
        ).log_index == released.log_index + 1
