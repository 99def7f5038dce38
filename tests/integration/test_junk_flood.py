"""Junk releases lock nobody out (issue 27, item 3).

The finding: each release spent its (genuine, fresh) challenge before its evidence was verified,
so junk releases carrying fresh challenges filled the spent-nonce store and then every release,
attestation and DPoP release got ``503 nonce_store_full`` (9 addresses against one worker
sufficed at the default bound). Now a challenge is spent only once the evidence carrying it
verified: here 9 loopback addresses flood ``broker serve --workers 2`` (default rate limits,
a spent-nonce bound small enough that the flood would fill it many times over) with fresh
challenges and forged or garbage evidence, while a legitimate runner keeps releasing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sqlite3
import ssl
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.dev.issuer import DevIssuer
from tests.integration.conftest import write_config
from tests.support.issuers import dev_issuer
from tests.support.processes import ROOT, create_key_with_cli, free_port, release_body, wait_ready

pytestmark = pytest.mark.timeout(240)
ADDRESSES = [f"127.0.0.{host}" for host in range(2, 11)]  # 9 flooding addresses
CAPACITY = 300  # spent nonces within one TTL: the flood below would fill it within a second
FLOOD_SECONDS = 30.0  # at most; the flood stops once the runner is done
RUNNER_RELEASES = 30
CONCURRENCY = 4  # requests in flight per flooding address


def forged(token: str, nonce: str) -> str:
    """``token`` re-bound to ``nonce`` without re-signing: what an attacker without a TEE can
    make for a challenge it fetched (its signature no longer verifies)."""
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    claims["eat_nonce"] = [nonce, claims["eat_nonce"][-1]]
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{body}.{signature}"


async def flood(
    address: str, url: str, tls: ssl.SSLContext, template: dict[str, Any], stop: asyncio.Event,
    seen: Counter[str],
) -> None:  # fmt: skip
    """Fresh challenges from ``address``, each sent back with forged or garbage evidence."""
    connector = aiohttp.TCPConnector(local_addr=(address, 0), limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(lane: int) -> None:
            sent = 0
            while not stop.is_set():
                async with session.post(url + "/v1/challenge", json={}, ssl=tls) as got:
                    seen[f"challenge {got.status}"] += 1
                    if got.status != 200:
                        await got.read()
                        await asyncio.sleep(0.05)
                        continue
                    nonce = (await got.json())["nonce"]
                sent += 1
                garbage = "x.y.z" if (lane + sent) % 2 else forged(template["token"], nonce)
                body = {**template["body"], "nonce": nonce, "evidence": {"gca": garbage}}
                async with session.post(url + "/v1/release", json=body, ssl=tls) as got:
                    answer = await got.json()
                    seen[f"release {got.status} {answer.get('error', {}).get('code')}"] += 1

        await asyncio.gather(*(one(lane) for lane in range(CONCURRENCY)))


def junk_releases(seen: Counter[str]) -> int:
    """Junk releases the broker answered (not those refused for their rate)."""
    return sum(n for what, n in seen.items() if what.startswith("release") and " 429 " not in what)


async def runner_release(
    runner: aiohttp.ClientSession, url: str, tls: ssl.SSLContext, issuer: DevIssuer
) -> str:
    """One release by the legitimate runner: ``"<status> <code>"``, or the error it met."""
    try:
        body = await release_body(runner, url, tls, issuer)
        async with runner.post(url + "/v1/release", json=body, ssl=tls) as response:
            answer = await response.json()
            return f"{response.status} {answer.get('error', {}).get('code')}"
    except (aiohttp.ClientError, AssertionError, TimeoutError) as exc:
        return type(exc).__name__


async def test_a_junk_release_flood_from_nine_addresses_locks_no_runner_out(
    tmp_path: Path,
) -> None:
    issuer: DevIssuer = dev_issuer()
    config = await asyncio.to_thread(
        write_config,
        tmp_path / "b",
        issuer,
        rate_limit_per_ip=100,  # the defaults (write_config turns them off for other tests)
        rate_limit_burst=200,
        max_outstanding_nonces=CAPACITY,
    )
    await asyncio.to_thread(create_key_with_cli, config)
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    port = free_port()
    stderr = (tmp_path / "broker.stderr").open("w")  # a file: a full pipe would stall the broker
    broker = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config), "--workers", "2"],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    url = f"https://127.0.0.1:{port}"
    seen: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    stop = asyncio.Event()
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        async with aiohttp.ClientSession() as runner:  # the legitimate runner, from 127.0.0.1
            template_body = await release_body(runner, url, tls, issuer)
            template = {"body": template_body, "token": template_body["evidence"]["gca"]}
            flooders = asyncio.gather(
                *(flood(address, url, tls, template, stop, seen) for address in ADDRESSES)
            )
            deadline = time.monotonic() + FLOOD_SECONDS
            # the flood has sent more junk than the bound holds before the runner starts
            while junk_releases(seen) < 2 * CAPACITY and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            before = junk_releases(seen)
            for _ in range(RUNNER_RELEASES):
                outcomes[await runner_release(runner, url, tls, issuer)] += 1
            during = junk_releases(seen) - before
            stop.set()
            await flooders
    finally:
        stop.set()
        broker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(broker.wait, 60)
        stderr.close()
    log = (tmp_path / "broker.stderr").read_text()
    assert broker.returncode == 0, log[-2000:]
    spent = await asyncio.to_thread(count_spent, tmp_path / "b" / "nonces.db")
    releases = sum(n for what, n in seen.items() if what.startswith("release"))
    print(
        f"\njunk flood from {len(ADDRESSES)} addresses: {releases} junk releases "
        f"({junk_releases(seen)} answered, {during} while the runner released), "
        f"{dict(seen)}; runner: {dict(outcomes)} "
        f"({100 * outcomes['200 None'] / RUNNER_RELEASES:.0f} % released); spent nonces: {spent}"
    )
    assert before >= 2 * CAPACITY, seen  # the flood was heavy enough to have filled the store
    assert outcomes == Counter({"200 None": RUNNER_RELEASES}), outcomes  # 100 % success
    assert spent == RUNNER_RELEASES  # only verified evidence spent a nonce
    refused = {what.split(" ", 2)[2] for what in seen if what.startswith("release 401")}
    assert refused <= {"token_signature_invalid", "token_malformed"}, seen
    assert not [what for what in seen if " 5" in what], seen  # never a 5xx, never "store full"


def count_spent(database: Path) -> int:
    with sqlite3.connect(database) as db:
        (count,) = db.execute("SELECT count(*) FROM spent_nonces").fetchone()
    return int(count)
