"""The auditor console on a million-record log (issue 34, item 5): how long its pages take to
open through a live broker over HTTP, against named limits.

1. A workspace (plain HTTP on 127.0.0.1, one worker, an auditor token); the broker runs once
   to write real records: its start-up ``policy_change``, releases allowed and refused.
2. With the broker stopped, the log grows to ``--records`` records: those records cloned in a
   mix (allowed, refused, now and then a policy change), each with its own decision id, time
   (spread over ``SPAN_DAYS``), index and chain, sealed by the log writer's own
   ``records.sealed_line`` as the writer thread seals a batch (no fsync per batch: the file is
   written once and synced). The real records stay its first lines, so the broker's earlier
   checkpoints remain consistent with the grown log. The build's time is printed.
3. The broker starts again on it (the time to ready is printed: it hashes the whole log into
   its Merkle tree), an auditor logs in, and each page is opened ``--samples`` times in turn,
   as a browser opens it: log health (the page, then the checkpoint and a consistency proof
   from the first checkpoint, which the page's script fetches), the timeline (the page: it
   carries the chart's data), deny reasons, keys, the policy history (its first opening finds
   the policy records of the whole log, two record types parsed; later ones read only what was
   written since), and the timeline over the most records one page may read
   (``MAX_RECORDS``) and over a window in the middle of the log (paging back costs what the
   newest window costs).

Printed: the first opening, p50 and max per page, then each limit with ``ok`` or ``EXCEEDED``
(exit 1 when one is). The pages read windows (``broker/console/reading.py``: 20,000 records by
default), so their time does not grow with the log; the broker's start-up and the policy
history's first opening do.

    make bench            # or: .venv/bin/python bench/console_bench.py --records 100000
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from release_bench import Broker, bench_workspace, wait_ready

from broker.audit.records import sealed_line
from broker.client import BrokerClient, BrokerClientError
from broker.console.reading import MAX_RECORDS
from broker.core.encoding import Encoded, canonical
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from tests.support.constants import ALLOWED, KEY

TOKEN = "console-bench-auditor-token"
AUDITOR = f"""
[[admin.tokens]]
sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"
roles = ["auditor"]
"""
COOKIE = "console-session"  # the loopback HTTP listener's cookie (no __Host- without TLS)
OTHER_IMAGE = "sha256:" + "0" * 64
SPAN_DAYS = 7
POLICY_CHANGE_EVERY = 100_000
SEED_RELEASES = 4  # of each result
# name: (page label, statistic, limit in ms)
LIMITS = {
    "health_p50_ms": ("health", "p50", 250.0),
    "timeline_p50_ms": ("timeline", "p50", 3_000.0),
    "timeline_max_window_p50_ms": ("timeline_max_window", "p50", 15_000.0),
    "timeline_old_window_p50_ms": ("timeline_old_window", "p50", 3_000.0),
    "denials_p50_ms": ("denials", "p50", 3_000.0),
    "keys_p50_ms": ("keys", "p50", 3_000.0),
    "policy_history_first_ms": ("policy", "first", 30_000.0),
    "policy_history_p50_ms": ("policy", "p50", 500.0),
}


def token_source(issuer: DevIssuer, digest: str) -> DevTokenSource:
    return DevTokenSource(issuer, Workload(image_digest=digest), lambda: datetime.now(UTC))


async def seed(url: str, issuer: DevIssuer) -> None:
    """Real records to clone: releases allowed and refused."""
    async with BrokerClient(url) as client:
        for _ in range(SEED_RELEASES):
            await client.release(KEY, token_source(issuer, ALLOWED))
            try:
                await client.release(KEY, token_source(issuer, OTHER_IMAGE))
            except BrokerClientError:
                pass
            else:
                raise SystemExit("a release for another image was allowed")


def templates(log: Path) -> dict[str, dict[str, Any]]:
    """The newest real record of each kind the grown log repeats, its nested members (policy
    input, identity, reasons) encoded once (``Encoded``: the writer splices them, issue 31)."""
    found: dict[str, dict[str, Any]] = {}
    for line in log.read_bytes().splitlines():
        record = json.loads(line)
        kind = record["type"] if record["type"] != "release" else f"release_{record['result']}"
        found[kind] = {
            name: Encoded(canonical(value)) if isinstance(value, dict | list) else value
            for name, value in record.items()
            if name != "hash"
        }
    missing = {"release_allow", "release_deny", "policy_change"} - set(found)
    if missing:
        raise SystemExit(f"the seeding run wrote no {sorted(missing)} record")
    return found


def kinds(count: int) -> Iterator[str]:
    """Three allowed releases to one refused, and a policy change every so often."""
    for number in range(count):
        if number % POLICY_CHANGE_EVERY == POLICY_CHANGE_EVERY - 1:
            yield "policy_change"
        else:
            yield "release_deny" if number % 4 == 3 else "release_allow"


def grow(log: Path, count: int) -> float:
    """``log`` grown to ``count`` records by cloning its own; the seconds it took."""
    started = time.perf_counter()
    lines = log.read_bytes().splitlines()
    last = json.loads(lines[-1])
    size, head = len(lines), last["hash"]
    chosen = templates(log)
    adding = count - size
    end = time.time()
    first = end - SPAN_DAYS * 86400
    step = (end - first) / max(1, adding)
    batch: list[bytes] = []
    with log.open("ab") as handle:
        for number, kind in enumerate(kinds(adding)):
            record = dict(chosen[kind])
            at = datetime.fromtimestamp(first + number * step, UTC)
            record["time"] = at.isoformat()
            record["decision_id"] = f"{number:08x}-0000-4000-8000-{size:012x}"
            record["index"] = record["seq"] = size
            record["prev"] = head
            head, line = sealed_line(record)
            batch.append(line)
            size += 1
            if len(batch) == 10_000:
                handle.write(b"\n".join(batch) + b"\n")
                batch.clear()
        if batch:
            handle.write(b"\n".join(batch) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


class Auditor:
    """An aiohttp session logged in to the console as a browser is (the cookie by hand)."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.session = session
        self.cookie = ""

    async def login(self) -> None:
        async with self.session.post(
            self.url + "/console/login",
            data={"token": TOKEN},
            headers={"Origin": self.url},
            allow_redirects=False,
        ) as response:
            if response.status != 303:
                raise SystemExit(f"log-in: {response.status} {await response.text()}")
            self.cookie = response.cookies[COOKIE].value

    async def get(self, path: str) -> bytes:
        async with self.session.get(
            self.url + path, headers={"Cookie": f"{COOKIE}={self.cookie}"}, allow_redirects=False
        ) as response:
            body = await response.read()
            if response.status != 200:
                raise SystemExit(f"GET {path}: {response.status} {body[:300]!r}")
            return body


async def first_checkpoint_size(auditor: Auditor) -> int:
    note = (await auditor.get("/v1/log/checkpoint")).decode()
    return int(note.split("\n")[1])


def pages(size: int, earlier: int) -> dict[str, list[str]]:
    """Each page, as the requests a browser makes to open it."""
    return {
        "health": [
            "/console/",
            "/v1/log/checkpoint",
            f"/v1/log/proof/consistency?first={earlier}&second={size}",
        ],
        "timeline": ["/console/timeline"],  # the page carries the chart's data
        "denials": ["/console/denials"],
        "keys": ["/console/keys"],
        "policy": ["/console/policy"],
        "timeline_max_window": [f"/console/timeline?records={MAX_RECORDS}"],
        "timeline_old_window": [f"/console/timeline?end={size // 2}"],
    }


async def open_page(auditor: Auditor, requests: list[str]) -> float:
    """Milliseconds to make the requests of one page, one after the other."""
    started = time.perf_counter()
    for path in requests:
        await auditor.get(path)
    return (time.perf_counter() - started) * 1000


async def measure(
    url: str, samples: int, earlier: int
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each page's first opening (the policy history's finds its records), then each opened
    ``samples`` times, the pages in turn (milliseconds)."""
    times: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as session:
        auditor = Auditor(url, session)
        await auditor.login()
        size = await first_checkpoint_size(auditor)
        opened = pages(size, earlier)
        first = {name: await open_page(auditor, requests) for name, requests in opened.items()}
        for _ in range(samples):
            for name, requests in opened.items():
                times.setdefault(name, []).append(await open_page(auditor, requests))
    return first, times


def p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


async def wait_started(broker: Broker, limit: float = 900.0) -> None:
    """Until ``/readyz`` answers (a large log takes a while: it is hashed at start-up)."""
    deadline = time.monotonic() + limit
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if broker.process.poll() is not None:
                raise SystemExit(f"the broker exited ({broker.process.returncode})")
            try:
                async with session.get(broker.url + "/readyz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"the broker was not ready within {limit:.0f} s")


async def wait_for_checkpoint(url: str, size: int) -> None:
    """Until the broker serves a checkpoint covering ``size`` records (one a second)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            async with session.get(url + "/v1/log/checkpoint") as response:
                if response.status == 200 and int((await response.text()).split("\n")[1]) >= size:
                    return
            await asyncio.sleep(0.1)
    raise SystemExit(f"no checkpoint covered {size} records")


async def main(count: int, samples: int) -> int:
    with tempfile.TemporaryDirectory(prefix="broker-console-bench-") as tmp:
        workdir = Path(tmp) / "b"
        issuer = DevIssuer(dev_mode=True)
        config = bench_workspace(workdir, issuer, nonce_ttl_seconds=3600, extra_toml=AUDITOR)
        log = workdir / "decisions.log"
        broker = Broker(config, 1)
        try:
            await wait_ready(broker.url + "/readyz")
            await seed(broker.url, issuer)
            seeded = len(log.read_bytes().splitlines())
            await wait_for_checkpoint(broker.url, seeded)
        finally:
            broker.stop()
        built = grow(log, count)
        size_mb = log.stat().st_size / 1e6
        print(f"console bench: a log of {count} records ({size_mb:.0f} MB), built in {built:.1f} s")
        started = time.perf_counter()
        broker = Broker(config, 1)
        try:
            await wait_started(broker)
            ready = time.perf_counter() - started
            await wait_for_checkpoint(broker.url, count)
            first, times = await measure(broker.url, samples, seeded)
        finally:
            broker.stop()
    print(f"  broker ready on it in {ready:.1f} s (reads and hashes the whole log)")
    print(f"  pages: the first opening, then {samples} more each (ms):")
    for name, values in times.items():
        print(f"    {name:<22} first {first[name]:8.1f}   p50 {p50(values):8.1f}   max "
              f"{max(values):8.1f}")  # fmt: skip
    exceeded = []
    print("  limits:")
    for limit, (name, statistic, bound) in LIMITS.items():
        value = first[name] if statistic == "first" else p50(times[name])
        verdict = "ok" if value < bound else "EXCEEDED"
        print(f"    {limit} < {bound:.0f}: {value:.1f}  {verdict}")
        if value >= bound:
            exceeded.append(limit)
    figures = {
        limit: round(first[name] if statistic == "first" else p50(times[name]), 1)
        for limit, (name, statistic, _) in LIMITS.items()
    }
    print(json.dumps({"records": count, "build_s": round(built, 1), "ready_s": round(ready, 1),
                      **figures}))  # fmt: skip
    return 1 if exceeded else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000, help="the log's size")
    parser.add_argument("--samples", type=int, default=5, help="openings of each page")
    arguments = parser.parse_args()
    raise SystemExit(asyncio.run(main(arguments.records, arguments.samples)))
