"""One replica, two workers, one view of its log: checkpoints that only grow, proofs from any
worker, all checked by Go's reference code (golang.org/x/mod/sumdb/note and .../tlog); and one
set of metrics (each scrape sums both workers; counters never decrease).

Releases go through ``broker serve --workers 2`` while an auditor polls the checkpoint and asks
for inclusion and consistency proofs on fresh connections (the kernel spreads them over both
workers; ``/healthz`` says which answered). Before the fix, sizes went ``… 38 35 38 …`` and a
proof for an existing record was refused by the worker that had not seen it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import random
import signal
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.crypto.checkpoint import parse_checkpoint
from tests.integration.conftest import write_config
from tests.support.cli import run
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    ROOT,
    create_key_with_cli,
    free_port,
    release_body,
    wait_ready,
)

pytestmark = pytest.mark.timeout(240)
TOKEN = "auditor-token-workers-7d1a"
RELEASES = 60


def body_of(note: str) -> tuple[int, str]:
    checkpoint = parse_checkpoint(note[: note.find("\n\n") + 1])
    return checkpoint.size, base64.b64encode(checkpoint.root).decode()


async def test_checkpoints_only_grow_and_every_proof_verifies_through_two_workers(
    tmp_path: Path, go_verifier: Path
) -> None:
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
            "BROKER_AUDIT_CHECKPOINT_SECONDS": "0.1",
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"https://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    seen: list[str] = []  # checkpoints in the order the auditor saw them
    workers: set[int] = set()
    problems: list[str] = []
    inclusion: dict[str, list[dict[str, Any]]] = {}
    allowed_counts: list[float] = []  # broker_release_decisions_total{allow}, scrape by scrape
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        fresh = aiohttp.TCPConnector(force_close=True, limit=16)
        async with aiohttp.ClientSession(connector=fresh) as session:

            async def get(path: str) -> tuple[int, Any]:
                async with session.get(url + path, ssl=tls, headers=auth) as response:
                    text = await response.text()
                    return response.status, text

            async def release() -> None:
                body = await release_body(session, url, tls, issuer)
                async with session.post(url + "/v1/release", json=body, ssl=tls) as response:
                    assert response.status == 200, await response.text()

            async def audit(until: asyncio.Event) -> None:
                while not until.is_set():
                    workers.add(json.loads((await get("/healthz"))[1])["worker"])
                    allowed_counts.append(allowed(await get("/metrics")))
                    status, note = await get("/v1/log/checkpoint")
                    assert status == 200, note
                    seen.append(note)
                    size, _ = body_of(note)
                    index = random.randrange(size)
                    status, text = await get(
                        f"/v1/log/proof/inclusion?index={index}&tree_size={size}"
                    )
                    if status != 200:
                        problems.append(f"inclusion {index} < {size}: {status} {text[:120]}")
                        continue
                    status, record = await get(f"/v1/log/entries?start={index}&end={index + 1}")
                    assert status == 200, record
                    inclusion.setdefault(note, []).append(
                        {
                            "index": index,
                            "record": record.rstrip("\n"),
                            "hashes": json.loads(text)["hashes"],
                        }
                    )
                    await asyncio.sleep(0.02)

            done = asyncio.Event()
            auditor = asyncio.create_task(audit(done))
            for start in range(0, RELEASES, 10):
                await asyncio.gather(*(release() for _ in range(min(10, RELEASES - start))))
            await asyncio.sleep(0.5)  # one more checkpoint after the last release
            done.set()
            await auditor
            allowed_counts.append(allowed(await get("/metrics")))
            assert allowed_counts == sorted(allowed_counts), allowed_counts  # never decreases
            assert allowed_counts[-1] == RELEASES  # one scrape: the sum over both workers
            sizes = [body_of(note)[0] for note in seen]
            assert sizes == sorted(sizes), f"a checkpoint went backwards: {sizes}"
            assert sizes[-1] >= RELEASES
            assert workers == {0, 1}, workers  # both workers answered the auditor
            distinct = list(dict.fromkeys(seen))
            cases = []
            for later_index, later in enumerate(distinct):
                later_size, _ = body_of(later)
                consistency = []
                for earlier in distinct[:later_index]:
                    first, first_root = body_of(earlier)
                    if not 0 < first < later_size:
                        continue
                    status, text = await get(
                        f"/v1/log/proof/consistency?first={first}&second={later_size}"
                    )
                    assert status == 200, text
                    consistency.append(
                        {
                            "first": first,
                            "first_root": first_root,
                            "hashes": json.loads(text)["hashes"],
                        }
                    )
                cases.append((later, consistency))
    finally:
        supervisor.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(supervisor.communicate, timeout=60)
    assert supervisor.returncode == 0, stderr[-2000:]
    assert not problems, problems
    verifier_key = await asyncio.to_thread(audit_key, config)
    pairs = 0
    for note, consistency in cases:
        case = {
            "verifier_key": verifier_key,
            "checkpoint": note,
            "inclusion": inclusion.get(note, []),
            "consistency": consistency,
        }
        checked = await asyncio.to_thread(
            subprocess.run,
            [str(go_verifier)],
            input=json.dumps(case),
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert checked.returncode == 0, checked.stderr
        pairs += len(consistency)
    assert len(cases) >= 3, len(cases)
    assert pairs >= 3, pairs


def allowed(scrape: tuple[int, str]) -> float:
    status, text = scrape
    assert status == 200, text
    line = 'broker_release_decisions_total{code="ok",outcome="allow"}'
    values = [float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)]
    return values[0] if values else 0.0


def audit_key(config: Path) -> str:
    done = run("audit", "key", "--config", str(config))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
