"""Health, readiness, metrics, and failing closed when the decision log cannot write."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.client import BrokerClientError
from broker.config import load_settings
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose
from tests.integration.conftest import RunningBroker, write_statement_key
from tests.support.cli import run
from tests.support.constants import KEY
from tests.support.health import HEALTH_ENV, HEALTH_TOKEN, bearer
from tests.support.processes import release_body


async def get(
    broker: RunningBroker, path: str, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + path, ssl=broker.client_tls, headers=headers) as response,
    ):
        return response.status, await response.text()


async def test_health_and_readiness(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker(environ=HEALTH_ENV)
    assert await get(broker, "/healthz") == (200, '{"status": "ok", "worker": 0}')
    assert await get(broker, "/readyz") == (200, '{"status": "ready"}')  # details: admins only
    status, body = await get(broker, "/readyz", bearer())
    assert status == 200
    assert '"kek": "local (DEVELOPMENT ONLY)"' in body
    assert '"policy": "sha256:' in body


async def test_metrics_count_requests_and_decisions(broker: RunningBroker) -> None:
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    status, text = await get(broker, "/metrics")
    assert status == 200
    assert 'broker_release_decisions_total{code="ok",outcome="allow"} 1.0' in text
    assert 'broker_http_requests_total{route="/v1/release",status="200"} 1.0' in text
    assert "broker_release_seconds_bucket" in text


async def test_release_fails_closed_when_the_decision_log_cannot_write(
    start_broker: Any, tmp_path: Path
) -> None:
    # /dev/full: every write fails with ENOSPC, a real I/O error (the start-up policy_change
    # already fails: the broker serves, and refuses every release).
    broker: RunningBroker = await start_broker(
        environ={
            "BROKER_AUDIT_LOG": "/dev/full",
            "BROKER_AUDIT_MASK_KEY": str(tmp_path / "mask.key"),
        }
    )
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source())
        assert (caught.value.status, caught.value.code) == (503, "audit_log_unavailable")
        assert "wrapped_key" not in caught.value.details
        with pytest.raises(BrokerClientError) as again:
            await client.release(KEY, broker.token_source())
        assert again.value.code == "audit_log_unavailable"


async def test_kek_that_cannot_unwrap_fails_closed_with_503(broker: RunningBroker) -> None:
    # Version 2 carries a wrapped DEK this KEK did not make: the KEK cannot answer for it.
    def add_foreign_version() -> None:
        with sqlite3.connect(broker.workdir / "keys.db") as db:
            db.execute(
                "INSERT INTO key_versions (name, version, purpose, state, wrapped_dek, kek_ref, "
                "created_at) SELECT name, 2, purpose, state, ?, kek_ref, created_at "
                "FROM key_versions WHERE name = ? AND version = 1",
                (b"\x01" + bytes(60), KEY),
            )

    await asyncio.to_thread(add_foreign_version)
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source())
    assert (caught.value.status, caught.value.code) == (503, "kek_unavailable")
    assert broker.records()[-1]["result"] == "error"
    assert broker.records()[-1]["code"] == "kek_unavailable"


async def test_readyz_reports_the_live_decision_log_size(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker(environ=HEALTH_ENV)
    before = json.loads((await get(broker, "/readyz", bearer()))[1])["checks"]["audit_log"]
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    after = json.loads((await get(broker, "/readyz", bearer()))[1])["checks"]["audit_log"]
    assert int(after.split()[0]) == int(before.split()[0]) + 1  # not the count at start-up


async def test_query_keys_without_a_statement_key_are_not_ready(start_broker: Any) -> None:
    async def add_query_key(workdir: Path) -> None:
        """Another process, configured with a statement key, adds a query key to the store."""
        settings = await asyncio.to_thread(load_settings, workdir / "broker.toml", {})
        statement = await asyncio.to_thread(write_statement_key, workdir / "statement.pem")
        other = dataclasses.replace(settings.keys, signing_key=statement)
        async with open_key_service(other) as keys:
            await keys.create("models/q", Purpose.QUERY, now=datetime.now(UTC))

    # The store is asked in the background (every 0.2 s here; 5 s by default), never per hit.
    environ = {"BROKER_SERVER_HEALTH_INTERVAL_SECONDS": "0.2", **HEALTH_ENV}
    broker: RunningBroker = await start_broker(environ=environ)
    await add_query_key(broker.workdir)
    for _ in range(600):
        status, body = await get(broker, "/readyz", bearer())
        if status != 200:
            break
        await asyncio.sleep(0.05)
    assert status == 503
    error = json.loads(body)["error"]
    assert error["code"] == "not_ready"
    assert "no [keys] signing_key" in error["message"]
    # What an operator's `broker status` says of the same broker.
    ca = str(broker.workdir / "tls" / "ca.pem")
    token = broker.workdir / "admin.token"
    token.write_text(HEALTH_TOKEN)
    anonymous = json.loads((await asyncio.to_thread(run, "status", broker.url, "--ca", ca)).stdout)
    assert (anonymous["status"], anonymous["problem"], anonymous["checks"]) == (
        "not_ready",
        "not ready",  # the problem is shown to admins only
        {},
    )
    told = await asyncio.to_thread(
        run, "status", broker.url, "--ca", ca, "--token-file", str(token)
    )
    assert told.returncode == 1
    report = json.loads(told.stdout)
    assert (report["reachable"], report["ready"]) == (True, False)
    assert "no [keys] signing_key" in report["problem"]
    assert report["checks"]["policy"].startswith("sha256:")


async def test_broker_status_reports_a_ready_broker_and_its_signed_log(
    start_broker: Any,
) -> None:
    broker: RunningBroker = await start_broker(environ=HEALTH_ENV)
    config = str(broker.workdir / "broker.toml")
    key = (await asyncio.to_thread(run, "audit", "key", "--config", config)).stdout.strip()
    ca = str(broker.workdir / "tls" / "ca.pem")
    token = broker.workdir / "admin.token"
    token.write_text(HEALTH_TOKEN)
    told = await asyncio.to_thread(
        run, "status", broker.url, "--ca", ca, "--key", key, "--token-file", str(token)
    )
    assert told.returncode == 0, told.stdout + told.stderr
    report = json.loads(told.stdout)
    assert report["ready"] is True
    checks = report["checks"]
    assert checks["policy"].startswith("sha256:")
    assert checks["kek"] == "local (DEVELOPMENT ONLY)"
    assert (checks["keys"], checks["nonces"], checks["checkpoints"]) == (
        "sqlite",
        "memory",  # the test workspace's single-process nonce store
        "signed",
    )
    assert checks["audit_log"].endswith("records")
    assert report["checkpoint"]["signature"] == "verified with --key"
    assert report["checkpoint"]["origin"] == broker.settings.audit.origin
    gone = await asyncio.to_thread(run, "status", "http://127.0.0.1:9", "--timeout", "2")
    assert gone.returncode == 3
    assert json.loads(gone.stdout)["reachable"] is False


async def test_server_timing_says_where_a_release_spent_its_time(start_broker: Any) -> None:
    """Opt-in (``[server] server_timing``): every stage of the release, in order, in ms."""
    timed: RunningBroker = await start_broker(server_timing=True)
    plain: RunningBroker = await start_broker()
    for broker, expected in ((timed, True), (plain, False)):
        async with aiohttp.ClientSession() as session:
            body = await release_body(session, broker.url, broker.client_tls, broker.issuer)
            async with session.post(
                broker.url + "/v1/release", json=body, ssl=broker.client_tls
            ) as response:
                assert response.status == 200, await response.text()
                header = response.headers.get("Server-Timing")
        if not expected:
            assert header is None  # off by default: timings are the operator's
            continue
        assert header is not None
        stages = [part.split(";")[0].strip() for part in header.split(",")]
        assert stages == [
            "body", "parse", "evidence", "nonce", "key", "policy", "unwrap", "wrap", "record",
            "log", "total",
        ]  # fmt: skip
        durations = [float(part.split("dur=")[1]) for part in header.split(",")]
        assert all(d >= 0 for d in durations)
        assert durations[-1] >= sum(durations[:-1])  # the total covers every stage
