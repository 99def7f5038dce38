"""What one release costs: releases/s of one broker process vs a plain aiohttp JSON echo.

Both servers run as separate processes on 127.0.0.1 (plain HTTP for both, so TLS is not part of
the comparison), and the same client drives them with the same concurrency and body sizes.
Tokens, challenges and runner keys are prepared before the clock starts, so the timed part is the
broker's own work: parse, nonce, RS256 verify, binding, policy (Wasm), key lookup, JWE wrap,
durable (fsync'd, group-committed) log append.

Printed: one process's releases/s and its ratio to the echo's req/s (the issue's target is
>= 0.25), p50/p99 at the run's concurrency and p99 at 64 connections; then the same for
``--workers 2`` (SQLite nonce store, the default with workers > 1) and its ratio to one worker;
then, for 1 and 2 workers, a runner's success rate while two other addresses flood challenges.
Also the *floor* (``floor_server.py``): the same load against a server that makes only the
library calls a release cannot avoid (parse, RS256, X25519 + AES-GCM, one Wasm evaluation, a
record hashed and written) and checks nothing, so the figures show how much of the gap is the
broker's own work and how much the libraries' floor in one Python process.
The load generator shares the machine: on 2 cores it competes with the workers for CPU.
``single_*``: one release at a time (concurrency 1) — the request's p50/p99, each stage's as the
broker reports it (``Server-Timing``: ``body``, each stage of the service, ``total`` from arrival
to answer), the floor server at concurrency 1, the echo server at concurrency 1, and an fsync'd
append of a record of the log's size in the log's directory, all in the same run.

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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.client.unwrap import new_ephemeral_key
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, Workload
from tests.integration.conftest import write_config
from tests.support.constants import ALLOWED, KEY

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


@dataclass
class Run:
    seconds: float
    ok: int
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000


async def drive(url: str, bodies: list[dict[str, Any]], concurrency: int) -> Run:
    """POST every body over ``concurrency`` connections; count 200s, time each request."""
    queue = list(reversed(bodies))
    ok = 0
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal ok
            while queue:
                body = queue.pop()
                sent = time.perf_counter()
                async with session.post(url, json=body) as response:
                    await response.read()
                    ok += response.status == 200
                latencies.append(time.perf_counter() - sent)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Run(time.perf_counter() - started, ok, latencies)


def release_body(issuer: DevIssuer, challenge: dict[str, Any]) -> dict[str, Any]:
    """A runner's release request for ``challenge``: a fresh X25519 key and a token bound to
    the nonce and that key."""
    jwk = public_jwk(new_ephemeral_key("X25519").public_key())
    token = issuer.mint(
        audience=challenge["audience"],
        nonces=[challenge["nonce"], thumbprint(jwk)],
        workload=Workload(image_digest=ALLOWED),
        now=datetime.now(UTC),
    )
    return {"key": KEY, "nonce": challenge["nonce"], "evidence": {"gca": token}, "runner_key": jwk}


async def prepare_releases(url: str, issuer: DevIssuer, count: int) -> list[dict[str, Any]]:
    bodies = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            async with session.post(url + "/v1/challenge", json={}) as response:
                challenge = await response.json()
            bodies.append(release_body(issuer, challenge))
    return bodies


class Broker:
    """``broker serve`` in a subprocess (``workers`` processes on one port)."""

    def __init__(self, config: Path, workers: int, environ: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "BROKER_SERVER_LISTEN": f"127.0.0.1:{self.port}",
            "BROKER_SERVER_PUBLIC_URLS": self.url,  # DPoP proofs name the URL the bench uses
            **(environ or {}),
        }
        command = [*CLI, "serve", "--config", str(config), "--workers", str(workers)]
        self.process = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


CLI = [sys.executable, "-m", "broker.cli"]


async def measure(
    config: Path, issuer: DevIssuer, workers: int, requests: int, concurrency: int
) -> tuple[Run, Run]:
    """(releases at ``concurrency``, releases at 64 connections) on a fresh broker."""
    broker = Broker(config, workers)
    try:
        await wait_ready(broker.url + "/readyz")
        warm = await prepare_releases(broker.url, issuer, 100)
        await drive(broker.url + "/v1/release", warm, concurrency)
        bodies = await prepare_releases(broker.url, issuer, requests)
        main = await drive(broker.url + "/v1/release", bodies, concurrency)
        bodies = await prepare_releases(broker.url, issuer, requests)
        wide = await drive(broker.url + "/v1/release", bodies, 64)
    finally:
        broker.stop()
    for run in (main, wide):
        if run.ok != requests:
            raise SystemExit(f"only {run.ok}/{requests} releases succeeded")
    return main, wide


async def measure_single(
    config: Path, workdir: Path, issuer: DevIssuer, requests: int
) -> dict[str, Any]:
    """One release at a time (concurrency 1), as a runner asking for one key sees it: p50/p99 of
    the request and of each stage the broker reports (``Server-Timing``, ``[server]
    server_timing``), next to an fsync'd append of a record of the same size in the log's own
    directory. The floor server runs beside the broker and the two are asked in turn, blocks of
    ``SINGLE_BLOCK`` requests each: both meet the same moments of this VM (measured minutes
    apart, their p50s drift by 30 %), and each runs warm from its own previous request (one
    request each in turn would make the floor pay for the broker's cold caches)."""
    broker = Broker(config, 1, {"BROKER_SERVER_SERVER_TIMING": "true"})
    floor_url, floor = start_floor(workdir)
    stages: dict[str, list[float]] = {}
    latencies: list[float] = []
    floor_latencies: list[float] = []
    try:
        await wait_ready(broker.url + "/readyz")
        await wait_ready(floor_url + "/readyz")
        challenge = {"audience": "floor", "nonce": "n" * 43}
        floor_bodies = [release_body(issuer, challenge) for _ in range(requests)]
        await drive(floor_url + "/v1/release", floor_bodies[:50], 1)
        warm = await prepare_releases(broker.url, issuer, 50)
        await drive(broker.url + "/v1/release", warm, 1)
        bodies = await prepare_releases(broker.url, issuer, requests)
        async with aiohttp.ClientSession() as session:
            for block in range(0, requests, SINGLE_BLOCK):
                for floor_body in floor_bodies[block : block + SINGLE_BLOCK]:
                    sent = time.perf_counter()
                    async with session.post(floor_url + "/v1/release", json=floor_body) as reply:
                        await reply.read()
                        if reply.status != 200:
                            raise SystemExit(f"single floor: HTTP {reply.status}")
                    floor_latencies.append(time.perf_counter() - sent)
                for body in bodies[block : block + SINGLE_BLOCK]:
                    sent = time.perf_counter()
                    async with session.post(broker.url + "/v1/release", json=body) as reply:
                        await reply.read()
                        if reply.status != 200:
                            raise SystemExit(f"single: HTTP {reply.status}")
                        timing = reply.headers.get("Server-Timing", "")
                    latencies.append(time.perf_counter() - sent)
                    for part in filter(None, timing.split(",")):
                        name, _, duration = part.strip().partition(";dur=")
                        stages.setdefault(name, []).append(float(duration) / 1000)
    finally:
        broker.stop()
        floor.terminate()
        floor.wait(timeout=30)
    lines = (config.parent / "decisions.log").read_bytes().splitlines()
    record_bytes = sorted(len(line) + 1 for line in lines)[len(lines) // 2]
    fsyncs = fsync_probe(config.parent, requests, record_bytes, gap=0.0)
    # The log's disk idles between two single releases: on this VM's disk a write + fsync
    # after an idle gap costs 2-3x one that follows another (measured; the CPU kept busy does
    # not change it). Probe at the releases' own cadence too: that is the durable floor.
    idle = (
        sorted(latencies)[len(latencies) // 2]
        - sorted(stages.get("log", [0.0]))[len(stages.get("log", [0.0])) // 2]
    )
    paced = fsync_probe(config.parent, min(requests, 300), record_bytes, gap=max(idle, 0.0))

    totals = stages.get("total", [])
    unaccounted = [
        total - sum(values[i] for name, values in stages.items() if name != "total")
        for i, total in enumerate(totals)
    ] or [0.0]

    def p(values: list[float], fraction: float) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000, 3)

    return {
        "single_floor_p50_ms": p(floor_latencies, 0.5),
        "single_floor_p99_ms": p(floor_latencies, 0.99),
        "single_release_p50_ms": p(latencies, 0.5),
        "single_release_p99_ms": p(latencies, 0.99),
        "single_stages_p50_ms": {name: p(values, 0.5) for name, values in stages.items()},
        "single_stages_p99_ms": {name: p(values, 0.99) for name, values in stages.items()},
        # the server's own time (arrival to answer) and what of it no stage names
        "single_server_total_p50_ms": p(stages.get("total", [0.0]), 0.5),
        "single_unaccounted_p50_ms": p(unaccounted, 0.5),
        "record_bytes_p50": record_bytes,
        "fsync_append_record_back_to_back_p50_ms": p(fsyncs, 0.5),
        "fsync_append_record_at_release_cadence_p50_ms": p(paced, 0.5),
        "fsync_append_record_at_release_cadence_p99_ms": p(paced, 0.99),
    }


def fsync_probe(directory: Path, count: int, size: int, *, gap: float) -> list[float]:
    """``write`` + ``fsync`` of one ``size``-byte record (the log's median line), as the log
    appends, in ``directory``, ``gap`` seconds apart: the floor of a durable decision here."""
    path = directory / "fsync-probe.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    record = b"x" * (size - 1) + b"\n"
    times = []
    try:
        for _ in range(count):
            if gap:
                time.sleep(gap)
            started = time.perf_counter()
            os.write(fd, record)
            os.fsync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink()
    return times


SINGLE_BLOCK = 25
FLOOD_SECONDS = 5.0
FLOOD_LIMIT = {"BROKER_SERVER_RATE_LIMIT_PER_IP": "50", "BROKER_SERVER_RATE_LIMIT_BURST": "50"}


async def measure_flood(config: Path, issuer: DevIssuer, workers: int) -> dict[str, float]:
    """A runner releasing one key at a time from 127.0.0.1 while challenge floods come from
    127.0.0.2 and 127.0.0.3 (32 connections each, as fast as they can): the runner's success
    rate, and what the flood sent and was refused (per-address limits of 50/s per worker)."""
    broker = Broker(config, workers, FLOOD_LIMIT)
    statuses: dict[int, int] = {}
    try:
        await wait_ready(broker.url + "/readyz")
        deadline = time.monotonic() + FLOOD_SECONDS

        async def flood(address: str) -> None:
            connector = aiohttp.TCPConnector(local_addr=(address, 0), limit=32)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one() -> None:
                    while time.monotonic() < deadline:
                        async with session.post(broker.url + "/v1/challenge", json={}) as reply:
                            statuses[reply.status] = statuses.get(reply.status, 0) + 1
                            await reply.read()

                await asyncio.gather(*(one() for _ in range(32)))

        flooding = asyncio.gather(flood("127.0.0.2"), flood("127.0.0.3"))
        ok = tried = 0
        async with aiohttp.ClientSession() as runner:
            while time.monotonic() < deadline - 0.5:
                body = (await prepare_releases(broker.url, issuer, 1))[0]
                async with runner.post(broker.url + "/v1/release", json=body) as reply:
                    tried += 1
                    ok += reply.status == 200
        await flooding
    finally:
        broker.stop()
    sent = sum(statuses.values())
    return {
        "runner_success_rate": round(ok / max(tried, 1), 4),
        "runner_releases": tried,
        "flood_requests_per_s": round(sent / FLOOD_SECONDS, 1),
        "flood_refused_429_share": round(statuses.get(429, 0) / max(sent, 1), 3),
    }


def start_floor(workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """``floor_server.py`` on a free port: its URL and process."""
    port = free_port()
    command = [sys.executable, str(ROOT / "bench" / "floor_server.py"), str(port)]
    command += [str(workdir / "jwks.json"), str(workdir / "policies"), str(workdir), KEY, ALLOWED]
    server = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", server


async def measure_floor(workdir: Path, issuer: DevIssuer, requests: int, concurrency: int) -> Run:
    """The same load against ``floor_server.py``: the library calls of a release, no glue."""
    url, server = start_floor(workdir)
    try:
        await wait_ready(url + "/readyz")
        challenge = {"audience": "floor", "nonce": "n" * 43}
        await drive(url + "/v1/release", [release_body(issuer, challenge)] * 100, concurrency)
        bodies = [release_body(issuer, challenge) for _ in range(requests)]
        run = await drive(url + "/v1/release", bodies, concurrency)
    finally:
        server.terminate()
        server.wait(timeout=30)
    if run.ok != requests:
        raise SystemExit(f"floor: only {run.ok}/{requests} requests succeeded")
    return run


def bench_workspace(
    workdir: Path,
    issuer: DevIssuer,
    *,
    nonce_ttl_seconds: int,
    extra_toml: str = "",
    gpu_keys: dict[str, object] | None = None,
    keys: tuple[str, ...] = (KEY,),
) -> Path:
    """A plain-HTTP loopback config (TLS is not part of the comparison) with ``keys`` created."""
    config = write_config(
        workdir,
        issuer,
        insecure_http=True,
        nonce_ttl_seconds=nonce_ttl_seconds,
        extra_toml=extra_toml,
        gpu_keys=gpu_keys,
    )
    text = config.read_text().replace(
        'tls_cert = "tls/server.pem"\ntls_key = "tls/server.key"\n', ""
    )
    # the tests' workspace signs checkpoints every 0.2 s; measure the product's default (1 s)
    text = text.replace("checkpoint_seconds = 0.2\n", "")
    config.write_text(text)
    for name in keys:
        subprocess.run(
            [*CLI, "keys", "create", name, "--purpose", "model-weights", "--config", str(config)],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
    return config


async def main(requests: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory(prefix="broker-bench-") as tmp:
        workdir = Path(tmp) / "b"
        issuer = DevIssuer(dev_mode=True)
        config = bench_workspace(workdir, issuer, nonce_ttl_seconds=3600)
        echo_port = free_port()
        echo = subprocess.Popen(
            [sys.executable, "-c", ECHO_APP, str(echo_port)], stderr=subprocess.DEVNULL
        )
        try:
            echo_url = f"http://127.0.0.1:{echo_port}/echo"
            await wait_ready(echo_url)
            sample = await prepare_echo_bodies(requests)
            await drive(echo_url, sample[:100], concurrency)
            echo_run = await drive(echo_url, sample, concurrency)
            echo_single = await drive(echo_url, sample[:500], 1)
        finally:
            echo.terminate()
            echo.wait(timeout=10)
        floor_run = await measure_floor(workdir, issuer, requests, concurrency)
        single = await measure_single(config, workdir, issuer, min(requests, 500))
        one, one_wide = await measure(config, issuer, 1, requests, concurrency)
        two, two_wide = await measure(config, issuer, 2, requests, concurrency)
        flood_one = await measure_flood(config, issuer, 1)
        flood_two = await measure_flood(config, issuer, 2)
        log_lines = (workdir / "decisions.log").read_text().count("\n")
    print(
        json.dumps(
            {
                "requests": requests,
                "concurrency": concurrency,
                "cpus": os.cpu_count(),
                "echo_per_s": round(echo_run.rate, 1),
                "release_per_s": round(one.rate, 1),
                "release_vs_echo": round(one.rate / echo_run.rate, 3),
                "broker_ms_per_release": round(1000 / one.rate, 3),
                "floor_per_s": round(floor_run.rate, 1),
                "floor_vs_echo": round(floor_run.rate / echo_run.rate, 3),
                "release_vs_floor": round(one.rate / floor_run.rate, 3),
                "release_p50_ms": round(one.percentile(0.5), 2),
                "release_p99_ms": round(one.percentile(0.99), 2),
                "release_p50_ms_at_64_connections": round(one_wide.percentile(0.5), 2),
                "release_p99_ms_at_64_connections": round(one_wide.percentile(0.99), 2),
                "tail_p99_vs_p50_at_64_connections": round(
                    one_wide.percentile(0.99) / one_wide.percentile(0.5), 2
                ),
                "two_workers_release_per_s": round(two.rate, 1),
                "two_workers_vs_one": round(two.rate / one.rate, 2),
                "two_workers_p99_ms_at_64_connections": round(two_wide.percentile(0.99), 2),
                "under_challenge_flood_1_worker": flood_one,
                "under_challenge_flood_2_workers": flood_two,
                "decisions_logged": log_lines,
                **single,
                "single_echo_p50_ms": round(echo_single.percentile(0.5), 3),
                "single_release_vs_floor_p50": round(
                    single["single_release_p50_ms"] / single["single_floor_p50_ms"], 2
                ),
                # the floor server writes its record without fsync; with one durable append at
                # the releases' cadence added, the floor of a release that keeps its promise
                "single_release_vs_floor_plus_fsync_p50": round(
                    single["single_release_p50_ms"]
                    / (
                        single["single_floor_p50_ms"]
                        + single["fsync_append_record_at_release_cadence_p50_ms"]
                    ),
                    2,
                ),
            },
            indent=2,
        )
    )


async def prepare_echo_bodies(count: int) -> list[dict[str, Any]]:
    """Bodies shaped like release requests (the echo's work is proportional to the body)."""
    issuer = DevIssuer(dev_mode=True)
    jwk = public_jwk(new_ephemeral_key("X25519").public_key())
    token = issuer.mint(
        audience="bench",
        nonces=["n" * 43, thumbprint(jwk)],
        workload=Workload(image_digest=ALLOWED),
        now=datetime.now(UTC),
    )
    body = {"key": KEY, "nonce": "n" * 43, "evidence": {"gca": token}, "runner_key": jwk}
    return [body] * count


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.concurrency))
