"""Releases on an attestation result (issue 19): ``Authorization: DPoP <EAR>`` + a DPoP proof,
against a live broker. The SDK's ``Attestation`` releases several keys on one attestation; each
key is decided by the release policy in force on the stored claims; a policy reload revokes what
the new attestation policy refuses (in every worker); every hostile presentation is refused with
its own code and leaves a record, never a key.

The hostile EARs are minted here with PyJWT (another JOSE library than the broker's), some with
the broker's own result key read from its workspace, so that each check is shown to be the one
that refuses them."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import sqlite3
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pkcs11
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pkcs11.util.ec import encode_named_curve_parameters

from broker.client import BrokerClientError
from broker.client.sdk import new_runner_key
from broker.core.binding import attestation_thumbprint
from broker.crypto import jwe
from broker.crypto.jwk import public_jwk, thumbprint
from broker.keys.factory import open_key_service
from broker.keys.kek.pkcs11 import parse_pkcs11_uri
from broker.keys.store.base import Purpose
from tests.integration.conftest import (
    HSM_PIN,
    SOFTHSM_MODULE,
    RunningBroker,
    write_statement_key,
)
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.integration.test_attestation_stores import store_uri
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY

ADMIN = "attested-admin-token-5f0e1d"
DENIED_KEY = "models/not-for-this-image"  # created here; no image is allowed for it


async def attest_broker(start_broker: Callable[..., Any], **kwargs: Any) -> RunningBroker:
    environ = {"BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN.encode()).hexdigest()}
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML, workdir_setup=with_result_key, environ=environ, **kwargs
    )
    async with open_key_service(broker.settings.keys) as keys:
        await keys.create(DENIED_KEY, Purpose.MODEL_WEIGHTS, now=datetime.now(UTC))
    return broker


async def full_evidence_dek(broker: RunningBroker, key: str = KEY) -> bytes:
    async with broker.client() as client:
        return (await client.release(key, broker.token_source())).dek


# --- the runner's journey, through the SDK ---------------------------------------------------


@pytest.mark.parametrize(("key_type", "wrap"), [("EC-P256", "jwe"), ("X25519", "hpke")])
async def test_one_attestation_releases_several_keys(
    start_broker: Callable[..., Any], key_type: str, wrap: str
) -> None:
    broker = await attest_broker(start_broker)
    expected = await full_evidence_dek(broker)
    broker = broker.from_now_on()
    async with broker.client() as client:
        attestation = await client.attest(broker.token_source(), key_type=key_type, wrap=wrap)
        first = await attestation.release(KEY)
        again = await attestation.release_many([KEY, DENIED_KEY])
    assert first.dek == expected  # the same key a full-evidence release gives
    released, refused = again[KEY], again[DENIED_KEY]
    assert not isinstance(released, BrokerClientError)
    assert released.dek == expected
    assert isinstance(refused, BrokerClientError)
    assert refused.code == "policy_denied"
    assert refused.details["reasons"]  # the policy's own words
    assert "token" not in repr(attestation).lower()
    records = broker.records()
    (attested,) = [r for r in records if r["type"] == "attestation"]
    releases = [r for r in records if r["type"] == "attested_release"]
    assert [r["result"] for r in releases] == ["allow", "deny"]
    for record in releases:
        assert record["attestation"] == {"jti": attestation.jti, "log_index": attested["index"]}
        assert record["dpop_jti"]
        assert "evidence_digests" not in record  # nothing verified again
    assert [k["result"] for k in releases[1]["keys"]] == ["allow", "deny"]
    allowed = releases[1]["keys"][0]
    assert allowed["policy_digest"].startswith("sha256:")
    assert allowed["input"]["request"]["attestation"]["jti"] == attestation.jti
    assert [r["type"] for r in records].count("release") == 0  # no evidence-based release


async def test_a_key_the_policy_denies_is_refused_with_its_reasons(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker)
    async with broker.client() as client:
        attestation = await client.attest(broker.token_source())
        with pytest.raises(BrokerClientError) as caught:
            await attestation.release(DENIED_KEY)
    assert (caught.value.status, caught.value.code) == (403, "policy_denied")
    assert any(DENIED_KEY in reason for reason in caught.value.details["reasons"])
    assert caught.value.details["keys"] == [
        {"key": DENIED_KEY, "code": "policy_denied", "reasons": caught.value.details["reasons"]}
    ]


async def test_an_auditor_follows_an_attestation_to_every_key_it_released(
    start_broker: Callable[..., Any],
) -> None:
    """``broker audit query --attestation JTI``: the attestation, then one row per key asked on
    it (version, result, policy digest); ``broker policy replay`` re-decides each key."""
    broker = await attest_broker(start_broker)
    async with broker.client() as client:
        attestation = await client.attest(broker.token_source())
        await attestation.release(KEY)
        await attestation.release_many([KEY, DENIED_KEY])
        other = await client.attest(broker.token_source())
        await other.release(KEY)  # another attestation's release: not in the answer
    log = str(broker.settings.audit.log)
    query = await asyncio.to_thread(run, "audit", "query", log, "--attestation", attestation.jti)
    assert query.returncode == 0, query.stderr
    rows = [json.loads(line) for line in query.stdout.splitlines()]
    assert [(r["type"], r.get("key"), r["result"]) for r in rows] == [
        ("attestation", None, "allow"),
        ("attested_release", KEY, "allow"),
        ("attested_release", KEY, "allow"),
        ("attested_release", DENIED_KEY, "deny"),
    ]
    assert {r["attestation_log_index"] for r in rows[1:]} == {rows[0]["index"]}
    assert all(r["version"] == 1 and r["policy_digest"] for r in rows[1:])
    replay = await asyncio.to_thread(
        run, "policy", "replay", "--log", log, "--policy", str(broker.workdir / "policies")
    )
    assert replay.returncode == 0, replay.stderr
    summary = json.loads(replay.stdout.splitlines()[-1])["summary"]
    # 2 attestations + 4 keys decided on results (1 + 2 + 1): each re-decided the same
    assert (summary["decisions"], summary["unchanged"]) == (6, 6)


async def test_the_sdk_renews_before_expiry(start_broker: Callable[..., Any]) -> None:
    broker = await attest_broker(start_broker)
    async with broker.client() as client:
        # renew_seconds longer than the TTL (120 s): every use attests again first
        attestation = await client.attest(broker.token_source(), renew_seconds=600)
        first = attestation.jti
        await attestation.release(KEY)
    assert attestation.renewals == 1
    assert attestation.jti != first


# --- revocation --------------------------------------------------------------------------------


async def admin_post(broker: RunningBroker, path: str, body: Any = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            broker.url + path,
            json=body,
            headers={"Authorization": f"Bearer {ADMIN}"},
            ssl=broker.client_tls,
        ) as response,
    ):
        return response.status, await response.json()


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_a_policy_reload_revokes_results_the_new_policy_refuses(
    start_broker: Callable[..., Any],
) -> None:
    """The image is taken off every allow-list: the reload re-decides the unexpired result with
    the new attestation policy, revokes it in the shared store (every worker refuses it), logs
    the revocation once, and the next release is refused with the reason."""
    broker = await attest_broker(start_broker)
    async with broker.client() as client:
        attestation = await client.attest(broker.token_source())
        await attestation.release(KEY)
        data_path = broker.workdir / "policies" / "broker" / "data.json"
        data = json.loads(data_path.read_text())
        data["images"] = {KEY: ["sha256:" + "ee" * 32]}
        data_path.write_text(json.dumps(data))
        status, body = await admin_post(broker, "/v1/admin/policy/reload")
        assert status == 200, body
        assert body["changed"] is True
        for _ in range(4):  # with two workers, both refuse it
            with pytest.raises(BrokerClientError) as caught:
                await attestation.release(KEY)
            assert (caught.value.status, caught.value.code) == (401, "attestation_revoked")
            assert ALLOWED in caught.value.details["reason"]  # the policy's reason
    (revocation,) = [r for r in broker.records() if r["type"] == "attestation_revoked"]
    assert revocation["jti"] == attestation.jti
    assert revocation["who"]
    assert revocation["reasons"]
    assert attestation.renewals == 0  # a revoked result is not silently replaced


# --- hostile presentations, as raw HTTP ---------------------------------------------------------


class Runner:
    """A runner's attestation made by hand: the EAR and both private keys."""

    def __init__(self, broker: RunningBroker) -> None:
        self.broker = broker
        self.url = broker.url + "/v1/release"
        self.pop = ec.generate_private_key(ec.SECP256R1())
        self.encryption, self.encryption_jwk = new_runner_key("EC-P256")
        self.token = ""
        self.nonce: str | None = None

    async def attest(self, session: aiohttp.ClientSession) -> None:
        broker = self.broker
        async with session.post(broker.url + "/v1/challenge", json={}, ssl=broker.client_tls) as r:
            challenge = await r.json()
        pop_jwk = public_jwk(self.pop.public_key())
        binding = attestation_thumbprint(thumbprint(self.encryption_jwk), thumbprint(pop_jwk))
        evidence = await broker.token_source().token(
            challenge["audience"], [challenge["nonce"], binding]
        )
        body = {
            "nonce": challenge["nonce"],
            "evidence": {"gca": evidence},
            "runner_key": self.encryption_jwk,
            "pop_key": pop_jwk,
        }
        async with session.post(broker.url + "/v1/attest", json=body, ssl=broker.client_tls) as r:
            assert r.status == 201, await r.text()
            self.token = await r.text()
            self.nonce = r.headers["DPoP-Nonce"]

    def proof(
        self,
        *,
        key: ec.EllipticCurvePrivateKey | None = None,
        token: str | None = None,
        **claims: Any,
    ) -> str:
        key = key or self.pop
        values: dict[str, Any] = {
            "jti": str(uuid.uuid4()),
            "htm": "POST",
            "htu": self.url,
            "iat": int(time.time()),
            "ath": ath(token or self.token),
            "nonce": self.nonce,
        }
        values.update(claims)
        values = {k: v for k, v in values.items() if v is not None}
        header = {"typ": "dpop+jwt", "jwk": public_jwk(key.public_key())}
        return jwt.encode(values, key, algorithm="ES256", headers=header)

    async def release(
        self,
        session: aiohttp.ClientSession,
        *,
        authorization: str | None = None,
        proof: str | None = None,
        keys: tuple[str, ...] = (KEY,),
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        headers = {"Authorization": authorization or f"DPoP {self.token}"}
        if proof is not None:
            headers["DPoP"] = proof
        async with session.post(
            self.url, json={"keys": list(keys)}, headers=headers, ssl=self.broker.client_tls
        ) as response:
            return response.status, await response.json(), dict(response.headers)


def ath(token: str) -> str:
    digest = hashlib.sha256(token.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def result_key(broker: RunningBroker) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(
        (broker.workdir / "ear-signing.pem").read_bytes(), password=None
    )
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def mint(
    runner: Runner,
    *,
    key: ec.EllipticCurvePrivateKey | None = None,
    algorithm: str = "ES256",
    secret: Any = None,
    **changes: Any,
) -> str:
    """The runner's EAR with ``changes``, re-signed (by the broker's key unless ``key``)."""
    claims = jwt.decode(runner.token, options={"verify_signature": False})
    claims.update(changes)
    signer = key or result_key(runner.broker)
    kid = thumbprint(public_jwk(signer.public_key()))
    return jwt.encode(
        claims,
        secret if secret is not None else signer,
        algorithm=algorithm,
        headers={"kid": kid, "typ": "eat+jwt"},
    )


async def test_a_proof_made_correctly_releases(start_broker: Callable[..., Any]) -> None:
    """The baseline every hostile case below departs from by one thing."""
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        status, body, headers = await runner.release(session, proof=runner.proof())
        assert status == 200, body
        (entry,) = body["keys"]
        decrypted = jwe.decrypt(entry["wrapped_key"], runner.encryption)  # type: ignore[arg-type]
        assert decrypted.protected_header["policy_digest"] == entry["policy_digest"]
        assert decrypted.protected_header["decision_id"] == body["release_id"]
        assert headers["DPoP-Nonce"] != runner.nonce  # a fresh one for the next proof
        # a nonce is good for several proofs while fresh; each proof only once
        runner.nonce = headers["DPoP-Nonce"]
        status, body, _ = await runner.release(session, proof=runner.proof())
        assert status == 200, body


def _with_token(runner: Runner, token: str) -> dict[str, Any]:
    return {"authorization": f"DPoP {token}", "proof": runner.proof(token=token)}


def _alg_none(token: str) -> str:
    _header, claims, _ = token.split(".")
    none = base64.urlsafe_b64encode(json.dumps({"alg": "none", "typ": "eat+jwt"}).encode())
    return f"{none.rstrip(b'=').decode()}.{claims}."


def _rebound(runner: Runner) -> dict[str, Any]:
    """An attacker who stole the EAR swaps ``cnf.jwk`` for its own key without re-signing."""
    attacker = ec.generate_private_key(ec.SECP256R1())
    header, claims_segment, signature = runner.token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(claims_segment + "=="))
    claims["cnf"] = {"jwk": public_jwk(attacker.public_key())}
    forged_claims = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    forged = f"{header}.{forged_claims}.{signature}"
    return {"authorization": f"DPoP {forged}", "proof": runner.proof(key=attacker, token=forged)}


HOSTILE: dict[str, tuple[Callable[[Runner], dict[str, Any]], str]] = {
    "no proof": (lambda r: {}, "dpop_proof_invalid"),
    "proof by another key": (
        lambda r: {"proof": r.proof(key=ec.generate_private_key(ec.SECP256R1()))},
        "dpop_proof_invalid",
    ),
    "proof for another URL": (
        lambda r: {"proof": r.proof(htu="https://broker.evil.invalid/v1/release")},
        "dpop_proof_invalid",
    ),
    "proof for another method": (lambda r: {"proof": r.proof(htm="GET")}, "dpop_proof_invalid"),
    "proof for another token": (
        lambda r: {"proof": r.proof(ath=ath("another.token.value"))},
        "dpop_proof_invalid",
    ),
    "proof without ath": (lambda r: {"proof": r.proof(ath=None)}, "dpop_proof_invalid"),
    "proof too old": (
        lambda r: {"proof": r.proof(iat=int(time.time()) - 300)},
        "dpop_proof_invalid",
    ),
    "proof without the server nonce": (lambda r: {"proof": r.proof(nonce=None)}, "use_dpop_nonce"),
    "proof with a forged nonce": (
        lambda r: {"proof": r.proof(nonce="A" * 43)},
        "use_dpop_nonce",
    ),
    "expired EAR": (
        lambda r: _with_token(r, mint(r, exp=int(time.time()) - 60, iat=int(time.time()) - 120)),
        "token_expired",
    ),
    "EAR from another broker key": (
        lambda r: _with_token(r, mint(r, key=ec.generate_private_key(ec.SECP256R1()))),
        "token_key_unknown",
    ),
    "EAR for another audience": (
        lambda r: _with_token(r, mint(r, aud="https://other-broker.invalid")),
        "audience_mismatch",
    ),
    "EAR from another issuer": (
        lambda r: _with_token(r, mint(r, iss="https://other-broker.invalid")),
        "audience_mismatch",
    ),
    "EAR alg none": (lambda r: _with_token(r, _alg_none(r.token)), "token_algorithm_forbidden"),
    "EAR alg HS256 keyed with the public key": (
        lambda r: _with_token(
            r,
            mint(
                r,
                algorithm="HS256",
                secret=result_key(r.broker)
                .public_key()
                .public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
                .decode()
                .replace("\n", "")[:40],
            ),
        ),
        "token_algorithm_forbidden",
    ),
    "EAR signed by the broker's key but never issued": (
        lambda r: _with_token(r, mint(r, jti=str(uuid.uuid4()))),
        "attestation_unknown",
    ),
    "EAR re-bound to an attacker's PoP key": (
        _rebound,
        "token_signature_invalid",  # the attacker cannot re-sign the result
    ),
}


async def test_hostile_presentations_are_refused_each_with_its_code(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker)
    seen: dict[str, str] = {}
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        broker = broker.from_now_on()
        for name, (make, code) in HOSTILE.items():
            status, body, headers = await runner.release(session, **make(runner))
            seen[name] = body["error"]["code"]
            assert status == 401, (name, body)
            assert "wrapped_key" not in json.dumps(body), name
            assert headers.get("DPoP-Nonce"), name  # always a nonce for the retry
            if code in {"dpop_proof_invalid", "use_dpop_nonce"}:
                challenge = code.replace("dpop_proof_invalid", "invalid_dpop_proof")
                assert f'error="{challenge}"' in headers.get("WWW-Authenticate", name), name
        # Bearer is not DPoP: a full-evidence release as ever, refused for lacking its fields
        status, body, _ = await runner.release(
            session, authorization=f"Bearer {runner.token}", proof=runner.proof()
        )
        assert (status, body["error"]["code"]) == (400, "bad_request"), body
        # the runner's own, correct request still works after all that
        status, body, _ = await runner.release(session, proof=runner.proof())
        assert status == 200, body
    assert seen == {name: code for name, (_, code) in HOSTILE.items()}
    records = [r for r in broker.records() if r["type"] == "attested_release"]
    assert [r["result"] for r in records] == ["deny"] * len(HOSTILE) + ["allow"]
    assert all(r["keys"] == [] for r in records[:-1])  # refused before any key was decided


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_a_proof_is_good_once_across_workers(start_broker: Callable[..., Any]) -> None:
    """Sent again (several connections: with two workers, both see it), a proof is refused:
    its jti is spent in the store every worker shares."""
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        proof = runner.proof()
        status, body, _ = await runner.release(session, proof=proof)
        assert status == 200, body
        for _ in range(4):
            async with aiohttp.ClientSession() as other:
                status, body, headers = await runner.release(other, proof=proof)
            assert (status, body["error"]["code"]) == (401, "dpop_proof_reused")
            assert 'error="invalid_dpop_proof"' in headers["WWW-Authenticate"]


async def test_a_revoked_result_is_refused_with_the_reason(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        jti = jwt.decode(runner.token, options={"verify_signature": False})["jti"]
        status, body = await admin_post(
            broker, f"/v1/admin/attestations/{jti}/revoke", {"reason": "GPU returned for repair"}
        )
        assert status == 200, body
        status, body, _ = await runner.release(session, proof=runner.proof())
    assert (status, body["error"]["code"]) == (401, "attestation_revoked")
    assert body["error"]["reason"] == "GPU returned for repair"


async def test_releases_on_results_are_off_when_attest_is(broker: RunningBroker) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            broker.url + "/v1/release",
            json={"keys": [KEY]},
            headers={"Authorization": "DPoP x.y.z", "DPoP": "a.b.c"},
            ssl=broker.client_tls,
        ) as response,
    ):
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "not_found"


async def test_results_signed_before_a_key_rotation_keep_working(
    start_broker: Callable[..., Any],
) -> None:
    """After the result key is rotated, the old key stays published and accepted while it is in
    ``[attest] previous_keys`` (the results it signed live at most 900 s); without it, they are
    refused. The store is SQLite, so the restarted broker still holds the attestation."""
    store = '[nonces]\nstore = "sqlite:///attestations.db"\n'
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML + store, workdir_setup=with_result_key
    )
    config = broker.workdir / "broker.toml"
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
    old_kid = jwt.get_unverified_header(runner.token)["kid"]
    write_statement_key(broker.workdir / "ear-signing-new.pem")
    text = config.read_text().replace(
        'signing_key = "ear-signing.pem"',
        'signing_key = "ear-signing-new.pem"\nprevious_keys = ["ear-signing.pem"]',
    )
    config.write_text(text)
    rotated: RunningBroker = await start_broker(reuse=(config, broker.issuer))
    config.write_text(text.replace('previous_keys = ["ear-signing.pem"]\n', ""))
    forgotten: RunningBroker = await start_broker(reuse=(config, broker.issuer))
    async with aiohttp.ClientSession() as session:
        async with session.get(rotated.url + "/.well-known/jwks.json", ssl=rotated.client_tls) as r:
            kids = [k["kid"] for k in (await r.json())["keys"]]
        runner.broker, runner.url = rotated, rotated.url + "/v1/release"
        status, body, _ = await runner.release(session, proof=runner.proof())
        assert status == 200, body
        runner.broker, runner.url = forgotten, forgotten.url + "/v1/release"
        status, body, _ = await runner.release(session, proof=runner.proof())
    assert len(kids) == 2
    assert kids[1] == old_kid  # the current key first, then the previous one
    assert (status, body["error"]["code"]) == (401, "token_key_unknown")


def make_result_key(uri: str) -> None:
    """An EC P-256 key pair on the SoftHSM2 token: the private half sensitive and never
    extractable, both under the URI's label."""
    parsed = parse_pkcs11_uri(uri)
    with (
        pkcs11.lib(str(SOFTHSM_MODULE))
        .get_token(token_label=parsed.token)
        .open(user_pin=HSM_PIN, rw=True) as session
    ):
        parameters = session.create_domain_parameters(
            pkcs11.KeyType.EC,
            {pkcs11.Attribute.EC_PARAMS: encode_named_curve_parameters("secp256r1")},
            local=True,
        )
        parameters.generate_keypair(
            store=True,
            label=parsed.object,
            private_template={
                pkcs11.Attribute.SENSITIVE: True,
                pkcs11.Attribute.EXTRACTABLE: False,
            },
        )


async def test_results_signed_by_a_pkcs11_key(
    start_broker: Callable[..., Any], softhsm: str
) -> None:
    """The result key on an HSM (SoftHSM2, CKM_ECDSA): the EAR verifies with the public half the
    JWKS publishes (PyJWT), and keys are released on it."""
    uri = softhsm.replace("object=kek", "object=results-" + uuid.uuid4().hex[:8])
    await asyncio.to_thread(make_result_key, uri)
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML.replace('"ear-signing.pem"', json.dumps(uri))
    )
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        async with session.get(broker.url + "/.well-known/jwks.json", ssl=broker.client_tls) as r:
            (published,) = (await r.json())["keys"]
        status, body, _ = await runner.release(session, proof=runner.proof())
    claims = jwt.decode(
        runner.token,
        jwt.PyJWK(published).key,
        algorithms=["ES256"],
        audience=broker.settings.server.audience,
    )
    assert jwt.get_unverified_header(runner.token)["kid"] == published["kid"]
    assert claims["jti"]
    assert status == 200, body


@pytest.mark.parametrize("backend", ["redis", "postgresql"])
async def test_two_replicas_share_results_proofs_and_revocations(
    start_broker: Callable[..., Any],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    backend: str,
) -> None:
    """Two replicas on one Redis or PostgreSQL store (and one challenge key, one result key):
    a result attested at one releases at the other, a proof spent at one is refused at the
    other, and a revocation at one is refused by the other at once."""
    url = await store_uri(backend, request, tmp_path)
    environ = {
        "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN.encode()).hexdigest(),
        "BROKER_NONCES_STORE": url,
    }
    first: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML, workdir_setup=with_result_key, environ=environ
    )
    second: RunningBroker = await start_broker(
        reuse=(first.workdir / "broker.toml", first.issuer), environ=environ
    )
    async with aiohttp.ClientSession() as session:
        runner = Runner(first)
        await runner.attest(session)
        # behind one load balancer both answer the public URL ([server] audience + path)
        proof = runner.proof(htu=first.settings.server.audience + "/v1/release")
        runner.broker, runner.url = second, second.url + "/v1/release"
        status, body, _ = await runner.release(session, proof=proof)
        assert status == 200, body  # attested at the first, released at the second
        runner.broker, runner.url = first, first.url + "/v1/release"
        status, body, _ = await runner.release(session, proof=proof)
        assert (status, body["error"]["code"]) == (401, "dpop_proof_reused"), body
        jti = jwt.decode(runner.token, options={"verify_signature": False})["jti"]
        status, answer = await admin_post(
            second, f"/v1/admin/attestations/{jti}/revoke", {"reason": "replica test"}
        )
        assert status == 200, answer
        status, body, _ = await runner.release(session, proof=runner.proof())
    assert (status, body["error"]["code"]) == (401, "attestation_revoked")
    assert body["error"]["reason"] == "replica test"


def tamper(database: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite every stored attestation in the SQLite store as someone with write access would."""
    with sqlite3.connect(database) as db:
        for jti, body in db.execute("SELECT jti, body FROM attestations").fetchall():
            entry = json.loads(body)
            change(entry)
            db.execute("UPDATE attestations SET body = ? WHERE jti = ?", (json.dumps(entry), jti))


@pytest.mark.parametrize("what", ["claims", "encryption key"])
async def test_a_tampered_store_entry_releases_nothing(
    start_broker: Callable[..., Any], what: str
) -> None:
    """The shared store is trusted for a result's status, not its content: an entry whose claims
    were rewritten (to another image) is refused (503 attestation_store_mismatch, an error
    record); a rewritten encryption key is ignored — keys go to the key the signed result names."""
    store = '[nonces]\nstore = "sqlite:///attestations.db"\n'
    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML + store, workdir_setup=with_result_key
    )
    attacker_jwk = public_jwk(ec.generate_private_key(ec.SECP256R1()).public_key())

    def rewrite(entry: dict[str, Any]) -> None:
        if what == "claims":
            entry["policy_input"]["tee"]["workload"]["image_digest"] = "sha256:" + "ee" * 32
        else:
            entry["encryption_jwk"] = attacker_jwk

    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        await asyncio.to_thread(tamper, broker.workdir / "attestations.db", rewrite)
        status, body, _ = await runner.release(session, proof=runner.proof())
    if what == "claims":
        assert (status, body["error"]["code"]) == (503, "attestation_store_mismatch"), body
        assert "wrapped_key" not in json.dumps(body)
        (record,) = [r for r in broker.records() if r["type"] == "attested_release"]
        assert (record["result"], record["code"]) == ("error", "attestation_store_mismatch")
    else:
        assert status == 200, body
        (entry,) = body["keys"]
        decrypted = jwe.decrypt(entry["wrapped_key"], runner.encryption)  # type: ignore[arg-type]
        assert len(decrypted.plaintext) == 32  # the runner's key opens it, not the attacker's
