"""Releases on an attestation result (issue 19), the runner's and the auditor's journeys
through the SDK against a live broker: several keys on one attestation, each decided by the
release policy in force; a denied key with its reasons; renewal; ``broker audit query
--attestation`` and ``policy replay``; a policy reload revoking what the new attestation policy
refuses, in one process and with two workers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from broker.client import BrokerClientError
from tests.integration.attested import (
    DENIED_KEY,
    admin_post,
    attest_broker,
)
from tests.integration.conftest import (
    RunningBroker,
)
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY


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
    assert [r["result"] for r in releases] == ["allow", "partial"]  # one key of two released
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
