"""Releases on attestation results as deployed (issue 19): the result key rotated (the old one
kept in ``previous_keys``), the result key on an HSM (SoftHSM2 over PKCS#11), and two replicas
sharing one Redis or PostgreSQL store."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pkcs11
import pytest
from pkcs11.util.ec import encode_named_curve_parameters

from broker.keys.kek.pkcs11 import parse_pkcs11_uri
from tests.integration.attested import (
    ADMIN,
    Runner,
    admin_post,
)
from tests.integration.conftest import (
    HSM_PIN,
    SOFTHSM_MODULE,
    RunningBroker,
    write_statement_key,
)
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.integration.test_attestation_stores import store_uri


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
