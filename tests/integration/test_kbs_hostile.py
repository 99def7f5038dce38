"""The KBS facade refuses what issue 33 lists (item 4), each with the status the guest acts on,
kbs-types' ``ErrorInformation`` (exactly ``type`` and ``detail``) and one record: sample evidence
without the switch; report data binding another key or nonce; a replayed nonce; a cookie of
another session, or expired; a Bearer token of another issuer (or a DPoP result, or ours
revoked); a path outside the mapping; version 0.3.0; malformed JSON at every level; a policy
deny (403, or 401 when configured as Trustee answers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from tests.integration.attested import Runner, admin_post
from tests.integration.conftest import RunningBroker
from tests.integration.kbs import DENIED_RESOURCE, RESOURCE, UNMAPPED, guest, kbs_broker
from tests.support.kbs_client import ERROR_TYPE, Guest, report_data, tee_key


def refused(
    broker: RunningBroker,
    answer: tuple[int, Any, Mapping[str, str]],
    status: int,
    code: str,
    kind: str,
    name: str = "AttestationError",
) -> dict[str, Any]:
    """``answer`` is ``status`` with an ``ErrorInformation`` of Trustee's error ``name``, the
    broker's ``code`` in ``Broker-Error-Code``, and its request left one ``kind`` record refusing
    it with that code; that record."""
    got, body, headers = answer
    assert got == status, body
    assert headers["Broker-Error-Code"] == code
    assert isinstance(body, dict), body
    assert set(body) == {"type", "detail"}, body
    assert body["type"] == ERROR_TYPE + name, body
    assert isinstance(body["detail"], str)
    assert body["detail"]
    (record,) = [r for r in broker.records() if r.get("request_id") == headers["X-Request-Id"]]
    assert (record["type"], record["code"]) == (kind, code)
    assert record["result"] == ("error" if status >= 500 else "deny")
    assert headers["Broker-Log-Index"] == str(record["index"])
    return record


NO_TOKEN, VERIFIER, NOT_FOUND = "TokenNotFound", "TokenVerifierError", "InvalidRequestPath"


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


async def test_every_hostile_handshake_and_attestation_is_refused_and_recorded(
    start_broker: Callable[..., Any],
) -> None:
    broker = await kbs_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        await _version_and_shapes(broker, session)
        await _bindings(broker, session)
        await _sessions_and_replays(broker, session)


async def _version_and_shapes(broker: RunningBroker, session: aiohttp.ClientSession) -> None:
    one = guest(broker)
    status, body = await one.auth(session, version="0.3.0")
    assert status == 401
    assert body["detail"] == (
        "Attestation error: RCAR handshake Auth failed: "
        "KBS Client Protocol Version Mismatch: expect =0.4.0 while the request is 0.3.0"
    )
    record = broker.records()[-1]
    assert (record["type"], record["code"], record["kbs"]["protocol"]) == (
        "kbs_auth",
        "kbs_version_mismatch",
        "0.3.0",
    )
    bad_auth: list[Any] = [
        b"{not json",
        b"[]",
        {"version": "0.4.0", "tee": "sample", "extra-params": {}, "more": 1},
        {"version": "0.4.0", "extra-params": {}},
        {"version": 4, "tee": "sample"},
        {"version": "0.4.0", "tee": "sev"},  # not a kbs-types tee
        {"version": "0.4.0", "tee": "sample", "extra-params": [1]},
    ]
    for body in bad_auth:
        answer = await one.call(session, "POST", "/auth", body)
        code = "malformed_json" if body == b"{not json" else "bad_request"
        refused(broker, answer, 401, code, "kbs_auth")
    answer = await one.call(session, "POST", "/auth", b"{}", headers={"Content-Type": "text/plain"})
    refused(broker, answer, 401, "unsupported_media_type", "kbs_auth")
    status, _ = await one.auth(session)
    assert status == 200
    session_hash = broker.records()[-1]["kbs"]["session"]  # a malformed body still names it
    good = one.attestation()
    private_member = {**good["runtime-data"]["tee-pubkey"], "d": "AAAA"}
    off_curve = {**good["runtime-data"]["tee-pubkey"], "y": good["runtime-data"]["tee-pubkey"]["x"]}
    bad_attest: list[tuple[Any, str]] = [
        (b"\xff\xfe", "malformed_json"),
        ({**good, "runtime-data": []}, "bad_request"),
        ({**good, "extra": {}}, "bad_request"),
        ({**good, "tee-evidence": {**good["tee-evidence"], "more": 1}}, "bad_request"),
        (
            {**good, "tee-evidence": {**good["tee-evidence"], "primary_evidence": "q"}},
            "bad_request",
        ),
        (
            {**good, "tee-evidence": {**good["tee-evidence"], "additional_evidence": {}}},
            "bad_request",
        ),
        ({**good, "runtime-data": {"nonce": one.nonce}}, "bad_request"),
        ({**good, "init-data": {"format": "toml"}}, "bad_request"),
        (  # a lone surrogate: no UTF-8, so no report data can be computed over it (was a 500)
            {**good, "tee-evidence": {**good["tee-evidence"], "additional_evidence": "\ud800"}},
            "bad_request",
        ),
        ({**good, "runtime-data": {**good["runtime-data"], "nonce": "\udfff"}}, "bad_request"),
        (
            {**good, "runtime-data": {**good["runtime-data"], "tee-pubkey": private_member}},
            "tee_pubkey_invalid",
        ),
        (
            {**good, "runtime-data": {**good["runtime-data"], "tee-pubkey": off_curve}},
            "tee_pubkey_invalid",
        ),
        (
            {**good, "tee-evidence": {**good["tee-evidence"], "primary_evidence": {"svn": "1"}}},
            "evidence_malformed",
        ),
    ]
    for body, code in bad_attest:
        answer = await one.call(session, "POST", "/attest", body)
        record = refused(broker, answer, 401, code, "kbs_attest")
        assert (record["kbs"]["tee"], record["kbs"]["session"]) == ("sample", session_hash)
    status, _ = await one.attest(session)  # the malformed ones spent nothing
    assert status == 200


async def _bindings(broker: RunningBroker, session: aiohttp.ClientSession) -> None:
    """Report data over another key, another nonce, other additional evidence: refused, the
    nonce not spent (the guest's own evidence then passes)."""
    one = guest(broker)
    await one.auth(session)
    nonce = one.nonce or ""
    _, other_key = tee_key()
    for data in (
        report_data(other_key, nonce),
        report_data(one.tee_pubkey, "another nonce"),
        report_data(one.tee_pubkey, nonce, '{"nvidia": {}}'),
    ):
        answer = await one.call(session, "POST", "/attest", one.attestation(data=data))
        refused(broker, answer, 401, "kbs_report_data_mismatch", "kbs_attest")
    status, body = await one.attest(session)
    assert status == 200, body


async def _sessions_and_replays(broker: RunningBroker, session: aiohttp.ClientSession) -> None:
    first, second = guest(broker), guest(broker)
    await first.auth(session)
    await second.auth(session)
    # the second guest's evidence and nonce with the first guest's cookie
    answer = await second.call(
        session, "POST", "/attest", second.attestation(), cookie=first.cookie
    )
    refused(broker, answer, 401, "kbs_session_invalid", "kbs_attest")
    forged = (first.cookie or "")[:-4] + "AAAA"
    answer = await first.call(session, "POST", "/attest", first.attestation(), cookie=forged)
    refused(broker, answer, 401, "kbs_session_invalid", "kbs_attest")
    answer = await first.call(session, "POST", "/attest", first.attestation(), cookie="")
    refused(broker, answer, 401, "kbs_session_invalid", "kbs_attest")
    replayed = first.attestation()
    status, _ = await first.attest(session, replayed)
    assert status == 200
    answer = await first.call(session, "POST", "/attest", replayed)
    refused(broker, answer, 401, "nonce_reused", "kbs_attest")
    # a session that never attested cannot fetch
    answer = await second.resource(session, RESOURCE)
    refused(broker, answer, 401, "kbs_session_not_attested", "kbs_resource", NO_TOKEN)


async def test_sample_evidence_is_refused_without_the_development_switch(
    start_broker: Callable[..., Any],
) -> None:
    broker = await kbs_broker(start_broker, environ={"BROKER_KBS_ALLOW_SAMPLE_EVIDENCE": "false"})
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        answer = await one.call(session, "POST", "/auth", {"version": "0.4.0", "tee": "sample"})
        record = refused(broker, answer, 401, "kbs_sample_refused", "kbs_auth")
        assert record["kbs"]["tee"] == "sample"
        answer = await one.call(session, "POST", "/auth", {"version": "0.4.0", "tee": "tdx"})
        refused(broker, answer, 401, "kbs_tee_unsupported", "kbs_auth")


async def test_expired_sessions_and_tokens_are_refused(start_broker: Callable[..., Any]) -> None:
    clock = Clock()
    broker = await kbs_broker(start_broker, clock=clock)
    one, late = guest(broker), guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.handshake(session)
        await late.auth(session)
        clock.now += timedelta(seconds=310)  # past session_ttl_seconds, token_ttl_seconds + leeway
        answer = await late.call(session, "POST", "/attest", late.attestation())
        refused(broker, answer, 401, "kbs_session_expired", "kbs_attest")
        answer = await one.resource(session, RESOURCE)
        refused(broker, answer, 401, "kbs_session_expired", "kbs_resource", NO_TOKEN)
        answer = await one.resource(session, RESOURCE, cookie="", bearer=one.token)
        refused(broker, answer, 401, "token_expired", "kbs_resource", VERIFIER)


async def test_tokens_not_ours_or_revoked_release_nothing(
    start_broker: Callable[..., Any],
) -> None:
    broker = await kbs_broker(start_broker)
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.handshake(session)
        claims = jwt.decode(one.token or "", options={"verify_signature": False})
        header = jwt.get_unverified_header(one.token or "")
        stranger = ec.generate_private_key(ec.SECP256R1())
        other_issuer = jwt.encode(claims, stranger, "ES256", headers=header)  # kid: ours
        answer = await one.resource(session, RESOURCE, cookie="", bearer=other_issuer)
        refused(broker, answer, 401, "token_signature_invalid", "kbs_resource", VERIFIER)
        own_key = _result_key(broker)
        renamed = jwt.encode(
            {**claims, "iss": "https://trustee.example"}, own_key, "ES256", headers=header
        )
        answer = await one.resource(session, RESOURCE, cookie="", bearer=renamed)
        refused(broker, answer, 401, "audience_mismatch", "kbs_resource", VERIFIER)
        unknown = jwt.encode(claims, stranger, "ES256", headers={**header, "kid": "nope"})
        answer = await one.resource(session, RESOURCE, cookie="", bearer=unknown)
        refused(broker, answer, 401, "token_key_unknown", "kbs_resource", VERIFIER)
        runner = Runner(broker)  # a result made for DPoP is no KBS token
        await runner.attest(session)
        answer = await one.resource(session, RESOURCE, cookie="", bearer=runner.token)
        refused(broker, answer, 401, "kbs_token_invalid", "kbs_resource", VERIFIER)
        answer = await one.resource(session, RESOURCE, cookie="")
        refused(broker, answer, 401, "kbs_token_missing", "kbs_resource", NO_TOKEN)
        status, body = await admin_post(
            broker, f"/v1/admin/attestations/{claims['jti']}/revoke", {"reason": "kbs test"}
        )
        assert status == 200, body
        answer = await one.resource(session, RESOURCE)
        refused(broker, answer, 401, "attestation_revoked", "kbs_resource", VERIFIER)


def _result_key(broker: RunningBroker) -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key  # noqa: PLC0415

    key = load_pem_private_key((broker.workdir / "ear-signing.pem").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


async def test_paths_outside_the_mapping_and_policy_denies(
    start_broker: Callable[..., Any],
) -> None:
    for deny_status in (403, 401):
        broker = await kbs_broker(
            start_broker, environ={"BROKER_KBS_DENY_STATUS": str(deny_status)}
        )
        one = guest(broker)
        async with aiohttp.ClientSession() as session:
            stranger = Guest(broker.url, ssl=broker.client_tls)
            answer = await stranger.resource(session, UNMAPPED)  # no credentials: no probing
            refused(broker, answer, 401, "kbs_token_missing", "kbs_resource", NO_TOKEN)
            await one.handshake(session)
            for path in (UNMAPPED, "default/two", "a/b/c/d", "default/llama/dek?x=1"):
                answer = await one.resource(session, path)
                record = refused(
                    broker, answer, 404, "kbs_resource_not_found", "kbs_resource", NOT_FOUND
                )
                assert record["key"] is None
            answer = await one.resource(session, DENIED_RESOURCE)
            record = refused(
                broker, answer, deny_status, "policy_denied", "kbs_resource", "PolicyDeny"
            )
            assert record["reasons"]
            assert record["reasons"][0] in answer[1]["detail"]
            answer = await one.call(session, "POST", "/resource/" + RESOURCE, {})
            assert answer[0] == 404  # not a route
            assert answer[1]["type"] == ERROR_TYPE + NOT_FOUND
            assert answer[2]["Broker-Error-Code"] == "not_found"
            for method, path in (("GET", "/auth"), ("PUT", "/attest"), ("GET", "/plugin/x")):
                status, body, _ = await one.call(session, method, path)
                assert (status, set(body)) == (404, {"type", "detail"})  # every answer: its shape


async def test_handshakes_are_rate_limited_per_address(start_broker: Callable[..., Any]) -> None:
    """Every handshake is a record, and a handshake needs nothing: ``[kbs] auth_rate_per_ip``
    bounds what one address can add to the log. Past the burst, 429 in ``ErrorInformation``
    shape with ``Retry-After``, and no record; the other routes are not held up by it."""
    broker = await kbs_broker(
        start_broker,
        environ={"BROKER_KBS_AUTH_RATE_PER_IP": "0.5", "BROKER_KBS_AUTH_RATE_BURST": "3"},
    )
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        before = len(broker.records())
        statuses = [(await one.auth(session))[0] for _ in range(3)]
        answers = [
            await one.call(session, "POST", "/auth", {"version": "0.4.0", "tee": "sample"})
            for _ in range(3)
        ]
        assert statuses + [status for status, _, _ in answers] == [200] * 3 + [429] * 3
        status, body, headers = answers[-1]
        assert set(body) == {"type", "detail"}
        assert body["type"] == ERROR_TYPE + "AttestationError"
        assert headers["Broker-Error-Code"] == "rate_limited"
        assert int(headers["Retry-After"]) >= 1
        assert [r["type"] for r in broker.records()[before:]] == ["kbs_auth"] * 3
        status, body = await one.attest(session)  # the last session that got a cookie
        assert status == 200, body
        status, _, _ = await one.resource(session, RESOURCE)
        assert status == 200


@pytest.mark.parametrize("deployment", ["workers"], indirect=True)
async def test_refusals_under_workers(start_broker: Callable[..., Any]) -> None:
    """``broker serve --workers 2``: a refusal is the same ErrorInformation and one record
    whichever worker answers, and a nonce spent by one worker is spent for the other."""
    broker = (await kbs_broker(start_broker)).from_now_on()
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # each handshake's requests may land on either worker
            one = guest(broker)
            await one.auth(session)
            _, other_key = tee_key()
            answer = await one.call(
                session,
                "POST",
                "/attest",
                one.attestation(data=report_data(other_key, one.nonce or "")),
            )
            refused(broker, answer, 401, "kbs_report_data_mismatch", "kbs_attest")
            answer = await one.call(session, "POST", "/attest", b"{not json")
            refused(broker, answer, 401, "malformed_json", "kbs_attest")
            replayed = one.attestation()
            status, _ = await one.attest(session, replayed)
            assert status == 200
            answer = await one.call(session, "POST", "/attest", replayed)
            refused(broker, answer, 401, "nonce_reused", "kbs_attest")
            answer = await one.resource(session, DENIED_RESOURCE)
            refused(broker, answer, 403, "policy_denied", "kbs_resource", "PolicyDeny")
