"""Releases on an attestation result at the peer's speed (issue 31), as raw HTTP against a live
broker: the opt-in stage breakdown (``Server-Timing``), and what each per-worker cache must
never change — an expired result refused though verified before, a revocation seen at once, a
stored entry rewritten after it was prepared still refused."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest

from tests.integration.attested import Runner, admin_post, attest_broker, mint

STAGES = ["proof", "ear", "store", "policy", "unwrap", "wrap", "record", "log"]


async def test_server_timing_names_each_stage_of_a_release_on_a_result(
    start_broker: Callable[..., Any],
) -> None:
    """``BROKER_SERVER_SERVER_TIMING=true``: the eight stages, in order, in milliseconds; off by
    default (where a decision spends its time is the operator's to know, not a client's)."""
    timed = await attest_broker(start_broker, environ={"BROKER_SERVER_SERVER_TIMING": "true"})
    plain = await attest_broker(start_broker)
    for broker, expected in ((timed, True), (plain, False)):
        async with aiohttp.ClientSession() as session:
            runner = Runner(broker)
            await runner.attest(session)
            status, body, headers = await runner.release(session, proof=runner.proof())
        assert status == 200, body
        header = headers.get("Server-Timing")
        if not expected:
            assert header is None
            continue
        assert header is not None
        parts = [part.strip().split(";dur=") for part in header.split(",")]
        assert [name for name, _ in parts] == STAGES
        durations = [float(duration) for _, duration in parts]
        assert all(d >= 0 for d in durations)
        assert all(len(d.split(".")[1]) == 3 for _, d in parts)
        assert durations[STAGES.index("log")] > 0  # the durable append is never free


async def test_an_expired_result_is_refused_though_verified_before(
    start_broker: Callable[..., Any],
) -> None:
    """The worker verified this result (its releases went through); once it expires it is
    refused all the same (``token_expired``): the times are checked at every request."""
    now = [datetime.now(UTC)]
    broker = await attest_broker(start_broker, clock=lambda: now[0])
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        for _ in range(2):
            status, body, _ = await runner.release(session, proof=runner.proof())
            assert status == 200, body
        now[0] += timedelta(seconds=126)  # its TTL (120 s, ATTEST_TOML) and the leeway (5 s)
        status, body, _ = await runner.release(session, proof=runner.proof())
    assert (status, body["error"]["code"]) == (401, "token_expired"), body
    assert "wrapped_key" not in json.dumps(body)


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_a_revocation_is_seen_at_once_with_the_caches_warm(
    start_broker: Callable[..., Any],
) -> None:
    """Every worker has verified the result and prepared its entry; a revocation in the shared
    store refuses the very next release everywhere (the status is read on every fetch)."""
    broker = await attest_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        for _ in range(4):  # several connections: with two workers, both see it
            async with aiohttp.ClientSession() as other:
                status, body, _ = await runner.release(other, proof=runner.proof())
            assert status == 200, body
        jti = jwt.decode(runner.token, options={"verify_signature": False})["jti"]
        status, answer = await admin_post(
            broker, f"/v1/admin/attestations/{jti}/revoke", {"reason": "warm caches"}
        )
        assert status == 200, answer
        for _ in range(4):
            async with aiohttp.ClientSession() as other:
                status, body, _ = await runner.release(other, proof=runner.proof())
            assert (status, body["error"]["code"]) == (401, "attestation_revoked"), body
            assert body["error"]["reason"] == "warm caches"


def _rewrite(database: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Every stored attestation rewritten in the shared SQLite store, as someone with write
    access to it would."""
    with sqlite3.connect(database) as db:
        for jti, body in db.execute("SELECT jti, body FROM attestations").fetchall():
            entry = json.loads(body)
            change(entry)
            db.execute("UPDATE attestations SET body = ? WHERE jti = ?", (json.dumps(entry), jti))


async def test_a_store_entry_rewritten_after_it_was_prepared_is_refused(
    start_broker: Callable[..., Any],
) -> None:
    """The worker prepared the entry (matched to the signed result) at the first release; the
    entry is then rewritten to another image: the next release matches it again and is refused
    (503 ``attestation_store_mismatch``). Rewritten back to what was signed — other bytes than
    before, the same claims — it releases again."""
    store = {"BROKER_NONCES_STORE": "sqlite:///attestations.db"}
    broker = await attest_broker(start_broker, environ=store)
    database = broker.workdir / "attestations.db"
    images: list[str] = []

    def other_image(entry: dict[str, Any]) -> None:
        workload = entry["policy_input"]["tee"]["workload"]
        images.append(workload["image_digest"])
        workload["image_digest"] = "sha256:" + "ee" * 32

    def signed_image(entry: dict[str, Any]) -> None:
        entry["policy_input"]["tee"]["workload"]["image_digest"] = images[0]
        entry["reason"] = "rewritten"  # other bytes, the same claims

    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        status, body, _ = await runner.release(session, proof=runner.proof())
        assert status == 200, body
        await asyncio.to_thread(_rewrite, database, other_image)
        status, body, _ = await runner.release(session, proof=runner.proof())
        assert (status, body["error"]["code"]) == (503, "attestation_store_mismatch"), body
        assert "wrapped_key" not in json.dumps(body)
        await asyncio.to_thread(_rewrite, database, signed_image)
        status, body, _ = await runner.release(session, proof=runner.proof())
        assert status == 200, body
    results = [r["result"] for r in broker.records() if r["type"] == "attested_release"]
    assert results == ["allow", "error", "allow"]


async def test_over_a_networked_store_refusals_keep_their_order(
    start_broker: Callable[..., Any], redis_url: str
) -> None:
    """With Redis the entry is read and the proof's jti spent at once; what the runner is told
    is still decided in the old order: a result this broker signed but never stored is
    ``attestation_unknown`` even for a proof already spent, a revoked one ``attestation_revoked``,
    and only then a replayed proof ``dpop_proof_reused``."""
    # a database of its own on the session's server: its entries stay out of the store tests'
    store = redis_url.rsplit("/", 1)[0] + "/5"
    broker = await attest_broker(start_broker, environ={"BROKER_NONCES_STORE": store})
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        proof = runner.proof()
        status, body, _ = await runner.release(session, proof=proof)
        assert status == 200, body
        status, body, _ = await runner.release(session, proof=proof)
        assert (status, body["error"]["code"]) == (401, "dpop_proof_reused"), body
        never = mint(runner, jti=str(uuid.uuid4()))
        spent = runner.proof(token=never)
        for _ in range(2):  # spent by the first: still unknown, not reused
            status, body, _ = await runner.release(
                session, authorization=f"DPoP {never}", proof=spent
            )
            assert (status, body["error"]["code"]) == (401, "attestation_unknown"), body
        jti = jwt.decode(runner.token, options={"verify_signature": False})["jti"]
        status, answer = await admin_post(
            broker, f"/v1/admin/attestations/{jti}/revoke", {"reason": "ordered"}
        )
        assert status == 200, answer
        status, body, _ = await runner.release(session, proof=proof)  # revoked and replayed
        assert (status, body["error"]["code"]) == (401, "attestation_revoked"), body
