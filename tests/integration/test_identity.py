"""Workload certificates on attestation results (issue 32): ``POST /v1/identity`` on a live
broker issues an X.509-SVID whose chain and profile ``cryptography`` checks against the bundle
the broker serves; each hostile request is refused with its own code and leaves a record."""

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
from cryptography.x509.oid import ExtendedKeyUsageOID

from broker.crypto.svid import ATTESTATION_OID, NOT_BEFORE_BACKDATE, attestation_of
from tests.integration.attested import Runner, admin_post, mint
from tests.integration.identity import (
    SPIFFE_ID,
    TRUST_DOMAIN,
    ask_identity,
    bundle,
    identity_broker,
    make_csr,
)


def _identity_records(broker: Any) -> list[dict[str, Any]]:
    return [r for r in broker.records() if r["type"] == "identity"]


def _chain(body: dict[str, Any]) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(body["certificates"].encode())


def _check_profile(leaf: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    """SPIFFE X509-SVID §4, §5: one URI SAN, a leaf that is no CA, digitalSignature, both EKUs."""
    public = leaf.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert public.public_numbers() == key.public_key().public_numbers()
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [SPIFFE_ID]
    assert len(list(san)) == 1
    constraints = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical
    assert constraints.value.ca is False
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical
    assert usage.value.digital_signature
    assert not usage.value.key_cert_sign
    assert not usage.value.crl_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert list(leaf.subject) == []


async def test_an_attested_runner_gets_an_svid_that_chains_to_the_bundle(
    start_broker: Callable[..., Any],
) -> None:
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        key, csr = make_csr()
        status, body, headers = await ask_identity(runner, session, csr)
        assert status == 201, body
        jwks = await bundle(broker, session)
        roots_pem = await bundle(broker, session, "pem")
    assert body["spiffe_id"] == SPIFFE_ID
    assert headers["DPoP-Nonce"]
    leaf, *intermediates = _chain(body)
    _check_profile(leaf, key)
    # the chain: leaf ← intermediate ← the bundle's root (signatures and validity)
    (root,) = x509.load_pem_x509_certificates(roots_pem.encode())
    (jwk,) = jwks["keys"]
    assert jwk["use"] == "x509-svid"
    assert jwk["kty"] == "EC"
    assert base64.b64decode(jwk["x5c"][0]) == root.public_bytes(serialization.Encoding.DER)
    assert len(intermediates) == 1
    leaf.verify_directly_issued_by(intermediates[0])
    intermediates[0].verify_directly_issued_by(root)
    store = x509.verification.Store([root])
    verifier = x509.verification.PolicyBuilder().store(store).build_client_verifier()
    verified = verifier.verify(leaf, intermediates)
    assert [str(u.value) for u in verified.subjects or ()] == [SPIFFE_ID]
    # lifetime: at most the EAR's remaining life (ttl 120 s here), never the 1 h cap; valid
    # from 30 s before the request (a peer's clock a little behind), X.509's whole seconds
    ear = json.loads(base64.urlsafe_b64decode(runner.token.split(".")[1] + "=="))
    assert leaf.not_valid_after_utc == datetime.fromtimestamp(ear["exp"], UTC)
    (record,) = _identity_records(broker)
    asked = datetime.fromisoformat(record["time"])
    assert leaf.not_valid_before_utc == (asked - NOT_BEFORE_BACKDATE).replace(microsecond=0)
    assert leaf.not_valid_after_utc - asked <= timedelta(seconds=120)
    # the private extension: non-critical, the attestation's jti and the policy's digest
    extension = leaf.extensions.get_extension_for_oid(ATTESTATION_OID)
    assert extension.critical is False
    carried = json.loads(extension.value.value)  # type: ignore[attr-defined]
    assert attestation_of(leaf) == extension.value.value  # type: ignore[attr-defined]
    assert carried == {"jti": ear["jti"], "policy_digest": body["policy_digest"]}
    assert record["result"] == "allow"
    assert record["code"] is None
    assert record["spiffe_id"] == SPIFFE_ID
    assert record["serial"] == format(leaf.serial_number, "x") == body["serial"]
    assert record["sha256"] == leaf.fingerprint(hashes.SHA256()).hex()
    assert record["attestation"]["jti"] == ear["jti"]
    assert isinstance(record["attestation"]["log_index"], int)
    assert record["policy_digest"] == body["policy_digest"]
    assert record["input"]["request"]["kind"] == "identity"
    assert record["index"] == body["log_index"]


async def _refused(
    broker: Any, runner: Runner, session: aiohttp.ClientSession, csr: str, **kwargs: Any
) -> tuple[int, str, dict[str, Any]]:
    before = len(_identity_records(broker))
    status, body, _ = await ask_identity(runner, session, csr, **kwargs)
    records = _identity_records(broker)
    assert len(records) == before + 1, body  # every refusal that reached the broker: a record
    assert records[-1]["code"] == body["error"]["code"]
    assert records[-1]["serial"] is None
    assert records[-1]["sha256"] is None
    assert records[-1]["result"] != "allow"
    return status, body["error"]["code"], records[-1]


async def test_hostile_requests_are_refused_each_with_its_own_code(
    start_broker: Callable[..., Any],
) -> None:
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        _, good = make_csr()
        # the PoP key certified: refused (the certificate key must be a new key)
        _, pop_csr = make_csr(runner.pop)
        assert (await _refused(broker, runner, session, pop_csr))[:2] == (400, "csr_key_is_pop_key")
        # a CSR naming another SPIFFE ID
        _, other = make_csr(uris=(f"spiffe://{TRUST_DOMAIN}/admin",))
        assert (await _refused(broker, runner, session, other))[:2] == (403, "identity_not_allowed")
        # a CSR naming this very ID is fine (nothing is copied from it)
        _, same = make_csr(uris=(SPIFFE_ID,))
        status, body, _ = await ask_identity(runner, session, same)
        assert status == 201, body
        # a CSR whose signature does not verify: one bit of the signature flipped
        der = bytearray(
            x509.load_pem_x509_csr(good.encode()).public_bytes(serialization.Encoding.DER)
        )
        der[-5] ^= 0x01
        bad = base64.b64encode(bytes(der)).decode()
        assert (await _refused(broker, runner, session, bad))[:2] == (400, "csr_signature_invalid")
        assert (await _refused(broker, runner, session, "not a csr"))[:2] == (400, "csr_invalid")
        # a CSR for another kind of key
        p384 = ec.generate_private_key(ec.SECP384R1())
        csr384 = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .sign(p384, hashes.SHA256())
            .public_bytes(serialization.Encoding.PEM)
            .decode()
        )
        assert (await _refused(broker, runner, session, csr384))[:2] == (400, "csr_key_invalid")
        # a key algorithm cryptography does not know (was a 500 internal_error)
        unknown = _unknown_key_algorithm(good)
        assert (await _refused(broker, runner, session, unknown))[:2] == (400, "csr_key_invalid")
        # the EAR without a proof
        status, code, _ = await _refused(broker, runner, session, good, proof=None)
        assert (status, code) == (401, "dpop_proof_invalid")
        # a proof made for the release route, not this one
        wrong_route = runner.proof()
        status, code, _ = await _refused(broker, runner, session, good, proof=wrong_route)
        assert (status, code) == (401, "dpop_htu_mismatch")
        # an expired EAR (re-signed by the broker's own key, exp in the past)
        past = int((datetime.now(UTC) - timedelta(minutes=5)).timestamp())
        expired = mint(runner, exp=past, iat=past - 60)
        status, code, _ = await _refused(
            broker,
            runner,
            session,
            good,
            authorization=f"DPoP {expired}",
            proof=runner.proof(htu=broker.url + "/v1/identity", token=expired),
        )
        assert (status, code) == (401, "token_expired")
        # a revoked EAR: no certificate (and so no renewal)
        jti = json.loads(base64.urlsafe_b64decode(runner.token.split(".")[1] + "=="))["jti"]
        status, revoked = await admin_post(
            broker, f"/v1/admin/attestations/{jti}/revoke", {"reason": "identity test"}
        )
        assert status == 200, revoked
        status, code, record = await _refused(broker, runner, session, good)
        assert (status, code) == (401, "attestation_revoked")
        assert record["attestation"]["jti"] == jti


def _unknown_key_algorithm(csr: str) -> str:
    """``csr`` with its key's algorithm id-ecPublicKey (1.2.840.10045.2.1) made
    1.2.840.10045.2.5, as base64 DER (its signature no longer matters: the key is read first)."""
    der = bytearray(x509.load_pem_x509_csr(csr.encode()).public_bytes(serialization.Encoding.DER))
    der[der.find(bytes.fromhex("06072a8648ce3d0201")) + 8] = 0x05
    return base64.b64encode(bytes(der)).decode()


async def test_an_image_the_policy_maps_to_no_identity_gets_none(
    start_broker: Callable[..., Any],
) -> None:
    broker = await identity_broker(start_broker)
    data_file = broker.workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text())
    data["identities"] = {}
    data_file.write_text(json.dumps(data))
    status, body = await admin_post(broker, "/v1/admin/policy/reload")
    assert status == 200, body
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        _, csr = make_csr()
        status, code, record = await _refused(broker, runner, session, csr)
    assert (status, code) == (403, "identity_denied")
    assert any("has no workload identity" in r for r in record["reasons"])
    assert record["input_digest"] is not None
    assert record["spiffe_id"] is None


async def test_a_wildcard_path_from_the_policy_gives_no_identity(
    start_broker: Callable[..., Any],
) -> None:
    """X509-SVID §2: no wildcards. A policy (or its data) that maps an image to a path with
    ``*`` gets no certificate for it: the broker refuses the path, whatever the policy says."""
    broker = await identity_broker(start_broker)
    data_file = broker.workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text())
    data["identities"] = dict.fromkeys(data["identities"], "shards/*")
    data_file.write_text(json.dumps(data))
    status, body = await admin_post(broker, "/v1/admin/policy/reload")
    assert status == 200, body
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        status, code, record = await _refused(broker, runner, session, make_csr()[1])
    assert (status, code) == (403, "identity_denied")
    assert record["reasons"] == [
        "the identity policy's spiffe_path: the SPIFFE ID path segment '*' is not allowed"
    ]


async def test_identity_is_off_by_default(start_broker: Callable[..., Any]) -> None:
    from tests.integration.attested import attest_broker  # noqa: PLC0415

    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        async with session.get(broker.url + "/v1/identity/bundle", ssl=broker.client_tls) as got:
            assert got.status == 404
            assert (await got.json())["error"]["code"] == "not_found"
        runner = Runner(broker)
        await runner.attest(session)  # a live result: only [identity] being off refuses it
        status, body, _ = await ask_identity(runner, session, make_csr()[1])
    assert status == 404, body
    assert body["error"]["code"] == "not_found"
    assert not [r for r in broker.records() if r["type"] == "identity"]


@pytest.mark.parametrize("form", ["der-base64"])
async def test_a_csr_may_come_as_base64_der(start_broker: Callable[..., Any], form: str) -> None:
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        _, csr = make_csr()
        der = x509.load_pem_x509_csr(csr.encode()).public_bytes(serialization.Encoding.DER)
        status, body, _ = await ask_identity(runner, session, base64.b64encode(der).decode())
    assert status == 201, (form, body)
