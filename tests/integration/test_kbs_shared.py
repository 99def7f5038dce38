"""KBS sessions are one broker's across processes and replicas (issue 33, item 2): the attested
session store on a real SQLite file, ``redis-server`` and PostgreSQL server (two instances, as
two processes hold them); and a guest that runs its handshake on one replica, attests on
another and fetches on both (its cookie on one, its token on the other), the replicas sharing
the nonce store, the challenge key and the result key, each writing its own log."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.core.refs import store_ref
from broker.stores.kbs_sessions import AttestedSession, KbsSessionStore, open_kbs_session_store
from tests.integration.kbs import RESOURCE, guest, kbs_broker
from tests.support.kbs_client import open_as_guest


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'nonces.db'}"
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


def _open(uri: str) -> KbsSessionStore:
    return open_kbs_session_store(store_ref(uri, "nonces.store"), timeout=10.0, capacity=100)


async def test_an_attested_session_is_read_by_another_instance_until_it_expires(
    store_uri: str,
) -> None:
    first, second = _open(store_uri), _open(store_uri)
    try:
        now = datetime.now(UTC).replace(microsecond=0)
        name = f"session-{now.timestamp()}"
        await first.put(AttestedSession(name, "token.one", now + timedelta(seconds=60)), now)
        read = await second.get(name, now)
        assert read is not None
        assert (read.token, read.expires_at) == ("token.one", now + timedelta(seconds=60))
        await second.put(AttestedSession(name, "token.two", now + timedelta(seconds=30)), now)
        replaced = await first.get(name, now)
        assert replaced is not None
        assert replaced.token == "token.two"
        assert await first.get(name, now + timedelta(seconds=31)) is None  # expired
        assert await first.get("never-stored", now) is None
    finally:
        await first.close()
        await second.close()


@pytest.mark.parametrize("shared", ["sqlite", "redis"])
async def test_a_guest_moves_between_replicas_sharing_the_store(
    start_broker: Callable[..., Any], tmp_path: Path, shared: str, request: pytest.FixtureRequest
) -> None:
    store = (
        f"sqlite://{tmp_path / 'shared-nonces.db'}"
        if shared == "sqlite"
        else request.getfixturevalue("redis_url")
    )
    common = {
        "BROKER_NONCES_STORE": store,
        "BROKER_NONCES_CHALLENGE_KEY": str(tmp_path / "challenge.key"),
    }
    one = await kbs_broker(start_broker, environ={**common, "BROKER_SERVER_REPLICA_ID": "a"})
    other = await start_broker(
        reuse=(one.workdir / "broker.toml", one.issuer),
        environ={
            **common,
            "BROKER_SERVER_REPLICA_ID": "b",
            "BROKER_AUDIT_LOG": str(tmp_path / "b" / "decisions.log"),
        },
    )
    assert one.settings.audit.log != other.settings.audit.log
    moving = guest(one)
    async with aiohttp.ClientSession() as session:
        status, body = await moving.auth(session)
        assert status == 200, body
        moving.url = other.url  # the load balancer sends the attestation to the other replica
        status, body = await moving.attest(session)
        assert status == 200, body
        moving.url = one.url
        status, on_one, _ = await moving.resource(session, RESOURCE)  # the cookie, replica a
        assert status == 200, on_one
        moving.url = other.url
        status, on_other, _ = await moving.resource(
            session, RESOURCE, cookie="", bearer=moving.token
        )
        assert status == 200, on_other
    assert open_as_guest(on_one, moving.private) == open_as_guest(on_other, moving.private)
    assert [r["type"] for r in one.records() if r["type"].startswith("kbs_")] == [
        "kbs_auth",
        "kbs_resource",
    ]
    assert [r["type"] for r in other.records() if r["type"].startswith("kbs_")] == [
        "kbs_attest",
        "kbs_resource",
    ]
    auth = next(r for r in one.records() if r["type"] == "kbs_auth")
    attest = next(r for r in other.records() if r["type"] == "kbs_attest")
    assert auth["kbs"]["session"] == attest["kbs"]["session"]
