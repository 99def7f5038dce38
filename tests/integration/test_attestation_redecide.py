"""Attestation results re-decided whenever the policy in force changes (issue 27): a broker
restarted (``--workers 2``, as deployed) on a stricter attestation policy revokes the result it
no longer allows, with the policy's reason, before a release can use it; a re-decision that
failed (the shared store paused) is retried until it succeeds. The public status endpoint says
only ``revoked``; the reason is for auditors (and key admins)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest

from broker.config import load_settings
from tests.integration.attested import ADMIN, Runner, attest_broker
from tests.integration.conftest import (
    RunningBroker,
    create_test_keys,
    serve_workers,
    write_config,
)
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY
from tests.support.issuers import dev_issuer
from tests.support.processes import free_port, wait_until

AUDITOR = "auditor-only-token-4c1d"
POLICY_ADMIN = "policy-admin-only-token-9e2a"
ROLES_TOML = "".join(
    f'[[admin.tokens]]\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
    f'roles = ["{role}"]\n\n'
    for token, role in ((AUDITOR, "auditor"), (POLICY_ADMIN, "policy-admin"))
)
SHARED_STORE = '[nonces]\nstore = "sqlite:///attestations.db"\n'
WITHDRAWN = {KEY: ["sha256:" + "ee" * 32]}  # the stricter policy: the image is withdrawn


def withdraw_the_image(workdir: Path) -> None:
    data_path = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_path.read_text())
    data["images"] = WITHDRAWN
    data_path.write_text(json.dumps(data))


async def status_of(broker: RunningBroker, jti: str, token: str | None = None) -> Any:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"{broker.url}/v1/attestations/{jti}", headers=headers, ssl=broker.client_tls
        ) as response,
    ):
        return response.status, await response.json()


async def test_a_restart_on_a_stricter_policy_revokes_results_with_the_reason(
    tmp_path: Path,
) -> None:
    """The comment said results were re-decided at start-up; they were not: a replica
    restarted on a bundle that withdrew the image kept serving the result as active."""
    workdir = tmp_path / "broker"
    issuer = dev_issuer()
    config = await asyncio.to_thread(
        write_config, workdir, issuer, extra_toml=ATTEST_TOML + SHARED_STORE + ROLES_TOML
    )
    await asyncio.to_thread(with_result_key, workdir)
    environ = {
        "BROKER_SERVER_WORKERS": "2",
        "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN.encode()).hexdigest(),
    }
    settings = await asyncio.to_thread(load_settings, config, environ)
    await create_test_keys(settings)
    tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))

    def started() -> RunningBroker:
        process, port = serve_workers(config, environ, tls)
        processes.append(process)
        return RunningBroker(f"https://127.0.0.1:{port}", settings, issuer, tls, workdir)

    processes: list[subprocess.Popen[bytes]] = []
    try:
        broker = await asyncio.to_thread(started)
        async with aiohttp.ClientSession() as session:
            runner = Runner(broker)
            await runner.attest(session)
            status, body, _ = await runner.release(session, proof=runner.proof())
            assert status == 200, body
        jti = jwt.decode(runner.token, options={"verify_signature": False})["jti"]
        await asyncio.to_thread(stop, processes.pop())
        await asyncio.to_thread(withdraw_the_image, workdir)
        broker = await asyncio.to_thread(started)  # the same log, store and result key
        status, public = await status_of(broker, jti)
        assert (status, public["status"]) == (200, "revoked")
        assert "reason" not in public  # the public sees the status only
        status, audited = await status_of(broker, jti, AUDITOR)
        assert status == 200
        assert ALLOWED in audited["reason"]  # the policy's own words: the image withdrawn
        status, refused = await status_of(broker, jti, POLICY_ADMIN)
        assert (status, refused["error"]["code"]) == (401, "unauthorized")
        status, refused = await status_of(broker, jti, "not-a-token")
        assert (status, refused["error"]["code"]) == (401, "unauthorized")
        async with aiohttp.ClientSession() as session:
            runner.broker, runner.url = broker, broker.url + "/v1/release"
            status, body, _ = await runner.release(session, proof=runner.proof())
        assert (status, body["error"]["code"]) == (401, "attestation_revoked")
    finally:
        for process in processes:
            await asyncio.to_thread(stop, process)
    revocations = [r for r in broker.records() if r["type"] == "attestation_revoked"]
    assert [(r["jti"], r["trigger"]) for r in revocations] == [(jti, "startup")]  # once, 2 workers
    assert revocations[0]["reasons"]
    query = await asyncio.to_thread(
        run, "audit", "query", str(settings.audit.log), "--attestation", jti
    )
    assert query.returncode == 0, query.stderr
    rows = [json.loads(line) for line in query.stdout.splitlines()]
    kinds = ["attestation", "attested_release", "attestation_revoked", "attested_release"]
    assert [r["type"] for r in rows] == kinds  # released, revoked at start-up, then refused
    assert ALLOWED in rows[2]["reason"]
    assert rows[3]["code"] == "attestation_revoked"


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0


# --- a failed re-decision is retried ----------------------------------------------------------


@pytest.fixture
async def pausable_redis(tmp_path: Path) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of this test's own, to pause (SIGSTOP) and resume (SIGCONT)."""
    port = free_port()
    process = subprocess.Popen(
        [
            *("redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", ""),
            *("--appendonly", "no", "--dir", str(tmp_path)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def pong() -> bool:
        import socket  # noqa: PLC0415

        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    await asyncio.to_thread(wait_until, pong, what="redis-server")
    yield f"redis://127.0.0.1:{port}/0", process
    process.send_signal(signal.SIGCONT)
    process.terminate()
    await asyncio.to_thread(process.wait, 10)


async def test_a_failed_redecision_is_retried_until_it_succeeds(
    start_broker: Callable[..., Any],
    pausable_redis: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """The policy changes while the shared store does not answer: the new policy serves, the
    re-decision fails, and it is retried (with backoff) until the store answers again — then
    the result is revoked, with the reason, without another reload."""
    url, redis = pausable_redis
    broker = await attest_broker(
        start_broker,
        environ={"BROKER_NONCES_STORE": url, "BROKER_NONCES_TIMEOUT_SECONDS": "1"},
    )
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
    jti = jwt.decode(runner.token, options={"verify_signature": False})["jti"]
    await asyncio.to_thread(withdraw_the_image, broker.workdir)
    redis.send_signal(signal.SIGSTOP)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                broker.url + "/v1/admin/policy/reload",
                headers={"Authorization": f"Bearer {ADMIN}"},
                ssl=broker.client_tls,
            ) as response,
        ):
            reload = await response.json()
        assert response.status == 200, reload
        assert reload["changed"] is True  # the stricter policy serves at once
    finally:
        redis.send_signal(signal.SIGCONT)
    assert not [r for r in broker.records() if r["type"] == "attestation_revoked"]
    for _ in range(600):  # retried with backoff: wait for it (generous on a loaded machine)
        status, seen = await status_of(broker, jti, ADMIN)
        if seen.get("status") == "revoked":
            break
        await asyncio.sleep(0.1)
    assert (status, seen["status"]) == (200, "revoked"), seen
    assert ALLOWED in seen["reason"]
    (revocation,) = [r for r in broker.records() if r["type"] == "attestation_revoked"]
    assert (revocation["jti"], revocation["trigger"]) == (jti, "retry")
