"""GPU evidence sources that ship with the SDK, so a GPU runner writes no evidence code.

* ``NvmlGpuEvidenceSource`` — raw evidence from the driver through NVML (``nvidia-ml-py``, the
  ``pynvml`` module): for each GPU, the confidential-computing attestation report made for the
  broker's GPU nonce (``nvmlDeviceGetConfComputeGpuAttestationReport``) and the device's
  attestation certificate chain (``nvmlDeviceGetConfComputeGpuCertificate``), in NVIDIA's
  ``evidence_list`` shape. The broker verifies it itself (evidence kind ``nvidia``).
* ``NrasGpuEvidenceSource`` — the same evidence sent to NVIDIA's Remote Attestation Service
  (``POST {url}/v3/attest/gpu``, the GPU nonce in hex); NRAS's signed answer goes to the broker
  (evidence kind ``nras``), which checks its signature, claims and nonce.

**Not run on hardware**: no GPU is available where this was built. The NVML calls follow NVIDIA's
nvtrust local verifier (``nvmlDeviceGetConfComputeGpuAttestationReport(handle, nonce)`` returning
``attestationReport``/``attestationReportSize``; ``nvmlDeviceGetConfComputeGpuCertificate``
returning ``attestationCertChain``/``attestationCertChainSize``). The tests drive them with a
fake ``pynvml`` that replays a real Hopper report from the fixtures, and send the real NRAS
request of that run to a loopback server that replays NRAS's real answer; both results are then
verified by the broker's own verifiers.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import ssl
import threading
from types import ModuleType
from typing import Any

import aiohttp

from broker.client.tokens import TokenSourceError

NRAS_URL = "https://nras.attestation.nvidia.com"
MAX_GPUS = 8
_NVML_LOCK = threading.Lock()  # NVML init/shutdown are process-wide


class NvmlGpuEvidenceSource:
    """Raw GPU evidence from NVML for every GPU (or the ``indexes`` given)."""

    evidence_kind = "nvidia"

    def __init__(
        self,
        *,
        arch: str | None = None,
        indexes: list[int] | None = None,
        nvml: ModuleType | None = None,
    ) -> None:
        self._arch = arch
        self._indexes = indexes
        self._nvml = nvml

    def _module(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            return importlib.import_module("pynvml")
        except ImportError as exc:
            raise TokenSourceError("nvidia-ml-py (pynvml) is not installed") from exc

    def collect(self, gpu_nonce: bytes) -> dict[str, Any]:
        """Blocking: the ``evidence_list`` for ``gpu_nonce`` (32 bytes)."""
        if len(gpu_nonce) != 32:
            raise ValueError("the GPU nonce is 32 bytes")
        nvml = self._module()
        items = []
        with _NVML_LOCK:
            try:
                nvml.nvmlInit()
                try:
                    count = nvml.nvmlDeviceGetCount()
                    indexes = self._indexes if self._indexes is not None else list(range(count))
                    if not indexes or len(indexes) > MAX_GPUS:
                        raise TokenSourceError(f"{len(indexes)} GPUs: expected 1..{MAX_GPUS}")
                    for index in indexes:
                        handle = nvml.nvmlDeviceGetHandleByIndex(index)
                        report = nvml.nvmlDeviceGetConfComputeGpuAttestationReport(
                            handle, gpu_nonce
                        )
                        certificate = nvml.nvmlDeviceGetConfComputeGpuCertificate(handle)
                        report_bytes = bytes(
                            report.attestationReport[: report.attestationReportSize]
                        )
                        chain = bytes(
                            certificate.attestationCertChain[: certificate.attestationCertChainSize]
                        )
                        items.append(
                            {
                                "evidence": base64.b64encode(report_bytes).decode(),
                                "certificate": base64.b64encode(chain).decode(),
                            }
                        )
                finally:
                    nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                raise TokenSourceError(f"NVML: {exc}") from exc
        evidence: dict[str, Any] = {"evidence_list": items}
        if self._arch is not None:
            evidence["arch"] = self._arch
        return evidence

    async def evidence(self, gpu_nonce: bytes) -> object:
        return await asyncio.to_thread(self.collect, gpu_nonce)


class NrasGpuEvidenceSource:
    """NVML evidence attested by NRAS; the broker receives NRAS's signed answer."""

    evidence_kind = "nras"

    def __init__(
        self,
        nvml_source: NvmlGpuEvidenceSource,
        *,
        url: str = NRAS_URL,
        arch: str = "HOPPER",
        ssl_context: ssl.SSLContext | None = None,
        timeout_seconds: float = 30.0,
    ) -> None:
        if not url.startswith("https://"):
            raise ValueError("NRAS is reached over https only")
        self._nvml = nvml_source
        self._url = url.rstrip("/") + "/v3/attest/gpu"
        self._arch = arch
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def evidence(self, gpu_nonce: bytes) -> object:
        collected = await self._nvml.evidence(gpu_nonce)
        assert isinstance(collected, dict)  # noqa: S101 - NvmlGpuEvidenceSource's own shape
        request = {
            "nonce": gpu_nonce.hex(),
            "arch": self._arch,
            "evidence_list": collected["evidence_list"],
        }
        try:
            async with (
                aiohttp.ClientSession(timeout=self._timeout) as session,
                session.post(self._url, json=request, ssl=self._ssl) as response,
            ):
                body = await response.json(content_type=None)
                if response.status != 200:
                    raise TokenSourceError(f"NRAS answered {response.status}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TokenSourceError(f"NRAS could not be reached: {type(exc).__name__}") from exc
        return body
