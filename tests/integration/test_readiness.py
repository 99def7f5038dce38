"""Cheap, honest health (issue 27, item 5).

``GET /readyz`` used to read every key version on every hit: with Secret Manager 1 + N calls
per hit, so a few hits a second exhausted the project's read quota and releases failed with
``key_store_unavailable``. It now answers from state a background task refreshes with one cheap
call per store per interval, is rate-limited per client address, and shows its details to
admins only.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.keys.factory import open_key_service
from broker.keys.store.base import KeyVersionRecord, Purpose, VersionState
from broker.keys.store.secretmanager import SecretManagerKeyStore
from tests.fakes.google_secretmanager import FakeSecretManager
from tests.integration.conftest import RunningBroker
from tests.support.bundle_server import SCOPE, BundleServer, build, signing_keys
from tests.support.cli import run
from tests.support.constants import KEY
from tests.support.health import HEALTH_ENV, HEALTH_TOKEN, bearer, readyz
from tests.support.processes import free_port

VERSIONS = 40
HITS = 200
INTERVAL = 0.5  # [server] health_interval_seconds (default 5): short, so rounds run meanwhile


async def hammer(broker: RunningBroker, hits: int, **headers: str) -> list[int]:
    connector = aiohttp.TCPConnector(limit=20)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def hit() -> int:
            async with session.get(
                broker.url + "/readyz", ssl=broker.client_tls, headers=headers
            ) as response:
                await response.read()
                return response.status

        return list(await asyncio.gather(*(hit() for _ in range(hits))))


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
@pytest.mark.timeout(180)
async def test_readyz_flood_cannot_exhaust_the_secret_manager_quota(
    start_broker: Any, fake_secretmanager: FakeSecretManager, deployment: str
) -> None:
    broker: RunningBroker = await start_broker(
        environ={
            "BROKER_KEYS_STORE": "secretmanager:projects/broker-test",
            "BROKER_KEYS_SECRETMANAGER_ENDPOINT": fake_secretmanager.endpoint,
            "BROKER_SERVER_HEALTH_INTERVAL_SECONDS": str(INTERVAL),
            **HEALTH_ENV,
        }
    )
    async with open_key_service(broker.settings.keys) as keys:  # 2 keys exist: 40 in all
        for index in range(VERSIONS - 2):
            await keys.create(f"models/filler-{index:02d}", Purpose.GENERIC, now=datetime.now(UTC))
    assert len(fake_secretmanager.secrets) == VERSIONS
    workers = 2 if deployment == "workers" else 1

    seen = len(fake_secretmanager.calls)
    started = time.monotonic()
    statuses: list[int] = []
    # At least HITS anonymous and HITS admin hits, and on until a background round has run.
    while len(statuses) < 2 * HITS or "ListSecrets" not in fake_secretmanager.calls[seen:]:
        assert time.monotonic() - started < 120, "no background round ran"
        statuses += await hammer(broker, HITS // 2) + await hammer(broker, HITS // 2, **bearer())
    elapsed = time.monotonic() - started
    during = fake_secretmanager.calls[seen:]

    assert statuses == [200] * len(statuses)
    # Before: 1 + 40 calls per hit (32,800 for 800 hits). Now: no payload is read for health, at
    # most one list call per worker per interval (plus the round in flight when we began).
    assert "AccessSecretVersion" not in during
    rounds = workers * (math.floor(elapsed / INTERVAL) + 2)
    assert during.count("ListSecrets") <= rounds, (len(during), elapsed)
    assert len(during) <= rounds
    async with broker.client() as client:  # the quota is intact: releases still work
        released = await client.release(KEY, broker.token_source())
    assert len(released.dek) == 32


async def test_readyz_details_only_for_admins(start_broker: Any) -> None:
    broker: RunningBroker = await start_broker(environ=HEALTH_ENV)
    async with aiohttp.ClientSession() as session:
        async with session.get(broker.url + "/readyz", ssl=broker.client_tls) as response:
            assert response.status == 200
            assert await response.json() == {"status": "ready"}  # nothing else, to anyone
        status, body = await readyz(session, broker.url, broker.client_tls)
        assert status == 200
        assert body["status"] == "ready"
        assert body["checks"]["key_store"] == "ok"
        assert body["checks"]["nonce_store"] == "ok"
        assert body["checks"]["kek"] == "local (DEVELOPMENT ONLY)"
        assert body["checks"]["policy"].startswith("sha256:")
        assert body["checks"]["policy_source"]["ok"] is True
        assert body["problems"] == []
        async with session.get(
            broker.url + "/readyz", ssl=broker.client_tls, headers=bearer("not-" + HEALTH_TOKEN)
        ) as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == "unauthorized"


async def test_readyz_of_a_broken_broker_names_the_problem_only_to_admins(
    start_broker: Any,
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    broker: RunningBroker = await start_broker(
        environ={"BROKER_NONCES_STORE": dead, "BROKER_NONCES_TIMEOUT_SECONDS": "0.5", **HEALTH_ENV}
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(broker.url + "/readyz", ssl=broker.client_tls) as response:
            assert response.status == 503
            text = await response.text()
        anonymous = json.loads(text)
        assert anonymous["status"] == "not_ready"
        assert anonymous["error"]["code"] == "not_ready"
        assert anonymous["error"]["message"] == "not ready"
        assert "nonce" not in text
        assert "redis" not in text
        status, body = await readyz(session, broker.url, broker.client_tls)
        async with session.get(broker.url + "/metrics", ssl=broker.client_tls) as response:
            metrics = await response.text()  # what deploy/prometheus/alerts.yml reads
    assert 'broker_store_up{store="nonce"} 0.0' in metrics
    assert 'broker_store_up{store="key"} 1.0' in metrics
    assert status == 503
    assert body["status"] == "not_ready"
    assert body["checks"]["nonce_store"] == "does not answer"
    assert "the nonce store does not answer" in body["error"]["message"]
    assert body["problems"] == ["the nonce store does not answer"]


async def test_readyz_flood_from_one_address_is_rate_limited(start_broker: Any) -> None:
    # 0.01 per second: the burst is all one address gets within this test, however slow.
    broker: RunningBroker = await start_broker(readyz_rate_per_ip=0.01, readyz_burst=3)
    statuses = await hammer(broker, 20)
    assert statuses.count(200) == 3
    assert statuses.count(429) == 17
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + "/readyz", ssl=broker.client_tls) as response,
    ):
        assert response.status == 429
        body = await response.json()
        assert body["error"]["code"] == "rate_limited"
        assert set(body) == {"error"}
        assert body["error"]["request_id"]
        assert int(response.headers["Retry-After"]) >= 1
    # Another address is served: the limit is per client, not a lock-out for everyone.
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(broker.url + "/readyz", ssl=broker.client_tls) as response,
    ):
        assert response.status == 200
        assert await response.json() == {"status": "ready"}


@pytest.fixture
async def bundle_server() -> AsyncIterator[BundleServer]:
    server = BundleServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def serve_signed_bundle(server: BundleServer, workdir: Path, verify: Path) -> None:
    """The workspace's policy as the team's signed bundle (scope ``SCOPE``), on ``server``."""
    shutil.copy(signing_keys(workdir), verify)
    server.body, _ = build(workdir, "v1", allowed=True)


async def test_failing_policy_source_shows_degraded_while_the_last_good_policy_serves(
    start_broker: Any, bundle_server: BundleServer, tmp_path: Path
) -> None:
    server, verify = bundle_server, tmp_path / "verify.pem"
    broker: RunningBroker = await start_broker(
        environ={
            "BROKER_POLICY_BUNDLE_URL": server.url,
            "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": str(verify),
            "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
            "BROKER_POLICY_RELOAD_SECONDS": "1",
            "BROKER_SERVER_HEALTH_INTERVAL_SECONDS": "0.2",
            **HEALTH_ENV,
        },
        workdir_setup=lambda workdir: serve_signed_bundle(server, workdir, verify),
    )
    async with aiohttp.ClientSession() as session:
        status, body = await readyz(session, broker.url, broker.client_tls)
        assert (status, body["status"], body["checks"]["policy_source"]["ok"]) == (
            200,
            "ready",
            True,
        )
        await server.stop()  # the bundle server is down: connections refused
        for _ in range(600):  # a poll fails, then a background round sees it
            status, body = await readyz(session, broker.url, broker.client_tls)
            if body["status"] != "ready":
                break
            await asyncio.sleep(0.05)
        assert (status, body["status"]) == (200, "degraded")  # serving: not a 503
        assert body["checks"]["policy_source"]["ok"] is False
        assert body["warnings"] == ["the policy source fails; the last good policy is serving"]
        async with session.get(broker.url + "/readyz", ssl=broker.client_tls) as response:
            assert (response.status, await response.json()) == (200, {"status": "degraded"})
    async with broker.client() as client:  # the last good policy still decides
        released = await client.release(KEY, broker.token_source())
    assert len(released.dek) == 32


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1.evil.example:9/",
        "http://127.0.0.1@evil.example:9/",
        "http://localhost.evil.example:9/",
    ],
)
async def test_broker_status_never_sends_its_token_over_plain_http_off_loopback(
    tmp_path: Path, url: str
) -> None:
    token = tmp_path / "admin.token"
    token.write_text(HEALTH_TOKEN)
    told = await asyncio.to_thread(run, "status", url, "--token-file", str(token))
    assert told.returncode == 2  # refused before any connection (a prefix check let these by)
    assert "URL" in told.stderr
    assert HEALTH_TOKEN not in told.stdout + told.stderr


async def test_secret_manager_health_probe_is_one_call_and_reads_no_payload(
    fake_secretmanager: FakeSecretManager,
) -> None:
    store = SecretManagerKeyStore("projects/broker-test", endpoint=fake_secretmanager.endpoint)
    await store.open()
    try:
        for version in range(1, VERSIONS + 1):
            await store.add_version(record("models/weights", version, Purpose.MODEL_WEIGHTS))
        seen = len(fake_secretmanager.calls)
        assert await store.has_purpose(Purpose.QUERY) is False
        await store.add_version(record("models/q", 1, Purpose.QUERY))
        probe = len(fake_secretmanager.calls)
        assert await store.has_purpose(Purpose.QUERY) is True  # what /readyz's check asks
        calls = fake_secretmanager.calls
        assert calls[seen:probe] == ["ListSecrets", "CreateSecret", "AddSecretVersion"]
        assert calls[probe:] == ["ListSecrets"]  # 1 call, not 1 + 41 reads of every version
    finally:
        await store.close()


def record(name: str, version: int, purpose: Purpose) -> KeyVersionRecord:
    return KeyVersionRecord(
        name=name,
        version=version,
        purpose=purpose,
        state=VersionState.ENABLED,
        wrapped_dek=b"\x01" * 60,
        kek_ref="local:test",
        created_at=datetime.now(UTC),
    )
