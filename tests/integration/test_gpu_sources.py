"""The SDK's GPU evidence sources, without a GPU.

``ReplayedHopperNvml`` is a stand-in for the ``pynvml`` module that replays what a real Hopper
GPU produced (tests/fixtures/real/nvidia/nras_gpu_evidence_2026-09-16.json, provenance in
PROVENANCE.md): it answers only for the nonce that GPU was asked for. The NVML source's output is
verified by the broker's own local verifier; the NRAS source's request is answered by a loopback
HTTPS server that replays NRAS's real answer to that same request, verified by the broker's NRAS
verifier. Neither source has run on hardware (docs/runner.md says so).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509

from broker.attestation.nvidia import local
from broker.attestation.nvidia.nras import NrasTrust, verify_nras
from broker.client.gpu import NrasGpuEvidenceSource, NvmlGpuEvidenceSource
from broker.client.tokens import TokenSourceError
from broker.crypto.jwks import parse_jwks
from broker.dev.tls import make_dev_tls

NV = Path(__file__).parents[1] / "fixtures" / "real" / "nvidia"
RECORDED = json.loads((NV / "nras_gpu_evidence_2026-09-16.json").read_text())
NRAS_ANSWER = json.loads((NV / "nras_response_2026-09-16.json").read_text())
NONCE = bytes.fromhex(RECORDED["nonce"])
AT = datetime(2026, 9, 16, 20, 51, 44, tzinfo=UTC)
DEVICE_ROOT = x509.load_pem_x509_certificate((NV / "verifier_device_root.pem").read_bytes())


class ReplayedHopperNvml:
    """Fake ``pynvml``: replays one real Hopper GPU's report and chain for its recorded nonce."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        item = RECORDED["evidence_list"][0]
        self.report = base64.b64decode(item["evidence"])
        self.chain = base64.b64decode(item["certificate"])
        self.calls: list[str] = []
        self.initialised = False

    def nvmlInit(self) -> None:
        self.calls.append("init")
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        assert self.initialised
        return ("gpu", index)

    def nvmlDeviceGetConfComputeGpuAttestationReport(self, handle: object, nonce: bytes) -> Any:
        self.calls.append(f"report {bytes(nonce).hex()}")
        if bytes(nonce) != NONCE:
            raise self.NVMLError("a replay can only answer the nonce the GPU was asked")
        padded = self.report + bytes(8192 - len(self.report))  # NVML's fixed-size buffer
        return SimpleNamespace(attestationReport=padded, attestationReportSize=len(self.report))

    def nvmlDeviceGetConfComputeGpuCertificate(self, handle: object) -> Any:
        padded = self.chain + bytes(0x1400 - len(self.chain) % 0x1400)
        return SimpleNamespace(
            attestationCertChain=padded, attestationCertChainSize=len(self.chain)
        )


async def test_nvml_source_output_verifies_with_the_broker_verifier() -> None:
    nvml = ReplayedHopperNvml()
    source = NvmlGpuEvidenceSource(arch="HOPPER", nvml=nvml)  # type: ignore[arg-type]
    evidence = await source.evidence(NONCE)
    assert nvml.calls == ["init", f"report {NONCE.hex()}", "shutdown"]
    arch, (gpu,) = local.parse_local_evidence(evidence)
    verified = local.verify_gpu_report(
        gpu, arch=arch, device_roots=[DEVICE_ROOT], expected_nonce=NONCE, now=AT
    )
    assert verified.report.driver_version == "595.71.05"
    with pytest.raises(TokenSourceError):
        await source.evidence(bytes(32))  # NVML's error becomes the SDK's
    assert nvml.calls[-1] == "shutdown"  # NVML is shut down even when a call fails


async def test_nras_source_sends_the_recorded_request_and_its_answer_verifies(
    tmp_path: Path,
) -> None:
    received: list[dict[str, Any]] = []

    async def attest(request: web.Request) -> web.Response:
        body = await request.json()
        received.append(body)
        if body != RECORDED:
            return web.json_response({"error": "not the recorded request"}, status=400)
        return web.json_response(NRAS_ANSWER)

    tls = await asyncio.to_thread(make_dev_tls, tmp_path / "tls", now=datetime.now(UTC))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(tls.server_cert, tls.server_key)
    app = web.Application()
    app.router.add_post("/v3/attest/gpu", attest)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls)
    await site.start()
    try:
        source = NrasGpuEvidenceSource(
            NvmlGpuEvidenceSource(nvml=ReplayedHopperNvml()),  # type: ignore[arg-type]
            url=f"https://127.0.0.1:{runner.addresses[0][1]}",
            ssl_context=ssl.create_default_context(cafile=str(tls.ca_cert)),
        )
        answer = await source.evidence(NONCE)
    finally:
        await runner.cleanup()
    assert received == [RECORDED]
    trust = NrasTrust(
        issuer="https://nras.attestation.nvidia.com",
        algorithms=("ES384",),
        keys=parse_jwks((NV / "nras_jwks_subset_2026-09-16.json").read_bytes()),
        anchors=[
            x509.load_pem_x509_certificate((NV / "nras_gpu_intermediate_004.pem").read_bytes())
        ],
    )
    result = verify_nras(answer, trust=trust, expected_nonce=NONCE, now=AT)
    assert result is not None


def test_nras_source_refuses_plain_http() -> None:
    with pytest.raises(ValueError, match="https"):
        NrasGpuEvidenceSource(NvmlGpuEvidenceSource(), url="http://nras.example")
