"""The KBS facade (issue 33): a Confidential Containers guest's handshake + attest + get-resource
cycle, and resources released per second at 16 connections, next to the runner API's own
attest-once path measured in the same run on the same broker.

One ``broker serve`` (plain HTTP on 127.0.0.1, one worker, ``[attest]`` and ``[kbs]`` on, the
development switch for ``sample`` evidence on, the test key mapped and allowed to sample guests
in the policy's data). Printed, the median over ``--rounds`` rounds (each round runs every kind in
a rotating order, so all meet the same moments of the machine):

* ``kbs_cycle_p50_ms``: one guest, sequentially: ``POST /kbs/v0/auth``, ``POST /kbs/v0/attest``
  (sample evidence over the guest's report data), ``GET /kbs/v0/resource/…`` (cookie): three
  decisions, three durable records; ``kbs_{auth,attest,resource}_p50_ms`` each step;
* ``runner_cycle_p50_ms`` (the baseline): one runner, sequentially: ``POST /v1/challenge``,
  ``POST /v1/attest`` (a development Confidential Space token bound to its keys, minted in the
  loop as the guest's evidence is made in its loop), ``POST /v1/release`` under DPoP: two
  decisions, two records; ``kbs_cycle_vs_runner_cycle`` the ratio;
* ``kbs_resources_per_s_at_16``: 16 guests, each attested once, fetch with their cookies over
  16 connections; ``runner_releases_per_s_at_16`` (the baseline): 16 runners, each attested
  once, release one key under DPoP over 16 connections (proofs made before the clock starts,
  as ``bench/attested_bench.py`` makes them); ``kbs_vs_runner_at_16`` the ratio.

    make bench            # or: .venv/bin/python bench/kbs_bench.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric import ec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attest_bench import Held, attestations, challenge, drive, ear_requests
from release_bench import Broker, Run, bench_workspace, wait_ready

from broker.dev.issuer import DevIssuer
from broker.dev.workspace import write_private_pem
from tests.support.constants import KEY
from tests.support.kbs_client import COOKIE, PREFIX, Guest

WIDE = 16
RESOURCE = "default/bench/dek"
EXTRA_TOML = f"""
[attest]
enabled = true
signing_key = "result-signing.pem"
ttl_seconds = 900

[kbs]
enabled = true
allow_sample_evidence = true
session_ttl_seconds = 3600
token_ttl_seconds = 900
auth_rate_per_ip = 0  # one load generator drives every guest from one address

[kbs.resources]
"{RESOURCE}" = "{KEY}"
"""


def workspace(workdir: Path, issuer: DevIssuer) -> Path:
    """Plain HTTP, results and the facade on; sample guests allowed the bench key."""
    workdir.mkdir(parents=True)
    write_private_pem(workdir / "result-signing.pem", ec.generate_private_key(ec.SECP256R1()))
    config = bench_workspace(workdir, issuer, nonce_ttl_seconds=3600, extra_toml=EXTRA_TOML)
    data_file = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text(encoding="utf-8"))
    data["kbs_guests"] = {KEY: [{"technology": "sample", "measurements": {"svn": "1"}}]}
    data_file.write_text(json.dumps(data), encoding="utf-8")
    return config


async def kbs_cycle(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """One guest's cycle, each step timed (seconds); raises unless each step is 200."""
    guest = Guest(url)
    laps: dict[str, float] = {}
    started = time.perf_counter()
    status, body = await guest.auth(session)
    laps["auth"] = time.perf_counter() - started
    status_attest, _ = await guest.attest(session)
    laps["attest"] = time.perf_counter() - started - laps["auth"]
    got, answer, _ = await guest.resource(session, RESOURCE)
    laps["cycle"] = time.perf_counter() - started
    laps["resource"] = laps["cycle"] - laps["auth"] - laps["attest"]
    if (status, status_attest, got) != (200, 200, 200):
        raise SystemExit(f"kbs cycle refused: {status} {status_attest} {got} {body} {answer}")
    return laps


async def runner_cycle(session: aiohttp.ClientSession, url: str, issuer: DevIssuer) -> float:
    """One runner's challenge + attest + one release under DPoP (seconds)."""
    started = time.perf_counter()
    (held,) = await attestations(url, issuer, None, 1)  # its challenge and /v1/attest
    (request,) = ear_requests(url, [held], 1, KEY)
    async with session.post(url + "/v1/release", json=request.body, headers=request.headers) as r:
        await r.read()
        if r.status != 200:
            raise SystemExit(f"runner release refused: {r.status}")
    return time.perf_counter() - started


async def kbs_guests(url: str, count: int) -> list[Guest]:
    guests = [Guest(url) for _ in range(count)]
    async with aiohttp.ClientSession() as session:
        for guest in guests:
            await guest.handshake(session)
    return guests


async def fetch_wide(url: str, guests: list[Guest], requests: int) -> Run:
    """``requests`` resource GETs, round robin over the guests' cookies, ``WIDE`` at a time."""
    queue = [guests[i % len(guests)].cookie for i in range(requests)]
    ok = 0
    latencies: list[float] = []
    target = f"{url}{PREFIX}/resource/{RESOURCE}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=WIDE)) as session:

        async def worker() -> None:
            nonlocal ok
            while queue:
                cookie = queue.pop()
                sent = time.perf_counter()
                async with session.get(target, headers={"Cookie": f"{COOKIE}={cookie}"}) as r:
                    await r.read()
                    ok += r.status == 200
                latencies.append(time.perf_counter() - sent)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(WIDE)))
    return Run(time.perf_counter() - started, ok, latencies)


async def one_round(
    url: str, issuer: DevIssuer, cycles: int, requests: int, order: int
) -> dict[str, Any]:
    """Every kind once, in a rotating order."""
    out: dict[str, Any] = {}

    async def kbs_cycles() -> None:
        async with aiohttp.ClientSession() as session:
            laps = [await kbs_cycle(session, url) for _ in range(cycles)]
        for name in ("cycle", "auth", "attest", "resource"):
            out[f"kbs_{name}"] = statistics.median(lap[name] for lap in laps)

    async def runner_cycles() -> None:
        async with aiohttp.ClientSession() as session:
            times = [await runner_cycle(session, url, issuer) for _ in range(cycles)]
        out["runner_cycle"] = statistics.median(times)

    async def kbs_wide() -> None:
        guests = await kbs_guests(url, WIDE)
        run = await fetch_wide(url, guests, requests)
        if run.ok != requests:
            raise SystemExit(f"kbs: only {run.ok}/{requests} resources released")
        out["kbs_rate"] = run.rate

    async def runner_wide() -> None:
        held: list[Held] = await attestations(url, issuer, None, WIDE)
        prepared = ear_requests(url, held, requests, KEY)
        run = await drive(url + "/v1/release", prepared, WIDE)
        if run.ok != requests:
            raise SystemExit(f"runner: only {run.ok}/{requests} releases succeeded")
        out["runner_rate"] = run.rate

    kinds = [kbs_cycles, runner_cycles, kbs_wide, runner_wide]
    for kind in kinds[order % len(kinds) :] + kinds[: order % len(kinds)]:
        await kind()
    return out


async def main(rounds: int, cycles: int, requests: int) -> None:
    load = round(os.getloadavg()[0], 2)  # before this run adds its own
    with tempfile.TemporaryDirectory(prefix="broker-kbs-bench-") as tmp:
        issuer = DevIssuer(dev_mode=True)
        broker = Broker(workspace(Path(tmp) / "b", issuer), 1)
        try:
            await wait_ready(broker.url + "/readyz")
            async with aiohttp.ClientSession() as session:  # warm both paths
                await challenge(session, broker.url)
                for _ in range(5):
                    await kbs_cycle(session, broker.url)
                    await runner_cycle(session, broker.url, issuer)
            results = [
                await one_round(broker.url, issuer, cycles, requests, order)
                for order in range(rounds)
            ]
        finally:
            broker.stop()

    def median(name: str, scale: float = 1.0) -> float:
        return round(float(statistics.median(r[name] for r in results)) * scale, 3)

    figures = {
        "kbs_cycle_p50_ms": median("kbs_cycle", 1000),
        "kbs_auth_p50_ms": median("kbs_auth", 1000),
        "kbs_attest_p50_ms": median("kbs_attest", 1000),
        "kbs_resource_p50_ms": median("kbs_resource", 1000),
        "runner_cycle_p50_ms": median("runner_cycle", 1000),
        "kbs_resources_per_s_at_16": median("kbs_rate"),
        "runner_releases_per_s_at_16": median("runner_rate"),
    }
    figures["kbs_cycle_vs_runner_cycle"] = round(
        figures["kbs_cycle_p50_ms"] / figures["runner_cycle_p50_ms"], 2
    )
    figures["kbs_vs_runner_at_16"] = round(
        figures["kbs_resources_per_s_at_16"] / figures["runner_releases_per_s_at_16"], 2
    )
    print(
        json.dumps(
            {
                "rounds": rounds,
                "cycles_per_round": cycles,
                "requests_at_16": requests,
                "cpus": os.cpu_count(),
                "load_average_1m": load,
                **figures,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--requests", type=int, default=800)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.cycles, args.requests))
