"""Attest once, release many (issue 19): what a release on an attestation result (EAR + DPoP)
costs next to a full-evidence release, on the same broker process in the same run.

One ``broker serve`` (plain HTTP on 127.0.0.1, one worker, ``[attest]`` on, the simulated NVIDIA
world of the tests trusted for local GPU evidence). Printed:

* ``full_cpu_per_s``: full-evidence releases/s with a Confidential Space token only;
* ``full_gpu_per_s``: full-evidence releases/s with a token and local GPU evidence (SPDM report,
  certificate chain, RIMs: what a GPU runner sends with every release);
* ``ear_per_s``: releases/s on attestation results (each request: the EAR verified, a DPoP proof
  verified and spent, the release policy on the stored claims, wrap, durable record), and its
  ratios to both (the issue expects >= 3x against full evidence);
* ``runner_*``: one runner, sequentially, through the SDK: 1 attestation (with GPU evidence)
  followed by 10 key releases on it, against 10 full-evidence releases (each with GPU
  evidence) — medians of ``--rounds`` rounds, in milliseconds, and their ratio.

Client-side signing (tokens, GPU reports, DPoP proofs) is prepared before each clock starts in the
throughput runs; the runner rounds include it, as a runner pays it. A real GPU's evidence takes
1-3 s to collect on the device; the simulated one is made in microseconds, so the runner ratio
here is a floor of what a GPU runner saves.

    make bench            # or: .venv/bin/python bench/attest_bench.py --requests 600
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import jwt
from cryptography.hazmat.primitives.asymmetric import ec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from release_bench import Broker, Run, bench_workspace, wait_ready

from broker.client import BrokerClient
from broker.client.unwrap import new_ephemeral_key
from broker.core.binding import attestation_thumbprint, binding_digest
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, Workload
from broker.dev.workspace import write_private_pem
from tests.support.constants import ALLOWED, GPU_KEY, KEY
from tests.vectors.gpu import DRIVER, RimAuthority, SimulatedGpu, pem

GPU_POLICY = {GPU_KEY: {"min_gpus": 1, "min_driver": "550.54", "ocsp_unknown_ok": True}}
WORKLOAD = Workload(image_digest=ALLOWED, gpu_cc_mode="ON")


def workspace(workdir: Path, issuer: DevIssuer, gpu: SimulatedGpu, rims: RimAuthority) -> Path:
    """Plain HTTP (TLS is not part of the comparison), attestation results on, GPU trust."""
    extra = """
[nvidia]
device_root = "gpu/device_root.pem"
rim_root = "gpu/rim_root.pem"
rim_dir = "gpu/rims"

[attest]
enabled = true
signing_key = "result-signing.pem"
"""
    rim_dir = workdir / "gpu" / "rims"
    rim_dir.mkdir(parents=True)
    (workdir / "gpu" / "device_root.pem").write_bytes(pem([gpu.root]))
    (workdir / "gpu" / "rim_root.pem").write_bytes(pem([rims.root]))
    driver = {i - 1: v for i, v in gpu.measurements.items() if i <= 4}
    vbios = {i - 1: v for i, v in gpu.measurements.items() if i > 4}
    (rim_dir / "NV_GPU_DRIVER_GH100_550.90.07.swidtag").write_bytes(rims.rim(DRIVER, driver))
    (rim_dir / "NV_GPU_VBIOS_1010_0200_882_96009F0001.swidtag").write_bytes(
        rims.rim("96.00.9F.00.01", vbios)
    )
    write_private_pem(workdir / "result-signing.pem", ec.generate_private_key(ec.SECP256R1()))
    return bench_workspace(
        workdir,
        issuer,
        nonce_ttl_seconds=3600,
        extra_toml=extra,
        gpu_keys=GPU_POLICY,
        keys=(KEY, GPU_KEY),
    )


@dataclass
class Request:
    body: dict[str, Any]
    headers: dict[str, str]


async def drive(url: str, requests: list[Request], concurrency: int) -> Run:
    queue = list(reversed(requests))
    ok = 0
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:

        async def worker() -> None:
            nonlocal ok
            while queue:
                request = queue.pop()
                sent = time.perf_counter()
                async with s.post(url, json=request.body, headers=request.headers) as response:
                    await response.read()
                    ok += response.status == 200
                latencies.append(time.perf_counter() - sent)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Run(time.perf_counter() - started, ok, latencies)


async def challenge(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.post(url + "/v1/challenge", json={}) as response:
        return dict(await response.json())


async def full_requests(
    url: str, issuer: DevIssuer, gpu: SimulatedGpu | None, count: int
) -> list[Request]:
    """Full-evidence release bodies (a fresh X25519 key each), GPU evidence when ``gpu``."""
    requests = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            issued = await challenge(session, url)
            jwk = public_jwk(new_ephemeral_key("X25519").public_key())
            token = issuer.mint(
                audience=issued["audience"],
                nonces=[issued["nonce"], thumbprint(jwk)],
                workload=WORKLOAD,
                now=datetime.now(UTC),
            )
            evidence: dict[str, Any] = {"gca": token}
            if gpu is not None:
                evidence["nvidia"] = gpu.evidence(binding_digest(issued["nonce"], thumbprint(jwk)))
            body = {
                "key": GPU_KEY if gpu else KEY,
                "nonce": issued["nonce"],
                "evidence": evidence,
                "runner_key": jwk,
            }
            requests.append(Request(body, {}))
    return requests


@dataclass
class Held:
    token: str
    pop: ec.EllipticCurvePrivateKey
    nonce: str


async def attestations(
    url: str, issuer: DevIssuer, gpu: SimulatedGpu | None, count: int
) -> list[Held]:
    held = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            issued = await challenge(session, url)
            pop = ec.generate_private_key(ec.SECP256R1())
            encryption = public_jwk(new_ephemeral_key("X25519").public_key())
            pop_jwk = public_jwk(pop.public_key())
            binding = attestation_thumbprint(thumbprint(encryption), thumbprint(pop_jwk))
            token = issuer.mint(
                audience=issued["audience"],
                nonces=[issued["nonce"], binding],
                workload=WORKLOAD,
                now=datetime.now(UTC),
            )
            evidence: dict[str, Any] = {"gca": token}
            if gpu is not None:
                evidence["nvidia"] = gpu.evidence(binding_digest(issued["nonce"], binding))
            body = {
                "nonce": issued["nonce"],
                "evidence": evidence,
                "runner_key": encryption,
                "pop_key": pop_jwk,
            }
            async with session.post(url + "/v1/attest", json=body) as response:
                if response.status != 201:
                    raise SystemExit(f"attest: {response.status} {await response.text()}")
                held.append(Held(await response.text(), pop, response.headers["DPoP-Nonce"]))
    return held


def ear_requests(url: str, held: list[Held], count: int, key: str) -> list[Request]:
    requests = []
    for index in range(count):
        one = held[index % len(held)]
        ath = base64.urlsafe_b64encode(hashlib.sha256(one.token.encode()).digest())
        claims = {
            "jti": str(uuid.uuid4()),
            "htm": "POST",
            "htu": url + "/v1/release",
            "iat": int(time.time()),
            "ath": ath.rstrip(b"=").decode(),
            "nonce": one.nonce,
        }
        proof = jwt.encode(
            claims,
            one.pop,
            algorithm="ES256",
            headers={"typ": "dpop+jwt", "jwk": public_jwk(one.pop.public_key())},
        )
        headers = {"Authorization": f"DPoP {one.token}", "DPoP": proof}
        requests.append(Request({"keys": [key]}, headers))
    return requests


class LocalGpu:
    evidence_kind = "nvidia"

    def __init__(self, gpu: SimulatedGpu) -> None:
        self.gpu = gpu

    async def evidence(self, gpu_nonce: bytes) -> object:
        return self.gpu.evidence(gpu_nonce)


async def runner_rounds(
    url: str, issuer: DevIssuer, gpu: SimulatedGpu, rounds: int
) -> dict[str, float]:
    """One runner, sequentially, through the SDK: 1 attest + 10 releases vs 10 full releases."""
    source = _TokenSource(issuer)
    attested: list[float] = []
    full: list[float] = []
    async with BrokerClient(url) as client:
        for _ in range(rounds):
            started = time.perf_counter()
            attestation = await client.attest(source, gpu_source=LocalGpu(gpu))
            for _ in range(10):
                await attestation.release(GPU_KEY)
            attested.append(time.perf_counter() - started)
            started = time.perf_counter()
            for _ in range(10):
                await client.release(GPU_KEY, source, gpu_source=LocalGpu(gpu))
            full.append(time.perf_counter() - started)
    a, f = statistics.median(attested) * 1000, statistics.median(full) * 1000
    return {
        "runner_attest_plus_10_releases_ms": round(a, 1),
        "runner_10_full_evidence_releases_ms": round(f, 1),
        "runner_full_vs_attest_once": round(f / a, 2),
    }


class _TokenSource:
    evidence_kind = "gca"

    def __init__(self, issuer: DevIssuer) -> None:
        self.issuer = issuer

    async def token(self, audience: str, nonces: list[str]) -> str:
        return self.issuer.mint(
            audience=audience, nonces=nonces, workload=WORKLOAD, now=datetime.now(UTC)
        )


async def main(count: int, concurrency: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="broker-attest-bench-") as tmp:
        issuer = DevIssuer(dev_mode=True)
        now = datetime.now(UTC)
        gpu, rims = SimulatedGpu(now), RimAuthority(now)
        config = workspace(Path(tmp) / "b", issuer, gpu, rims)
        broker = Broker(config, 1)
        try:
            await wait_ready(broker.url + "/readyz")
            url = broker.url
            release = url + "/v1/release"
            held = await attestations(url, issuer, gpu, concurrency)
            await drive(release, await full_requests(url, issuer, gpu, 50), concurrency)  # warm
            await drive(release, ear_requests(url, held, 50, GPU_KEY), concurrency)
            runs: dict[str, list[Run]] = {"full_cpu": [], "full_gpu": [], "ear": [], "ear_cpu": []}
            for _ in range(2):  # interleaved: each kind sees the same machine state
                runs["full_cpu"].append(
                    await drive(release, await full_requests(url, issuer, None, count), concurrency)
                )
                runs["full_gpu"].append(
                    await drive(release, await full_requests(url, issuer, gpu, count), concurrency)
                )
                held = await attestations(url, issuer, gpu, concurrency)
                runs["ear"].append(
                    await drive(release, ear_requests(url, held, count, GPU_KEY), concurrency)
                )
                held = await attestations(url, issuer, None, concurrency)
                runs["ear_cpu"].append(
                    await drive(release, ear_requests(url, held, count, KEY), concurrency)
                )
            for name, done in runs.items():
                if any(run.ok != count for run in done):
                    raise SystemExit(f"{name}: only {[r.ok for r in done]}/{count} released")
            rates = {name: max(run.rate for run in done) for name, done in runs.items()}
            runner = await runner_rounds(url, issuer, gpu, rounds)
        finally:
            broker.stop()
    print(
        json.dumps(
            {
                "requests": count,
                "concurrency": concurrency,
                "cpus": os.cpu_count(),
                "full_cpu_per_s": round(rates["full_cpu"], 1),
                "full_gpu_per_s": round(rates["full_gpu"], 1),
                "ear_per_s": round(rates["ear"], 1),
                "ear_vs_full_gpu": round(rates["ear"] / rates["full_gpu"], 2),
                "ear_cpu_per_s": round(rates["ear_cpu"], 1),
                "ear_cpu_vs_full_cpu": round(rates["ear_cpu"] / rates["full_cpu"], 2),
                "ear_p50_ms": round(min(r.percentile(0.5) for r in runs["ear"]), 2),
                "full_gpu_p50_ms": round(min(r.percentile(0.5) for r in runs["full_gpu"]), 2),
                **runner,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.concurrency, args.rounds))
