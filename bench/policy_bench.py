"""Per-evaluation cost of the policy engines on the shipped policy and a realistic input.

Prints microseconds per decision for: the Wasm engine in process (the default), the OPA server
engine against a real ``opa run --server`` on loopback, and, as the same-run baseline, one
aiohttp JSON round trip to a loopback echo server (the floor of any sidecar call). Target from
the policy issue: the Wasm engine well under 300 µs per evaluation on this machine.

    .venv/bin/python bench/policy_bench.py [N]
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.attestation import claims
from broker.attestation.gca import VerifiedGcaToken
from broker.core.encoding import b64url_decode
from broker.core.errors import UpstreamError
from broker.dev.issuer import DevIssuer, Workload
from broker.policy.build import compile_policy_dir
from broker.policy.opa_server import OpaServerEngine
from broker.policy.testing import find_opa
from broker.policy.wasm import WasmPolicyEngine

DIGEST = "sha256:" + "ab" * 32


def realistic_input() -> dict[str, Any]:
    """What the release path builds for a Confidential Space token: every raw claim included."""
    now = datetime.now(UTC)
    issuer = DevIssuer(dev_mode=True)
    token = issuer.mint(
        audience="https://broker.bench", nonces=["n" * 43, "t" * 43],
        workload=Workload(image_digest=DIGEST, gpu_cc_mode="ON"), now=now,
    )  # fmt: skip
    verified = VerifiedGcaToken(
        issuer.issuer, issuer.kid, json.loads(b64url_decode(token.split(".")[1]))
    )
    gpu = {
        "id": "GPU-0", "verifier": "local", "arch": "HOPPER", "mode": "spt", "cc_mode": "on",
        "debug": False, "measurements": "match", "cert_chain": "valid", "ocsp": "good",
        "driver_version": "550.90.07",
    }  # fmt: skip
    return claims.build_input(
        request=claims.RequestFacts(
            key="models/llama", version=1, purpose="model-weights", runner_key_thumbprint="t" * 43
        ),
        tee=claims.gca_tee(verified),
        raw_claims={"gca": verified.claims},
        gpus=[gpu],
        now=now,
    )


def policy_dir(tmp: Path) -> Path:
    target = tmp / "policies"
    shutil.copytree(ROOT / "policies", target)
    data_path = target / "broker" / "data.json"
    data = json.loads(data_path.read_text())
    data["images"] = {"models/llama": [DIGEST]}
    data["gpu_keys"] = {"models/llama": {"min_gpus": 1, "min_driver": "550.54"}}
    data_path.write_text(json.dumps(data))
    return target


async def per_call_us(call: Any, count: int) -> tuple[float, float]:
    for _ in range(min(200, count)):
        await call()
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples), statistics.quantiles(samples, n=100)[98]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def main(count: int) -> None:
    logging.getLogger("broker").setLevel(logging.CRITICAL)  # the sidecar's start-up refusals
    document = realistic_input()
    with tempfile.TemporaryDirectory() as tmp:
        policies = policy_dir(Path(tmp))
        opa = find_opa()
        wasm = WasmPolicyEngine(compile_policy_dir(policies, opa=opa))
        decision = await wasm.evaluate(document)
        assert decision.allowed, decision

        async def wasm_call() -> None:
            await wasm.evaluate(document)

        port = free_port()
        server = await asyncio.create_subprocess_exec(
            str(opa), "run", "--server", "--addr", f"127.0.0.1:{port}", "--log-level", "error",
            "--ignore", "*_test.rego", str(policies),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        engine = OpaServerEngine(f"http://127.0.0.1:{port}", timeout_seconds=5, digest="bench")
        await engine.open()
        echo = web.Application()
        echo.router.add_post("/", _echo)
        runner = web.AppRunner(echo)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        echo_url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
        try:
            for _ in range(100):  # until the OPA server answers
                try:
                    await engine.evaluate(document)
                    break
                except UpstreamError:
                    await asyncio.sleep(0.05)
            assert (await engine.evaluate(document)).allowed
            async with aiohttp.ClientSession() as session:

                async def echo_call() -> None:
                    async with session.post(echo_url, json={"input": document}) as reply:
                        await reply.read()

                async def opa_call() -> None:
                    await engine.evaluate(document)

                size = len(json.dumps(document))
                results = {
                    "wasm (in process)": await per_call_us(wasm_call, count),
                    "opa server (loopback)": await per_call_us(opa_call, count),
                    "baseline: aiohttp JSON echo round trip": await per_call_us(echo_call, count),
                }
        finally:
            await engine.close()
            await runner.cleanup()
            server.terminate()
            await server.wait()
    print(f"policy evaluation, shipped policy, input {size} bytes of JSON, {count} calls each")
    for name, (median, p99) in results.items():
        print(f"  {name:40s} median {median:8.1f} µs   p99 {p99:8.1f} µs")
    wasm_median = results["wasm (in process)"][0]
    echo_median = results["baseline: aiohttp JSON echo round trip"][0]
    print(f"  wasm / echo baseline: {wasm_median / echo_median:.2f}  (target: wasm < 300 µs)")


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"result": await request.json()})


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
