"""Replicas get their policy from a bundle server, as OPA does: HTTPS (here plain HTTP on
loopback) with ETag / If-None-Match, or ``gs://`` (fake-gcs-server), signature required.

Two replicas share PostgreSQL (nonces and keys) and one bundle server. A new signed bundle is
served by both within one poll interval; a tampered one is refused by both (the last good policy
keeps serving, the refusal is logged); polls that find nothing new are answered 304.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import write_config
from tests.support.bundle_server import SCOPE, BundleServer, build, signing_keys
from tests.support.cli import run
from tests.support.health import HEALTH_ENV, bearer
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    ROOT,
    create_key_with_cli,
    fake_gcs_server,
    free_port,
    release_body,
    stop_replicas,
    wait_ready,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
async def bundle_server() -> AsyncIterator[tuple[BundleServer, str]]:
    server = BundleServer()
    await server.start()
    try:
        yield server, server.url
    finally:
        await server.stop()


def serve(config: Path, port: int, log: Path, environ: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config)],
        cwd=ROOT,
        env={
            **os.environ,
            "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
            "BROKER_AUDIT_LOG": str(log),
            **HEALTH_ENV,  # /readyz shows the policy digest to an admin token only
            **environ,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def digests(session: aiohttp.ClientSession, urls: list[str], tls: ssl.SSLContext) -> set[str]:
    seen = set()
    for url in urls:
        async with session.get(url + "/readyz", ssl=tls, headers=bearer()) as response:
            seen.add((await response.json())["checks"]["policy"])
    return seen


async def converge(
    session: aiohttp.ClientSession, urls: list[str], tls: ssl.SSLContext, digest: str
) -> float:
    started = time.monotonic()
    while time.monotonic() - started < 10:
        if await digests(session, urls, tls) == {digest}:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    pytest.fail(f"replicas did not converge on {digest}: {await digests(session, urls, tls)}")


async def test_two_replicas_follow_one_bundle_server(
    bundle_server: tuple[BundleServer, str], database: str, tmp_path: Path
) -> None:
    server, url = bundle_server
    issuer = dev_issuer()
    workdir = tmp_path / "b"
    config = await asyncio.to_thread(write_config, workdir, issuer)
    verify = await asyncio.to_thread(signing_keys, workdir)
    shared = {"BROKER_NONCES_STORE": database, "BROKER_KEYS_STORE": database}
    migrate = await asyncio.to_thread(run, "keys", "migrate", "--config", str(config), env=shared)
    assert migrate.returncode == 0, migrate.stderr
    await asyncio.to_thread(create_key_with_cli, config, shared)
    server.body, first = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    environ = {
        **shared,
        "BROKER_POLICY_BUNDLE_URL": url,
        "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": str(verify),
        "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
        "BROKER_POLICY_RELOAD_SECONDS": "1",
    }
    tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"replica-{i}.log" for i in range(2)]
    replicas = [serve(config, port, log, environ) for port, log in zip(ports, logs, strict=True)]
    urls = [f"https://127.0.0.1:{port}" for port in ports]
    try:
        for port in ports:
            await asyncio.to_thread(wait_ready, port, tls)
        async with aiohttp.ClientSession() as session:
            assert await digests(session, urls, tls) == {first}

            async def statuses() -> set[int]:
                found = set()
                for replica in urls:
                    body = await release_body(session, replica, tls, issuer)
                    async with session.post(replica + "/v1/release", json=body, ssl=tls) as reply:
                        found.add(reply.status)
                return found

            assert await statuses() == {200}
            server.body, second = await asyncio.to_thread(build, workdir, "v2", allowed=False)
            took = await converge(session, urls, tls, second)
            assert took < 1.2 * 1 + 2.0  # one jittered interval, plus the load
            assert await statuses() == {403}
            tampered = bytearray(server.body)
            tampered[len(tampered) // 2] ^= 0x01  # not what the team signed
            server.body = bytes(tampered)
            await asyncio.sleep(3)  # a few polls
            assert await digests(session, urls, tls) == {second}  # the last good policy
    finally:
        await stop_replicas(replicas)
    assert server.answers[304] > 0, server.answers  # conditional polls, not downloads
    for log in logs:
        records = [json.loads(line) for line in log.read_text().splitlines()]
        changes = [(r["trigger"], r["new_digest"], r["revision"]) for r in records
                   if r["type"] == "policy_change"]  # fmt: skip
        assert changes == [("startup", first, "v1"), ("poll", second, "v2")], changes
        refused = [r for r in records if r["type"] == "policy_reload_failed"]
        assert refused, "a tampered bundle was not logged as refused"
        assert all(r["active_digest"] == second for r in refused)


@pytest.fixture
def fake_gcs(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    seed = tmp_path / "gcs"
    (seed / "policies").mkdir(parents=True)
    with fake_gcs_server(seed) as port:
        yield port, seed


def upload(port: int, data: bytes) -> None:
    from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415
    from google.cloud import storage  # type: ignore[attr-defined]  # noqa: PLC0415

    client = storage.Client(
        project="test",
        credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
        client_options={"api_endpoint": f"http://127.0.0.1:{port}"},
    )
    client.bucket("policies").blob("bundle.tar.gz").upload_from_string(data)


async def test_a_broker_follows_a_bundle_in_cloud_storage(
    fake_gcs: tuple[int, Path], tmp_path: Path
) -> None:
    port, _ = fake_gcs
    issuer = dev_issuer()
    workdir = tmp_path / "b"
    config = await asyncio.to_thread(write_config, workdir, issuer)
    verify = await asyncio.to_thread(signing_keys, workdir)
    await asyncio.to_thread(create_key_with_cli, config)
    body, first = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    await asyncio.to_thread(upload, port, body)
    environ: dict[str, Any] = {
        "BROKER_POLICY_BUNDLE_URL": "gs://policies/bundle.tar.gz",
        "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": str(verify),
        "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
        "BROKER_POLICY_RELOAD_SECONDS": "1",
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
    }
    tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    broker_port = free_port()
    process = serve(config, broker_port, tmp_path / "decisions.log", environ)
    try:
        await asyncio.to_thread(wait_ready, broker_port, tls)
        url = f"https://127.0.0.1:{broker_port}"
        async with aiohttp.ClientSession() as session:
            assert await digests(session, [url], tls) == {first}
            body, second = await asyncio.to_thread(build, workdir, "v2", allowed=False)
            await asyncio.to_thread(upload, port, body)
            await converge(session, [url], tls, second)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=60)
    assert process.returncode == 0, stderr[-2000:]
