"""What one release costs: releases/s of one broker process vs a plain aiohttp JSON echo.

Both servers run as separate processes on 127.0.0.1 (plain HTTP for both, so TLS is not part of
the comparison), and the same client drives them with the same concurrency and body sizes.
Tokens, challenges and runner keys are prepared before the clock starts, so the timed part is the
broker's own work: parse, nonce, RS256 verify, binding, policy (regopy), key unwrap, JWE wrap,
durable (fsync'd, group-committed) log append.

    make bench            # or: .venv/bin/python bench/release_bench.py --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.client.sdk import new_ephemeral_key
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, Workload
from tests.integration.conftest import ALLOWED, KEY, write_config

ECHO_APP = """
import sys
from aiohttp import web
async def echo(request):
    return web.json_response(await request.json())
app = web.Application()
app.router.add_post("/echo", echo)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            try:
                async with session.get(url) as response:
                    if response.status in (200, 405):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never became ready")


async def drive(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, int]:
    """POST every body; return (seconds, number of 200 answers)."""
    queue = list(reversed(bodies))
    ok = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal ok
            while queue:
                body = queue.pop()
                async with session.post(url, json=body) as response:
                    await response.read()
                    ok += response.status == 200

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, ok


async def prepare_releases(url: str, issuer: DevIssuer, count: int) -> list[dict[str, Any]]:
    bodies = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            async with session.post(url + "/v1/challenge", json={}) as response:
                challenge = await response.json()
            jwk = public_jwk(new_ephemeral_key("X25519").public_key())
            token = issuer.mint(
                audience=challenge["audience"],
                nonces=[challenge["nonce"], thumbprint(jwk)],
                workload=Workload(image_digest=ALLOWED),
                now=datetime.now(UTC),
            )
            bodies.append(
                {
                    "key": KEY,
                    "nonce": challenge["nonce"],
                    "evidence": {"gca": token},
                    "runner_key": jwk,
                }
            )
    return bodies


async def main(requests: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory(prefix="broker-bench-") as tmp:
        workdir = Path(tmp) / "b"
        issuer = DevIssuer(dev_mode=True)
        config = write_config(workdir, issuer, insecure_http=True, nonce_ttl_seconds=3600)
        text = config.read_text().replace(
            'tls_cert = "tls/server.pem"\ntls_key = "tls/server.key"\n', ""
        )
        config.write_text(text)
        broker_port, echo_port = free_port(), free_port()
        env = {**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{broker_port}"}
        cli = [sys.executable, "-m", "broker.cli"]
        subprocess.run(
            [*cli, "keys", "create", KEY, "--purpose", "model-weights", "--config", str(config)],
            check=True,
            env=env,
            cwd=ROOT,
            capture_output=True,
        )
        broker = subprocess.Popen(
            [*cli, "serve", "--config", str(config)], env=env, cwd=ROOT, stderr=subprocess.DEVNULL
        )
        echo = subprocess.Popen(
            [sys.executable, "-c", ECHO_APP, str(echo_port)], stderr=subprocess.DEVNULL
        )
        try:
            broker_url, echo_url = (
                f"http://127.0.0.1:{broker_port}",
                f"http://127.0.0.1:{echo_port}",
            )
            await wait_ready(broker_url + "/readyz")
            await wait_ready(echo_url + "/echo")
            warm = await prepare_releases(broker_url, issuer, 50)
            await drive(broker_url + "/v1/release", warm, concurrency)
            bodies = await prepare_releases(broker_url, issuer, requests)
            await drive(echo_url + "/echo", bodies[:50], concurrency)
            echo_s, echo_ok = await drive(echo_url + "/echo", bodies, concurrency)
            release_s, release_ok = await drive(broker_url + "/v1/release", bodies, concurrency)
        finally:
            for process in (broker, echo):
                process.terminate()
                process.wait(timeout=10)
        log_lines = (workdir / "decisions.log").read_text().count("\n")
    echo_rate, release_rate = echo_ok / echo_s, release_ok / release_s
    print(
        json.dumps(
            {
                "requests": requests,
                "concurrency": concurrency,
                "cpus": os.cpu_count(),
                "echo_per_s": round(echo_rate, 1),
                "release_per_s": round(release_rate, 1),
                "release_vs_echo": round(release_rate / echo_rate, 3),
                "release_ok": release_ok,
                "decisions_logged": log_lines,
                "broker_ms_per_release": round(1000 / release_rate, 3),
            },
            indent=2,
        )
    )
    if release_ok != requests:
        raise SystemExit(f"only {release_ok}/{requests} releases succeeded")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.concurrency))
