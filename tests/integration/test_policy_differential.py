"""The engine that decides against the engine that defines Rego: the Wasm engine (in process)
and a real ``opa run --server`` on loopback evaluate the same generated inputs with the same
policy; ``allow`` and ``reasons`` must agree on every one.

Inputs: the allowed base input, then each field wrong, missing, of another type, or an odd
string (" 550.90", "550_1", "1e3", full-width digits…), and 0-64 GPUs with mixed fields —
the cases where an independent Rego implementation was seen to disagree with OPA.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from broker.attestation.claims import build_attest_input
from broker.core.errors import UpstreamError
from broker.policy.build import compile_policy_dir
from broker.policy.opa_server import OpaServerEngine
from broker.policy.testing import find_opa
from broker.policy.wasm import WasmPolicyEngine
from tests.policy_helpers import EXAMPLE, policy_copy

DIGEST = "sha256:" + "ab" * 32
GENERATED_INPUTS = 600  # random inputs, after one per field x wrong value (841)
ODD_STRINGS = [
    " 550.90",
    "550_1",
    "550.90.07 ",
    "",
    "1e3",
    "0x10",
    "-1",
    "NaN",
    "550.",
    ".5",
    "５５０",  # noqa: RUF001 - full-width digits on purpose
    "550.90.07.01",
    "550,90",
    "+550",
    "00550",
    "550.54",
    "true",
    "null",
    "ON",
    "On",
    "on ",
    "STABLE ",
    "stable",
    "sha256:",
    DIGEST.upper(),
    "tdx\u0000",
    "é",
    "\u202e",
    "x" * 300,
]
WRONG = [None, True, False, 0, 1, -1, 1.5, 1e30, [], {}, ["x"], {"a": 1}, *ODD_STRINGS]


def base_input() -> dict[str, Any]:
    return {
        "schema": "broker.input/v1",
        "request": {"key": "models/llama", "version": 1, "purpose": "model-weights"},
        "tee": {
            "verifier": "gca",
            "technology": "tdx",
            "debug": False,
            "secure_boot": True,
            "software": {"name": "CONFIDENTIAL_SPACE", "version": "250301", "support": ["STABLE"]},
            "workload": {
                "image_digest": DIGEST,
                "restart_policy": "Never",
                "args": ["/runner"],
                "env": {"MODE": "prod"},
                "signatures": [{"key_id": "signer-1", "algorithm": "ECDSA_P256_SHA256"}],
            },
            "platform": {"project_id": "prod-project", "zone": "us-central1-a"},
        },
        "gpus": [gpu(0)],
        "claims": {},
    }


def gpu(index: int) -> dict[str, Any]:
    return {
        "id": f"GPU-{index}",
        "verifier": "local",
        "arch": "HOPPER",
        "mode": "spt",
        "cc_mode": "on",
        "debug": False,
        "measurements": "match",
        "cert_chain": "valid",
        "ocsp": "good",
        "driver_version": "550.90.07",
    }


FIELDS = [
    "request.key",
    "request.purpose",
    "tee.verifier",
    "tee.technology",
    "tee.debug",
    "tee.secure_boot",
    "tee.software.name",
    "tee.software.support",
    "tee.software",
    "tee.workload.image_digest",
    "tee.workload.restart_policy",
    "tee.workload.signatures",
    "tee.workload.env",
    "tee.workload.args",
    "tee.platform.project_id",
    "tee.platform.zone",
    "tee.workload",
    "tee",
    "gpus",
    "request",
]
GPU_FIELDS = [
    "arch",
    "mode",
    "cc_mode",
    "debug",
    "measurements",
    "cert_chain",
    "ocsp",
    "driver_version",
    "id",
]
MISSING = object()


def _set(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node: Any = document
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node, dict) else {}
    if isinstance(node, dict):
        if value is MISSING:
            node.pop(leaf, None)
        else:
            node[leaf] = value


def generated_inputs(count: int, seed: int = 7) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    yield base_input()
    for field in FIELDS:  # every field missing and with every wrong value, once
        for value in [MISSING, *WRONG]:
            changed = base_input()
            _set(changed, field, value)
            yield changed
    for _ in range(count):  # then `count` random ones: GPU counts, GPU fields, several fields
        changed = base_input()
        if rng.random() < 0.4:  # the worked example's key (narrowed by its per-key policy)
            changed["request"]["key"] = "models/mistral"
        changed["gpus"] = [gpu(i) for i in range(rng.choice([0, 1, 2, 3, 8, 16, 64]))]
        for entry in changed["gpus"]:
            if rng.random() < 0.3:
                field = rng.choice(GPU_FIELDS)
                value = rng.choice(
                    [MISSING, *WRONG, "ppcie", "mpt", "BLACKWELL", "unknown", "revoked"]
                )
                if value is MISSING:
                    entry.pop(field, None)
                else:
                    entry[field] = value
        for _ in range(rng.randint(0, 3)):
            _set(changed, rng.choice(FIELDS[:17]), rng.choice([MISSING, *WRONG]))
        yield changed


@dataclass
class Pair:
    wasm: WasmPolicyEngine
    opa: OpaServerEngine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _policy_copy(target: Path, extra: Path | None = None) -> Path:
    return policy_copy(
        target,
        extra=extra,
        images={"models/llama": [DIGEST], "models/mistral": [DIGEST]},
        gpu_keys={"models/llama": {"min_gpus": 1, "min_driver": "550.54"}},
    )


@pytest.fixture
async def engines(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    policy = await asyncio.to_thread(_policy_copy, tmp_path / "policy", request.param)
    opa = await asyncio.to_thread(find_opa)
    wasm = WasmPolicyEngine(await asyncio.to_thread(compile_policy_dir, policy, opa=opa))
    port = _free_port()
    server = await asyncio.create_subprocess_exec(
        str(opa),
        "run",
        "--server",
        "--addr",
        f"127.0.0.1:{port}",
        "--log-level",
        "error",
        "--ignore",
        "*_test.rego",
        str(policy),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    engine = OpaServerEngine(f"http://127.0.0.1:{port}", timeout_seconds=5, digest=wasm.digest)
    await engine.open()
    try:
        for _ in range(200):
            try:
                await engine.evaluate({})
                break
            except UpstreamError:  # not up yet
                await asyncio.sleep(0.05)
        yield Pair(wasm, engine)
    finally:
        await engine.close()
        server.terminate()
        await server.wait()


@pytest.mark.parametrize(
    "engines", [None, EXAMPLE], ids=["shipped", "per-key-example"], indirect=True
)
@pytest.mark.timeout(180)
async def test_wasm_engine_agrees_with_the_opa_server(engines: Pair) -> None:
    inputs = list(generated_inputs(GENERATED_INPUTS))
    assert len(inputs) >= 500
    keys = [i["request"].get("key") for i in inputs if isinstance(i.get("request"), dict)]
    assert keys.count("models/mistral") > 100
    assert max(len(i.get("gpus") or []) for i in inputs if isinstance(i.get("gpus"), list)) == 64
    disagreements = []
    allowed = 0
    for document in inputs:
        wasm = await engines.wasm.evaluate(copy.deepcopy(document))
        opa = await engines.opa.evaluate(copy.deepcopy(document))
        allowed += wasm.allowed
        if (wasm.allowed, wasm.reasons) != (opa.allowed, opa.reasons):
            disagreements.append((document, wasm, opa))
    print(
        f"differential: {len(inputs)} inputs, {allowed} allowed, {len(disagreements)} disagreements"
    )
    assert allowed >= 1  # the base input is allowed: the comparison is not all-deny
    assert not disagreements, "\n".join(
        f"{json.dumps(d)[:300]}\n  wasm {w.allowed} {w.reasons}\n  opa  {o.allowed} {o.reasons}"
        for d, w, o in disagreements[:5]
    )


def attest_inputs() -> Iterator[dict[str, Any]]:
    """Attestation inputs (``request.kind`` = ``attest``: ``data.broker.attest``), each TEE
    field wrong or missing, and ``kind`` itself odd (then ``data.broker.release`` decides)."""

    def base() -> dict[str, Any]:  # the broker's own builder, with the release base's TEE
        release = base_input()
        return build_attest_input(
            runner_key_thumbprint="e",
            pop_key_thumbprint="p",
            tee=release["tee"],
            raw_claims={},
            gpus=release["gpus"],
            now=datetime(2026, 12, 1, tzinfo=UTC),
        )

    yield base()
    for field in [f for f in FIELDS if f.startswith("tee")]:
        for value in [MISSING, *WRONG]:
            changed = base()
            _set(changed, field, value)
            yield changed
    for value in [MISSING, *WRONG, "release", "Attest", "attest ", ["attest"]]:
        changed = base()
        _set(changed, "request.kind", value)
        yield changed


@pytest.mark.parametrize("engines", [None], ids=["shipped"], indirect=True)
@pytest.mark.timeout(180)
async def test_both_engines_send_attestations_to_the_attest_policy(engines: Pair) -> None:
    inputs = list(attest_inputs())
    disagreements = []
    allowed = []
    for document in inputs:
        wasm = await engines.wasm.evaluate(copy.deepcopy(document))
        opa = await engines.opa.evaluate(copy.deepcopy(document))
        if wasm.allowed:
            allowed.append(document)
        if (wasm.allowed, wasm.reasons) != (opa.allowed, opa.reasons):
            disagreements.append((document, wasm, opa))
    assert not disagreements, "\n".join(
        f"{json.dumps(d)[:300]}\n  wasm {w.allowed} {w.reasons}\n  opa  {o.allowed} {o.reasons}"
        for d, w, o in disagreements[:5]
    )
    assert inputs[0] in allowed  # the attest policy allows the base attestation...
    assert all(d["request"].get("kind") == "attest" for d in allowed)  # ...and only attestations
    release_of_it = await engines.wasm.evaluate({**inputs[0], "request": {"kind": "release"}})
    assert not release_of_it.allowed  # the same evidence without a key: the release policy denies
