"""Hostile presentations of attestation results (issue 19), as raw HTTP against a live broker:
each refused with its own code and a record, never a key — proofs that are missing, by another
key, for another URL, method or token, stale, without the server nonce, replayed (in one process
and across workers); EARs expired, from another key or audience, with swapped algorithms, never
issued, re-bound; a revoked result; a shared-store entry rewritten behind the broker's back."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.crypto import jwe
from broker.crypto.jwk import public_jwk
from tests.integration.attested import (
    Runner,
    admin_post,
    ath,
    attest_broker,
    mint,
    result_key,
)
from tests.integration.conftest import (
    RunningBroker,
)
from tests.integration.rawhttp import raw_exchange
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.support.constants import KEY

OTHER_SERVICE = "https://other.example/v1/release"


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
        "dpop_key_mismatch",
    ),
    "proof by another key, its claims garbage (never read)": (
        lambda r: {"proof": r.proof(key=ec.generate_private_key(ec.SECP256R1()), iat=1e20, jti=7)},
        "dpop_key_mismatch",
    ),
    "proof for another URL": (
        lambda r: {"proof": r.proof(htu="https://broker.evil.invalid/v1/release")},
        "dpop_htu_mismatch",
    ),
    # the runner's proof for another service, replayed here with that service's Host: the
    # broker compares htu with its configured public URLs, never with one built from Host
    "proof for another service, presented with its Host": (
        lambda r: {"proof": r.proof(htu=OTHER_SERVICE), "host": "other.example"},
        "dpop_htu_mismatch",
    ),
    "proof for the URL the Host header names": (
        lambda r: {
            "proof": r.proof(htu="https://127.0.0.2:7443/v1/release"),
            "host": "127.0.0.2:7443",
        },
        "dpop_htu_mismatch",
    ),
    "proof with iat 1e20": (lambda r: {"proof": r.proof(iat=1e20)}, "dpop_iat_invalid"),
    "proof with iat 10**20": (lambda r: {"proof": r.proof(iat=10**20)}, "dpop_iat_invalid"),
    "proof with a fractional iat": (lambda r: {"proof": r.proof(iat=1.5)}, "dpop_iat_invalid"),
    "proof with iat now plus a half": (
        lambda r: {"proof": r.proof(iat=time.time() + 0.5)},
        "dpop_iat_invalid",
    ),
    "proof with a string iat": (
        lambda r: {"proof": r.proof(iat=str(int(time.time())))},
        "dpop_iat_invalid",
    ),
    "proof with an htu port out of range": (
        lambda r: {"proof": r.proof(htu="https://x:99999/v1/release")},
        "dpop_htu_mismatch",
    ),
    "proof with an object htu": (
        lambda r: {"proof": r.proof(htu={"url": r.url})},
        "dpop_htu_mismatch",
    ),
    "proof with a nested jti": (lambda r: {"proof": r.proof(jti={"a": [1]})}, "dpop_proof_invalid"),
    "proof that is not a JWS": (lambda r: {"proof": "x.y"}, "dpop_proof_invalid"),
    "proof for another method": (lambda r: {"proof": r.proof(htm="GET")}, "dpop_proof_invalid"),
    "proof for another token": (
        lambda r: {"proof": r.proof(ath=ath("another.token.value"))},
        "dpop_proof_invalid",
    ),
    "proof without ath": (lambda r: {"proof": r.proof(ath=None)}, "dpop_proof_invalid"),
    "proof too old": (
        lambda r: {"proof": r.proof(iat=int(time.time()) - 300)},
        "dpop_iat_invalid",
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
            if code.startswith("dpop_") or code == "use_dpop_nonce":
                challenge = "use_dpop_nonce" if code == "use_dpop_nonce" else "invalid_dpop_proof"
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


def _raw_release(broker: RunningBroker, headers: list[bytes], body: bytes) -> bytes:
    return (
        b"POST /v1/release HTTP/1.1\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        % len(body)
        + body
    )


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_a_hostile_host_or_header_bytes_are_refused_with_a_record(
    start_broker: Callable[..., Any],
) -> None:
    """``Host: x:99999`` with ``Authorization: DPoP x`` was an unauthenticated 500 with a
    traceback and no record. Now: a malformed Host is 400 ``host_invalid``,
    bytes that are not ASCII in the proof or the result are 401s, each with a record; other
    routes ignore Host (never a 500)."""
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
    broker = broker.from_now_on()
    keys = json.dumps({"keys": [KEY]}).encode()
    proof = runner.proof().encode()
    cases = {
        "port out of range": ([b"Host: x:99999", b"Authorization: DPoP x"], 400, "host_invalid"),
        "port not a number": ([b"Host: x:y", b"Authorization: DPoP x"], 400, "host_invalid"),
        "user info in Host": (
            [
                b"Host: a@127.0.0.1",
                b"Authorization: DPoP " + runner.token.encode(),
                b"DPoP: " + proof,
            ],
            400,
            "host_invalid",
        ),
        "a proof with bytes that are not ASCII": (
            [
                b"Host: 127.0.0.1",
                b"Authorization: DPoP " + runner.token.encode(),
                b"DPoP: " + proof[:20] + b"\xff\xfe" + proof[20:],
            ],
            401,
            "dpop_proof_invalid",
        ),
        "a result with bytes that are not ASCII": (
            [b"Host: 127.0.0.1", b"Authorization: DPoP \xc3\xa9" + runner.token.encode()],
            401,
            None,
        ),
    }
    for name, (headers, status, code) in cases.items():
        reply = await raw_exchange(
            broker.url, broker.client_tls, _raw_release(broker, headers, keys)
        )
        assert reply.status == status, (name, reply.body)
        error = reply.json()["error"]
        assert code is None or error["code"] == code, (name, error)
        assert "Traceback" not in reply.body.decode(), name
    records = [r for r in broker.records() if r["type"] == "attested_release"]
    assert len(records) == len(cases)  # each refusal is in the log
    assert [r["code"] for r in records[:3]] == ["host_invalid"] * 3
    # two Host fields: refused by the HTTP parser itself (400 bad_request, before any handler)
    two = _raw_release(broker, [b"Host: 127.0.0.1", b"Host: other.example"], keys)
    reply = await raw_exchange(broker.url, broker.client_tls, two)
    assert (reply.status, reply.json()["error"]["code"]) == (400, "bad_request")
    assert all(r["result"] == "deny" and r["keys"] == [] for r in records)
    for path in (b"/v1/challenge", b"/v1/attest", b"/v1/release", b"/healthz"):
        request = (
            b"POST " + path + b" HTTP/1.1\r\nHost: x:99999\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        if path == b"/healthz":
            request = b"GET /healthz HTTP/1.1\r\nHost: x:99999\r\nConnection: close\r\n\r\n"
        reply = await raw_exchange(broker.url, broker.client_tls, request)
        assert reply.status < 500, (path, reply.status, reply.body)
