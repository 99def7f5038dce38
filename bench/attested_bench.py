"""Attest once, fetch fast (issue 31): releases on an attestation result (``Authorization: DPoP
<EAR>`` + a ``DPoP`` proof, ``{"keys": [one]}``) next to the echo server and the attested floor,
in one run on one machine.

Three servers side by side on 127.0.0.1, plain HTTP: ``broker serve`` (one worker, ``[attest]``
on, ``Server-Timing`` asked for), the aiohttp JSON echo of ``release_bench.py`` and
``attested_floor_server.py`` (the library calls of one fetch, a record fsync'd with group commit,
nothing checked). Every round runs, in a rotating order, each server at 16 connections and then
at 1 connection, and ``POST /v1/challenge`` on the broker at 1 connection: all kinds meet the same
moments of the machine. Figures are the **median over the rounds** of each round's rate or p50.

Each fetch carries a DPoP proof signed by the runner's key; proofs are made before each clock
starts (the broker refuses one older than 60 s), each with the broker's current ``DPoP-Nonce``
(valid 5 minutes) from a fresh attestation made at the start of each round. At 16 connections
16 runners fetch, each on its own attestation; at 1 connection one runner. The floor and the echo
get requests of the same shape and size (the same headers and body; both ignore what the headers
say). ``stages_p50_ms_at_1``: the median, per stage, of the broker's ``Server-Timing`` header at
1 connection (``unavailable`` when the broker sends none on this path). ``fsync_*``: a write +
fsync of one record of the log's median attested-release size in the log's directory,
back to back and at the fetches' own cadence (release_bench.fsync_probe): the durable floor.

Targets (issue 31): ``fetch_vs_echo_at_16`` >= 0.3, ``fetch_vs_floor_at_16`` >= 0.7,
``fetch_p50_vs_challenge_p50`` <= 2.

    make bench            # or: .venv/bin/python bench/attested_bench.py --rounds 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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
sys.path.insert(0, str(ROOT / "bench"))

from attest_bench import Request, attestations, drive, ear_requests, workspace
from release_bench import ECHO_APP, Broker, Run, free_port, fsync_probe, wait_ready

from broker.dev.issuer import DevIssuer
from tests.support.constants import ALLOWED, KEY
from tests.vectors.gpu import RimAuthority, SimulatedGpu

# [server] server_timing (issue 31): Server-Timing on releases on results too.
TIMING = {"BROKER_SERVER_SERVER_TIMING": "true"}
WIDE = 16
KINDS = ("broker", "floor", "echo")


async def start_broker(config: Path) -> Broker:
    """The broker with ``Server-Timing`` on; if it exits at start-up so, without."""
    for environ in (TIMING, {}):
        broker = Broker(config, 1, environ)
        if await ready_unless_exited(broker):
            return broker
        broker.stop()
        if environ:
            print(
                "the broker refused the Server-Timing settings; stages: unavailable",
                file=sys.stderr,
            )
    raise SystemExit("the broker did not start")


async def ready_unless_exited(broker: Broker, seconds: float = 60.0) -> bool:
    """Whether ``/readyz`` answered 200 before the process exited (or ``seconds`` passed)."""
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        while broker.process.poll() is None and time.monotonic() < deadline:
            try:
                async with session.get(broker.url + "/readyz") as response:
                    if response.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    return False


def start_server(command: list[str], port: int) -> tuple[str, subprocess.Popen[bytes]]:
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", process


def start_floor(workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    script = str(ROOT / "bench" / "attested_floor_server.py")
    arguments = [str(workdir / "policies"), str(workdir), KEY, ALLOWED]
    arguments.append(str(workdir / "result-signing.pem"))
    return start_server([sys.executable, script, str(port), *arguments], port)


def start_echo() -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    return start_server([sys.executable, "-c", ECHO_APP, str(port)], port)


async def one_at_a_time(url: str, requests: list[Request]) -> tuple[Run, list[str]]:
    """Each request in turn on one connection; the run and each answer's ``Server-Timing``."""
    latencies: list[float] = []
    timings: list[str] = []
    ok = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        started = time.perf_counter()
        for request in requests:
            sent = time.perf_counter()
            async with session.post(url, json=request.body, headers=request.headers) as reply:
                await reply.read()
                ok += reply.status == 200
                timing = reply.headers.get("Server-Timing")
            latencies.append(time.perf_counter() - sent)
            if timing:
                timings.append(timing)
        return Run(time.perf_counter() - started, ok, latencies), timings


class Rounds:
    """Runs by (kind, connections), and the broker's ``Server-Timing`` headers at 1."""

    def __init__(self) -> None:
        self.runs: dict[tuple[str, int], list[Run]] = {}
        self.timings: list[str] = []

    def add(self, kind: str, connections: int, run: Run, expected: int) -> None:
        if run.ok != expected:
            raise SystemExit(f"{kind} at {connections}: only {run.ok}/{expected} answered 200")
        self.runs.setdefault((kind, connections), []).append(run)

    def rate(self, kind: str, connections: int) -> float:
        return statistics.median(run.rate for run in self.runs[kind, connections])

    def p50(self, kind: str, connections: int = 1) -> float:
        return statistics.median(run.percentile(0.5) for run in self.runs[kind, connections])

    def stages(self) -> dict[str, float] | str:
        stages: dict[str, list[float]] = {}
        for header in self.timings:
            for part in filter(None, header.split(",")):  # name;dur=ms[;desc=…]
                name, *parameters = (p.strip() for p in part.split(";"))
                for parameter in parameters:
                    if parameter.startswith("dur="):
                        stages.setdefault(name, []).append(float(parameter[4:]))
        if not stages:
            return "unavailable"
        return {name: round(statistics.median(values), 3) for name, values in stages.items()}


async def one_round(
    turn: int, bases: dict[str, str], issuer: DevIssuer, sizes: argparse.Namespace
) -> Rounds:
    """One round: each kind at 16 connections, then at 1, in an order rotated by ``turn``."""
    done = Rounds()
    broker = bases["broker"]
    held = await attestations(broker, issuer, None, WIDE)  # fresh results and DPoP-Nonce
    order = KINDS[turn % 3 :] + KINDS[: turn % 3]
    for connections, count in ((WIDE, sizes.requests), (1, sizes.single)):
        runners = held if connections == WIDE else held[:1]
        # signed before the clocks start; the floor's requests go to the echo too
        fetches = ear_requests(broker, runners, count, KEY)
        others = ear_requests(bases["floor"], runners, count, KEY)
        for kind in order:
            url = bases[kind] + ("/echo" if kind == "echo" else "/v1/release")
            requests = fetches if kind == "broker" else others
            if connections == WIDE:
                run = await drive(url, requests, WIDE)
            else:
                run, timings = await one_at_a_time(url, requests)
                if kind == "broker":
                    done.timings += timings
            done.add(kind, connections, run, count)
    challenges = [Request({}, {})] * sizes.single
    run, _ = await one_at_a_time(broker + "/v1/challenge", challenges)
    done.add("challenge", 1, run, sizes.single)
    return done


def merge(rounds: list[Rounds]) -> Rounds:
    merged = Rounds()
    for one in rounds:
        for key, runs in one.runs.items():
            merged.runs.setdefault(key, []).extend(runs)
        merged.timings += one.timings
    return merged


async def measure(workdir: Path, issuer: DevIssuer, sizes: argparse.Namespace) -> dict[str, Any]:
    config = workspace(workdir, issuer, *simulated_gpu())
    broker = await start_broker(config)
    floor_url, floor = start_floor(workdir)
    echo_url, echo = start_echo()
    try:
        await wait_ready(floor_url + "/readyz")
        await wait_ready(echo_url + "/echo")
        bases = {"broker": broker.url, "floor": floor_url, "echo": echo_url}
        await one_round(0, bases, issuer, argparse.Namespace(requests=100, single=50))  # warm
        rounds = [await one_round(turn, bases, issuer, sizes) for turn in range(sizes.rounds)]
    finally:
        broker.stop()
        for process in (floor, echo):
            process.terminate()
            process.wait(timeout=30)
    return summary(merge(rounds), workdir, sizes)


def simulated_gpu() -> tuple[SimulatedGpu, RimAuthority]:
    """attest_bench's workspace trusts a simulated GPU world; this bench sends no GPU evidence."""
    now = datetime.now(UTC)
    return SimulatedGpu(now), RimAuthority(now)


def summary(done: Rounds, workdir: Path, sizes: argparse.Namespace) -> dict[str, Any]:
    lines = [
        line
        for line in (workdir / "decisions.log").read_bytes().splitlines()
        if b'"type":"attested_release"' in line
    ]
    record_bytes = sorted(len(line) + 1 for line in lines)[len(lines) // 2]
    floor_lines = (workdir / "attested-floor.log").read_bytes().splitlines()
    fetch_p50 = done.p50("broker")
    back_to_back = fsync_probe(workdir, sizes.single, record_bytes, gap=0.0)
    paced = fsync_probe(workdir, sizes.single, record_bytes, gap=fetch_p50 / 1000)
    rate = {(kind, n): round(done.rate(kind, n), 1) for kind in KINDS for n in (1, WIDE)}
    return {
        "rounds": sizes.rounds,
        "requests_at_16": sizes.requests,
        "requests_at_1": sizes.single,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "figures": "median over rounds (each round: rate of its block, p50 of its block)",
        "fetch_per_s_at_16": rate["broker", WIDE],
        "floor_per_s_at_16": rate["floor", WIDE],
        "echo_per_s_at_16": rate["echo", WIDE],
        "fetch_per_s_at_1": rate["broker", 1],
        "floor_per_s_at_1": rate["floor", 1],
        "echo_per_s_at_1": rate["echo", 1],
        "fetch_p50_ms_at_1": round(fetch_p50, 3),
        "floor_p50_ms_at_1": round(done.p50("floor"), 3),
        "echo_p50_ms_at_1": round(done.p50("echo"), 3),
        "challenge_p50_ms_at_1": round(done.p50("challenge"), 3),
        "fetch_vs_echo_at_16": round(rate["broker", WIDE] / rate["echo", WIDE], 3),
        "fetch_vs_floor_at_16": round(rate["broker", WIDE] / rate["floor", WIDE], 3),
        "fetch_vs_echo_at_1": round(rate["broker", 1] / rate["echo", 1], 3),
        "fetch_vs_floor_at_1": round(rate["broker", 1] / rate["floor", 1], 3),
        "fetch_p50_vs_challenge_p50": round(fetch_p50 / done.p50("challenge"), 2),
        "floor_vs_echo_at_16": round(rate["floor", WIDE] / rate["echo", WIDE], 3),
        "floor_p50_vs_challenge_p50": round(done.p50("floor") / done.p50("challenge"), 2),
        "targets": {
            "fetch_vs_echo_at_16": ">= 0.3",
            "fetch_vs_floor_at_16": ">= 0.7",
            "fetch_p50_vs_challenge_p50": "<= 2",
        },
        "fetch_per_s_at_16_by_round": [round(r.rate, 1) for r in done.runs["broker", WIDE]],
        "stages_p50_ms_at_1": done.stages(),
        "record_bytes_p50": record_bytes,
        "floor_record_bytes_p50": sorted(len(x) + 1 for x in floor_lines)[len(floor_lines) // 2],
        "fsync_back_to_back_p50_ms": round(statistics.median(back_to_back) * 1000, 3),
        "fsync_at_fetch_cadence_p50_ms": round(statistics.median(paced) * 1000, 3),
    }


async def main(sizes: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="broker-attested-bench-") as tmp:
        result = await measure(Path(tmp) / "b", DevIssuer(dev_mode=True), sizes)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=600, help="per block at 16 connections")
    parser.add_argument("--single", type=int, default=200, help="per block at 1 connection")
    asyncio.run(main(parser.parse_args()))
