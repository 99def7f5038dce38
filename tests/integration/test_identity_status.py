"""Which workload certificates the broker issued on a result (issue 32, review M1): the status
answer ``GET /v1/attestations/{jti}`` lists each one (serial, SPIFFE ID, SHA-256 of the leaf,
expiry; newest last), from the shared attestation store, so that a peer can tell a leaf the
broker issued from one signed with the CA key elsewhere that copies a live jti. A certificate
is answered only once it is listed: a store that does not take it, a result revoked meanwhile,
a CA key that signed something its certificate does not verify — no certificate, a record."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.stored import AttestationStore, note_certificate, revoke
from broker.crypto.svid import ATTESTATION_OID
from broker.signers.results import LocalResultSigner
from broker.stores.attestations import MemoryAttestations
from broker.stores.nonces import store_unavailable
from tests.integration.attested import Runner
from tests.integration.conftest import RunningBroker
from tests.integration.identity import (
    SPIFFE_ID,
    TRUST_DOMAIN,
    ask_identity,
    identity_broker,
    make_csr,
)


def _jti(runner: Runner) -> str:
    return str(json.loads(base64.urlsafe_b64decode(runner.token.split(".")[1] + "=="))["jti"])


async def _status(broker: RunningBroker, jti: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{broker.url}/v1/attestations/{jti}", ssl=broker.client_tls) as response,
    ):
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


def _listed(leaf: x509.Certificate) -> dict[str, str]:
    return {
        "serial": format(leaf.serial_number, "x"),
        "spiffe_id": SPIFFE_ID,
        "sha256": leaf.fingerprint(hashes.SHA256()).hex(),
        "not_after": leaf.not_valid_after_utc.isoformat().replace("+00:00", "Z"),
    }


def _leaf(body: dict[str, Any]) -> x509.Certificate:
    return x509.load_pem_x509_certificates(body["certificates"].encode())[0]


def _identity_records(broker: RunningBroker) -> list[dict[str, Any]]:
    return [r for r in broker.records() if r["type"] == "identity"]


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_the_status_lists_each_certificate_issued_on_the_result(
    start_broker: Callable[..., Any],
) -> None:
    """Three certificates, each over its own connection (with two workers, both issue): the
    status, read over yet another connection, lists the three in order, as their records do."""
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
    assert (await _status(broker, _jti(runner)))["identities"] == []
    leaves = []
    for _ in range(3):
        async with aiohttp.ClientSession() as session:
            status, body, _ = await ask_identity(runner, session, make_csr()[1])
        assert status == 201, body
        leaves.append(_leaf(body))
    answer = await _status(broker, _jti(runner))
    assert answer["status"] == "active"
    assert answer["identities"] == [_listed(leaf) for leaf in leaves]
    assert [r["sha256"] for r in _identity_records(broker)] == [
        item["sha256"] for item in answer["identities"]
    ]


async def test_a_leaf_forged_with_the_ca_key_for_a_live_jti_is_not_listed(
    start_broker: Callable[..., Any],
) -> None:
    """Whoever holds the CA key signs a leaf for ``/admin`` carrying a live result's jti (seen
    in any certificate the runner presented): the result is active, but the forged leaf's
    fingerprint and serial are not among the certificates the broker issued on it."""
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        status, body, _ = await ask_identity(runner, session, make_csr()[1])
    assert status == 201, body
    real = _leaf(body)
    carried = real.extensions.get_extension_for_oid(ATTESTATION_OID).value
    ca_key = serialization.load_pem_private_key(
        (broker.workdir / "identity" / "ca.key").read_bytes(), None
    )
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    now = datetime.now(UTC)
    forged = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(real.issuer)
        .public_key(ec.generate_private_key(ec.SECP256R1()).public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"spiffe://{TRUST_DOMAIN}/admin")]
            ),
            critical=True,
        )
        .add_extension(carried, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    answer = await _status(broker, _jti(runner))
    assert answer["status"] == "active"  # what the jti alone said: the forgery passed
    assert answer["identities"] == [_listed(real)]
    assert _listed(forged)["sha256"] not in {i["sha256"] for i in answer["identities"]}
    assert format(forged.serial_number, "x") not in {i["serial"] for i in answer["identities"]}


async def _refused_without_certificate(
    broker: RunningBroker, runner: Runner, expected: tuple[int, str]
) -> dict[str, Any]:
    before = len(_identity_records(broker))
    async with aiohttp.ClientSession() as session:
        status, body, _ = await ask_identity(runner, session, make_csr()[1])
    assert (status, body["error"]["code"]) == expected, body
    assert "certificates" not in body
    assert "BEGIN CERTIFICATE" not in json.dumps(body)
    records = _identity_records(broker)
    assert len(records) == before + 1
    record = records[-1]
    assert (record["code"], record["serial"], record["sha256"]) == (expected[1], None, None)
    assert record["result"] != "allow"
    assert record["index"] == body["error"]["log_index"]
    return record


async def test_a_store_that_does_not_take_the_listing_issues_nothing(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store answers the read (the result is admitted) but not the write that lists the
    certificate: 503 with the store's code and a record, no certificate; the store back, the
    next request gets one."""
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
    with monkeypatch.context() as patched:

        async def down(*_: Any, **__: Any) -> None:
            raise store_unavailable()

        patched.setattr(MemoryAttestations, "update", down)
        await _refused_without_certificate(broker, runner, (503, "nonce_store_unavailable"))
    assert (await _status(broker, _jti(runner)))["identities"] == []
    async with aiohttp.ClientSession() as session:
        status, body, _ = await ask_identity(runner, session, make_csr()[1])
    assert status == 201, body
    assert (await _status(broker, _jti(runner)))["identities"] == [_listed(_leaf(body))]


async def test_a_result_revoked_while_its_certificate_is_made_gets_none(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An admin's revocation lands between the admission (active) and the listing: the
    listing reads the status again in the same atomic update and the certificate is not
    answered (``attestation_revoked``)."""
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)

    async def revoked_first(store: AttestationStore, jti: str, *args: Any) -> Any:
        await revoke(store, jti, "revoked meanwhile", datetime.now(UTC), who="test")
        return await note_certificate(store, jti, *args)

    monkeypatch.setattr("broker.decisions.identity.note_certificate", revoked_first)
    await _refused_without_certificate(broker, runner, (401, "attestation_revoked"))
    monkeypatch.undo()
    answer = await _status(broker, _jti(runner))
    assert (answer["status"], answer["identities"]) == ("revoked", [])


async def test_a_leaf_the_ca_certificate_does_not_verify_is_never_issued(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CA's key service answers a signature by another key (a wrong key version): the
    leaf is checked against the CA certificate before anything else, and refused (503
    ``identity_ca_unavailable``), neither listed nor answered."""
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)  # the result key signs before the patch
    other = LocalResultSigner(ec.generate_private_key(ec.SECP256R1()))
    original = LocalResultSigner.sign

    async def wrong_key(_: LocalResultSigner, data: bytes) -> bytes:
        return await original(other, data)

    monkeypatch.setattr(LocalResultSigner, "sign", wrong_key)
    await _refused_without_certificate(broker, runner, (503, "identity_ca_unavailable"))
    monkeypatch.undo()
    assert (await _status(broker, _jti(runner)))["identities"] == []
