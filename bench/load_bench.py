"""Load and soak: runners doing full releases (challenge, token, release) for a fixed time.

Each of N connections loops as a runner would: ``POST /v1/challenge``, mint an attestation token
bound to the nonce and a fresh runner key (the development issuer, RS256, in this process), then
``POST /v1/release``. Reported: releases/s, release latency p50/p99, errors (any non-200), and the
broker's resident memory (RSS, all its processes) after warm-up and at the end.

    make soak                                     # a max run, then 2 minutes at 70 % of it
    .venv/bin/python bench/load_bench.py --connections 32 --duration 20
    .venv/bin/python bench/load_bench.py --soak 120 --fraction 0.7 --workers 2

The token minting shares the machine with the broker (on 2 cores it takes a good part of one),
so the max run measures the system, not the broker alone; ``make bench`` measures the broker.
Every run stops by itself; everything talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.release_bench import CLI, bench_workspace, free_port, release_body, wait_ready
from broker.dev.issuer import DevIssuer


@dataclass
class Tally:
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies)
        if not ordered:
            return 0.0
        return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000, 2)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its children (the supervisor's workers)."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for one in pids:
        for line in Path(f"/proc/{one}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


async def runner_loop(
    session: aiohttp.ClientSession,
    url: str,
    issuer: DevIssuer,
    deadline: float,
    tally: Tally,
    pace: asyncio.Queue[bool] | None,
) -> None:
    while time.monotonic() < deadline:
        if pace is not None and not await pace.get():
            return
        try:
            async with session.post(url + "/v1/challenge", json={}) as response:
                challenge = await response.json()
                if response.status != 200:
                    tally.error(f"challenge {response.status}")
                    continue
            body = release_body(issuer, challenge)
            sent = time.perf_counter()
            async with session.post(url + "/v1/release", json=body) as response:
                answer = await response.json()
            tally.latencies.append(time.perf_counter() - sent)
            if response.status == 200:
                tally.ok += 1
            else:
                tally.error(answer.get("error", {}).get("code", str(response.status)))
        except (aiohttp.ClientError, TimeoutError) as exc:
            tally.error(type(exc).__name__)


async def pacer(pace: asyncio.Queue[bool], rate: float, deadline: float, runners: int) -> None:
    """Hand out ``rate`` permits per second (at most one second's worth banked); at the deadline
    tell every runner to stop."""
    bank, credit, last = max(1, int(rate)), 0.0, time.monotonic()
    while last < deadline:
        await asyncio.sleep(0.01)
        now = time.monotonic()
        credit = min(credit + (now - last) * rate, bank)
        last = now
        while credit >= 1 and pace.qsize() < bank:
            pace.put_nowait(True)
            credit -= 1
    for _ in range(runners):
        pace.put_nowait(False)


async def run_load(
    url: str, issuer: DevIssuer, connections: int, seconds: float, rate: float | None
) -> tuple[Tally, float]:
    tally = Tally()
    deadline = time.monotonic() + seconds
    pace: asyncio.Queue[bool] | None = asyncio.Queue() if rate else None
    connector = aiohttp.TCPConnector(limit=connections)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.monotonic()
        tasks = [
            runner_loop(session, url, issuer, deadline, tally, pace) for _ in range(connections)
        ]
        if pace is not None and rate:
            tasks.append(pacer(pace, rate, deadline, connections))
        await asyncio.gather(*tasks)
        return tally, time.monotonic() - started


def report(name: str, tally: Tally, seconds: float, rss: tuple[int, int]) -> dict[str, Any]:
    before, after = rss
    return {
        "run": name,
        "seconds": round(seconds, 1),
        "releases": tally.ok,
        "releases_per_s": round(tally.ok / seconds, 1),
        "p50_ms": tally.percentile(0.5),
        "p99_ms": tally.percentile(0.99),
        "errors": sum(tally.errors.values()),
        "error_kinds": tally.errors,
        "rss_mib_after_warmup": round(before / 2**20, 1),
        "rss_mib_at_end": round(after / 2**20, 1),
        "rss_growth_percent": round(100 * (after - before) / before, 1),
    }


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="broker-load-") as tmp:
        issuer = DevIssuer(dev_mode=True)
        # Nonces live nonce_ttl_seconds after use (single use is enforced until expiry): a short
        # TTL lets the soak reach the store's steady size (rate x TTL) well inside its run.
        config = bench_workspace(Path(tmp) / "b", issuer, nonce_ttl_seconds=30)
        port = free_port()
        env = {**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"}
        command = [*CLI, "serve", "--config", str(config), "--workers", str(args.workers)]
        broker = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        results = []
        try:
            await wait_ready(url + "/readyz")
            await run_load(url, issuer, args.connections, 5, None)  # warm-up
            rss_start = rss_bytes(broker.pid)
            tally, seconds = await run_load(url, issuer, args.connections, args.duration, None)
            results.append(report("max", tally, seconds, (rss_start, rss_bytes(broker.pid))))
            if args.soak:
                rate = args.fraction * tally.ok / seconds
                rss_start = rss_bytes(broker.pid)
                tally, seconds = await run_load(url, issuer, args.connections, args.soak, rate)
                soak = report(
                    f"soak at {args.fraction:.0%} of max",
                    tally,
                    seconds,
                    (rss_start, rss_bytes(broker.pid)),
                )
                soak["target_per_s"] = round(rate, 1)
                results.append(soak)
        finally:
            broker.terminate()
            broker.wait(timeout=60)
    print(
        json.dumps(
            {
                "connections": args.connections,
                "workers": args.workers,
                "cpus": os.cpu_count(),
                "runs": results,
            },
            indent=2,
        )
    )
    failed = [r for r in results if r["errors"]] + [
        r for r in results[1:] if r["rss_growth_percent"] >= 10
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of the max run")
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of the soak (0: none)")
    parser.add_argument("--fraction", type=float, default=0.7, help="soak rate / max rate")
    parser.add_argument("--workers", type=int, default=1)
    raise SystemExit(asyncio.run(main(parser.parse_args())))
