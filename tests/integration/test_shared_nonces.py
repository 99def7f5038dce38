"""Shared nonce stores on real back ends: a SQLite file, and a real ``redis-server`` and PostgreSQL
server started on loopback.

Single use must hold across processes and replicas, and a store that does not answer must be
``503 nonce_store_unavailable`` — never an accepted nonce.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.config import load_settings
from broker.core.errors import AttestationError, ConfigError, ErrorCode, UpstreamError
from broker.core.refs import store_ref
from broker.stores.nonces import NonceStore
from broker.stores.spent_nonces import open_nonce_store
from tests.integration.conftest import RunningBroker, write_config
from tests.support.health import HEALTH_ENV, readyz
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    create_key_with_cli,
    free_port,
    release_body,
    serve,
    stop_replicas,
    wait_ready,
)

TTL = timedelta(seconds=120)


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'nonces.db'}"
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


KEY_FILE = Path(tempfile.mkdtemp(prefix="broker-nonce-key-")) / "challenge.key"  # one key


async def open_store(uri: str, ttl: timedelta = TTL, capacity: int = 1000) -> NonceStore:
    """As a process opens it: challenges MAC'd with the shared key, spent nonces in ``uri``."""
    # sized for a loaded CI machine (a store that does not answer is tested with its own)
    store = open_nonce_store(
        store_ref(uri, "nonces.store"), ttl=ttl, capacity=capacity, timeout=10.0, key_path=KEY_FILE
    )
    await store.open()
    return store


async def test_single_use_semantics(store_uri: str) -> None:
    store = await open_store(store_uri)
    try:
        now = datetime.now(UTC)
        issued = await store.issue(now)
        await store.consume(issued.nonce, now)
        with pytest.raises(AttestationError) as reused:
            await store.consume(issued.nonce, now)
        assert reused.value.code is ErrorCode.NONCE_REUSED
        with pytest.raises(AttestationError) as unknown:
            await store.consume("A" * 43, now)
        assert unknown.value.code is ErrorCode.NONCE_UNKNOWN
        with pytest.raises(AttestationError) as oversized:
            await store.consume("A" * 10_000, now)
        assert oversized.value.code is ErrorCode.NONCE_UNKNOWN
        await store.check()
    finally:
        await store.close()


async def test_expired_nonce_is_unknown(store_uri: str) -> None:
    store = await open_store(store_uri, ttl=timedelta(seconds=1))
    try:
        now = datetime.now(UTC)
        issued = await store.issue(now)
        with pytest.raises(AttestationError) as expired:
            await store.consume(issued.nonce, issued.expires_at)  # the challenge says when
        assert expired.value.code is ErrorCode.NONCE_UNKNOWN
    finally:
        await store.close()


async def test_one_winner_among_concurrent_uses_through_two_store_instances(
    store_uri: str,
) -> None:
    """Two independent connections (as two processes hold) race 200 uses of one nonce."""
    first, second = await open_store(store_uri), await open_store(store_uri)
    try:
        now = datetime.now(UTC)
        issued = await first.issue(now)

        async def use(store: NonceStore) -> str:
            try:
                await store.consume(issued.nonce, now)
            except AttestationError as exc:
                return exc.code.value
            return "ok"

        outcomes = await asyncio.gather(*(use((first, second)[i % 2]) for i in range(200)))
        assert outcomes.count("ok") == 1
        assert set(outcomes) == {"ok", "nonce_reused"}
    finally:
        await first.close()
        await second.close()


async def test_dpop_jtis_have_their_own_namespace_and_one_winner_across_instances(
    store_uri: str,
) -> None:
    """Issue 27: a proof's ``jti`` is single use across processes and replicas, in a namespace
    of its own: a ``jti`` equal to a live challenge spends nothing of the challenge."""
    first, second = await open_store(store_uri), await open_store(store_uri)
    try:
        await first.check()  # both namespaces' connections open before the race
        await second.check()
        now = datetime.now(UTC)
        issued = await first.issue(now)

        async def use(store: NonceStore) -> str:
            try:
                await store.spend_jti(issued.nonce, issued.expires_at, now)
            except AttestationError as exc:
                return exc.code.value
            return "ok"

        outcomes = await asyncio.gather(*(use((first, second)[i % 2]) for i in range(100)))
        assert sorted(set(outcomes)) == ["nonce_reused", "ok"]
        assert outcomes.count("ok") == 1
        await second.consume(issued.nonce, now)  # the challenge itself: still unspent
    finally:
        await first.close()
        await second.close()


async def test_a_full_jti_space_leaves_challenges_usable(tmp_path: Path) -> None:
    store = await open_store(f"sqlite://{tmp_path / 'n.db'}", capacity=2)
    try:
        now = datetime.now(UTC)
        for index in range(2):
            await store.spend_jti(f"dpop:x:{index}", now + timedelta(seconds=65), now)
        with pytest.raises(UpstreamError) as full:
            await store.spend_jti("dpop:x:2", now + timedelta(seconds=65), now)
        assert full.value.code is ErrorCode.NONCE_STORE_FULL
        await store.consume((await store.issue(now)).nonce, now)
    finally:
        await store.close()


async def test_sqlite_store_bounds_spent_nonces_and_challenges_add_nothing(
    tmp_path: Path,
) -> None:
    store = await open_store(f"sqlite://{tmp_path / 'n.db'}", capacity=2)
    try:
        now = datetime.now(UTC)
        for _ in range(1000):  # a challenge flood: nothing is stored
            await store.issue(now)
        await store.consume((await store.issue(now)).nonce, now)
        await store.consume((await store.issue(now)).nonce, now)
        with pytest.raises(UpstreamError) as full:
            await store.consume((await store.issue(now)).nonce, now)
        assert full.value.code is ErrorCode.NONCE_STORE_FULL
        later = now + TTL + timedelta(seconds=2)  # expired entries free their places
        await store.consume((await store.issue(later)).nonce, later)
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["redis", "sqlite", "postgresql"])
async def test_unreachable_store_is_503_never_accepted(kind: str, tmp_path: Path) -> None:
    if kind == "redis":
        uri = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    elif kind == "postgresql":
        uri = f"postgresql://broker@127.0.0.1:{free_port()}/postgres"
    else:
        uri = f"sqlite://{tmp_path / 'a-directory.db'}"
        (tmp_path / "a-directory.db").mkdir()  # a directory cannot be opened as a database
    store = await open_store(uri)
    try:
        now = datetime.now(UTC)
        valid = (await store.issue(now)).nonce  # handing out needs no store
        for call in (store.consume(valid, now), store.check()):
            with pytest.raises(UpstreamError) as failed:
                await call
            assert failed.value.code is ErrorCode.NONCE_STORE_UNAVAILABLE
    finally:
        await store.close()


def test_config_validates_the_store_uri(tmp_path: Path) -> None:
    config = write_config(tmp_path / "b", dev_issuer())
    for bad in ("postgresql:///db", "sqlite://relative", "redis://", "memcached://h"):
        with pytest.raises(ConfigError, match=r"nonces\.store"):
            load_settings(config, {"BROKER_NONCES_STORE": bad})
    relative = load_settings(config, {"BROKER_NONCES_STORE": "sqlite:///state/nonces.db"})
    assert relative.nonces.store == "sqlite://" + str(tmp_path / "b" / "state" / "nonces.db")
    assert load_settings(config, {}).nonces.store == "memory"


async def test_broker_with_a_dead_redis_refuses_with_503_and_logs_the_denial(
    start_broker: Callable[..., Any],
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    live: RunningBroker = await start_broker()
    broken: RunningBroker = await start_broker(
        reuse=(live.workdir / "broker.toml", live.issuer),
        environ={"BROKER_NONCES_STORE": dead, "BROKER_NONCES_TIMEOUT_SECONDS": "0.5", **HEALTH_ENV},
    )
    async with aiohttp.ClientSession() as session:
        # Handing out a challenge needs no store (it is stateless); using one does.
        async with session.post(
            broken.url + "/v1/challenge", json={}, ssl=broken.client_tls
        ) as response:
            assert response.status == 200
        # A nonce the healthy broker issued is not accepted by the one whose store is down.
        body = await release_body(session, live.url, live.client_tls, live.issuer)
        async with session.post(
            broken.url + "/v1/release", json=body, ssl=broken.client_tls
        ) as response:
            text = await response.text()
            assert response.status == 503, text
            assert json.loads(text)["error"]["code"] == "nonce_store_unavailable"
            assert "wrapped_key" not in text
        status, ready = await readyz(session, broken.url, broken.client_tls)  # as an admin
        assert status == 503
        assert "nonce store" in ready["error"]["message"]
    records = broken.records()
    assert records[-1]["result"] == "error"  # a dependency failed: not a policy denial
    assert records[-1]["code"] == "nonce_store_unavailable"


# --- two replicas: separate processes, separate ports and logs, one store ----------------------


@pytest.mark.timeout(180)
async def test_two_replicas_release_a_nonce_exactly_once(store_uri: str, tmp_path: Path) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    await asyncio.to_thread(create_key_with_cli, config)
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"replica-{i}.log" for i in range(2)]
    replicas = [serve(config, port, log, store_uri) for port, log in zip(ports, logs, strict=True)]
    try:
        for port in ports:
            await asyncio.to_thread(wait_ready, port, tls)
        urls = [f"https://127.0.0.1:{port}" for port in ports]
        connector = aiohttp.TCPConnector(limit=64)
        async with aiohttp.ClientSession(connector=connector) as session:
            # Round-robin: a nonce issued by one replica is honoured by the other.
            body = await release_body(session, urls[0], tls, issuer)
            async with session.post(urls[1] + "/v1/release", json=body, ssl=tls) as response:
                assert response.status == 200, await response.text()

            body = await release_body(session, urls[1], tls, issuer)

            async def attempt(i: int) -> tuple[int, str]:
                async with session.post(
                    urls[i % 2] + "/v1/release", json=body, ssl=tls
                ) as response:
                    payload = await response.json()
                    return response.status, payload.get("error", {}).get("code", "ok")

            results = await asyncio.gather(*(attempt(i) for i in range(200)))
        assert [status for status, _ in results].count(200) == 1
        assert {code for status, code in results if status != 200} == {"nonce_reused"}
    finally:
        await stop_replicas(replicas)
    allows = []
    for log in logs:
        records = [json.loads(line) for line in log.read_text().splitlines()]
        allows += [r for r in records if r.get("type") == "release" and r["result"] == "allow"]
    assert len(allows) == 2  # the round-robin release and the one winner
