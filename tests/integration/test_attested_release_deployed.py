"""Releases on attestation results as deployed (issue 19): the result key rotated (the old one
kept in ``previous_keys``), the result key on an HSM (SoftHSM2 over PKCS#11), and two replicas
sharing one Redis or PostgreSQL store."""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest

from broker.config import load_settings
from tests.integration.attested import (
    ADMIN,
    Runner,
    admin_post,
)
from tests.integration.conftest import (
    RunningBroker,
    write_config,
    write_statement_key,
)
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.integration.test_attestation_stores import store_uri
from tests.support.cli import run
from tests.support.constants import KEY
from tests.support.hsm_custody import make_p256_key_pair
from tests.support.issuers import dev_issuer
from tests.support.processes import free_port, serve, stop_replicas, wait_ready
from tests.support.proxy import round_robin_proxy

OTHER_SERVICE = "https://other.example/v1/release"


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


async def test_results_signed_by_a_pkcs11_key(
    start_broker: Callable[..., Any], softhsm: str
) -> None:
    """The result key on an HSM (SoftHSM2, CKM_ECDSA): the EAR verifies with the public half the
    JWKS publishes (PyJWT), and keys are released on it."""
    uri = softhsm.replace("object=kek", "object=results-" + uuid.uuid4().hex[:8])
    await asyncio.to_thread(make_p256_key_pair, uri)
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


@pytest.mark.timeout(240)
async def test_proofs_are_bound_to_the_service_url_behind_a_proxy(
    database: str, tmp_path: Path
) -> None:
    """As deployed (issue 27): two ``broker serve`` replicas on one PostgreSQL store behind a
    round-robin proxy that rewrites ``Host``, ``[server] public_urls`` = the Service's URL. A
    runner's proofs for the Service release at both replicas; a proof naming a replica's own
    address — the URL its request's Host and socket say, which the broker used to accept — and
    a proof made for another service, presented with that service's Host, are refused with
    ``dpop_htu_mismatch`` and logged."""
    issuer = dev_issuer()
    workdir = tmp_path / "b"
    config = await asyncio.to_thread(write_config, workdir, issuer, extra_toml=ATTEST_TOML)
    await asyncio.to_thread(with_result_key, workdir)
    env = {"BROKER_KEYS_STORE": database, "BROKER_NONCES_STORE": database}
    for args in (
        ("keys", "migrate", "--config", str(config)),
        ("keys", "create", KEY, "--purpose", "model-weights", "--config", str(config)),
    ):
        done = await asyncio.to_thread(run, *args, env=env)
        assert done.returncode == 0, done.stderr
    ports, proxy_port = [free_port(), free_port()], free_port()
    service = f"https://127.0.0.1:{proxy_port}"
    replica_env = {
        **env,
        "BROKER_NONCES_CHALLENGE_KEY": str(tmp_path / "challenge.key"),  # one Secret for all
        "BROKER_SERVER_PUBLIC_URLS": service,  # the Service's URL, and only it
    }
    logs = [tmp_path / f"replica-{i}" / "decisions.log" for i in range(2)]
    replicas = [
        serve(config, port, log, database, {**replica_env, "BROKER_SERVER_REPLICA_ID": f"r{i}"})
        for i, (port, log) in enumerate(zip(ports, logs, strict=True))
    ]
    tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    settings = await asyncio.to_thread(load_settings, config, replica_env)
    try:
        for port in ports:
            await asyncio.to_thread(wait_ready, port, tls)
        upstreams = [f"https://127.0.0.1:{port}" for port in ports]
        async with (
            round_robin_proxy(upstreams, tls_dir=workdir / "tls", port=proxy_port) as answered,
            aiohttp.ClientSession() as session,
        ):
            runner = Runner(RunningBroker(service, settings, issuer, tls, workdir))
            await runner.attest(session)
            for _ in range(3):  # through the Service: whichever replica answers
                status, body, headers = await runner.release(session, proof=runner.proof())
                assert status == 200, body
                runner.nonce = headers["DPoP-Nonce"]
            assert set(answered) == set(upstreams)
            direct = upstreams[0] + "/v1/release"
            runner.url = direct  # straight to a replica, as a pod's address
            refused = {
                "its own address": runner.proof(htu=direct),
                "another service": runner.proof(htu=OTHER_SERVICE),
            }
            status, body, _ = await runner.release(session, proof=refused["its own address"])
            assert (status, body["error"]["code"]) == (401, "dpop_htu_mismatch"), body
            status, body, _ = await runner.release(
                session, proof=refused["another service"], host="other.example"
            )
            assert (status, body["error"]["code"]) == (401, "dpop_htu_mismatch"), body
    finally:
        await stop_replicas(replicas)
    records = [json.loads(line) for line in logs[0].read_text().splitlines()]
    refusals = [r for r in records if r.get("code") == "dpop_htu_mismatch"]
    assert len(refusals) == 2  # each refusal is in the replica's log
    assert all(r["type"] == "attested_release" and r["result"] == "deny" for r in refusals)
