"""One policy per broker across ``broker serve --workers 2``.

The security team withdraws an image and reloads through the admin API. The answer comes only
once both workers serve the new digest; from then on no release is decided by the old one,
whichever worker takes the connection; ``/readyz`` shows one digest; the change is one
``policy_change`` record. Before, only the worker that answered reloaded (``changed: true``)
and the other kept releasing under the old policy until a SIGHUP.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import write_config
from tests.support.constants import ALLOWED, KEY
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    ROOT,
    create_key_with_cli,
    free_port,
    release_body,
    wait_ready,
)

pytestmark = pytest.mark.timeout(240)
TOKEN = "policy-admin-workers-4c2e"


def withdraw(policies: Path) -> None:
    path = policies / "broker" / "data.json"
    data = json.loads(path.read_text())
    data["images"][KEY] = []
    path.write_text(json.dumps(data))


async def test_admin_reload_reaches_every_worker_before_it_answers(tmp_path: Path) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    await asyncio.to_thread(create_key_with_cli, config)
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    port = free_port()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config), "--workers", "2"],
        cwd=ROOT,
        env={
            **os.environ,
            "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
            "BROKER_POLICY_RELOAD_SECONDS": "0",  # only the admin API and SIGHUP reload
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        fresh = aiohttp.TCPConnector(force_close=True, limit=16)
        async with aiohttp.ClientSession(connector=fresh) as session:

            async def release() -> tuple[int, Any]:
                body = await release_body(session, url, tls, issuer)
                async with session.post(url + "/v1/release", json=body, ssl=tls) as response:
                    return response.status, await response.json()

            async def readyz() -> tuple[int, str]:
                async with session.get(url + "/healthz", ssl=tls) as response:
                    worker = (await response.json())["worker"]
                admin = {"Authorization": f"Bearer {TOKEN}"}  # /readyz details: admins only
                async with session.get(url + "/readyz", ssl=tls, headers=admin) as response:
                    return worker, (await response.json())["checks"]["policy"]

            before = {digest for _, digest in [await readyz() for _ in range(10)]}
            assert len(before) == 1
            assert {
                status for status, _ in await asyncio.gather(*(release() for _ in range(6)))
            } == {200}
            await asyncio.to_thread(withdraw, tmp_path / "b" / "policies")
            async with session.post(
                url + "/v1/admin/policy/reload",
                headers={"Authorization": f"Bearer {TOKEN}"},
                ssl=tls,
            ) as response:
                answer = await response.json()
                assert response.status == 200, answer
            assert answer["changed"] is True
            assert [w["worker"] for w in answer["workers"]] == [0, 1]
            assert {w["digest"] for w in answer["workers"]} == {answer["active_digest"]}
            # From the answer on, every worker decides with the new policy.
            results = await asyncio.gather(*(release() for _ in range(20)))
            assert {(s, b["error"]["code"]) for s, b in results} == {(403, "policy_denied")}
            seen = [await readyz() for _ in range(20)]
            assert {digest for _, digest in seen} == {answer["active_digest"]}
            assert {worker for worker, _ in seen} == {0, 1}
            # The operator's way back: restore the file, `systemctl reload` (SIGHUP).
            data = tmp_path / "b" / "policies" / "broker" / "data.json"
            restored = json.loads(data.read_text())
            restored["images"][KEY] = [ALLOWED]
            data.write_text(json.dumps(restored))
            supervisor.send_signal(signal.SIGHUP)
            for _ in range(100):
                seen = [await readyz() for _ in range(10)]
                digests = {digest for _, digest in seen}
                if len(digests) == 1 and digests != {answer["active_digest"]}:
                    break  # every worker answering serves the one new policy
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the workers did not all reload on SIGHUP: {seen}")
            assert {s for s, _ in await asyncio.gather(*(release() for _ in range(6)))} == {200}
    finally:
        supervisor.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(supervisor.communicate, timeout=60)
    assert supervisor.returncode == 0, stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "b" / "decisions.log").read_text().splitlines()
    ]
    changes = [r for r in records if r["type"] == "policy_change"]
    assert [(c["trigger"], c["who"][:6]) for c in changes] == [
        ("startup", "broker"),
        ("admin", "token:"),
        ("sighup", "signal"),
    ]
    assert changes[1]["replica"] == records[0]["replica"]  # one record, naming the replica
    denied = [r for r in records if r["type"] == "release" and r["result"] == "deny"]
    assert {r["policy_digest"] for r in denied} == {answer["active_digest"]}
