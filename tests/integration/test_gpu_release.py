"""CPU + GPU evidence end to end: Confidential Space token plus NRAS or raw NVIDIA evidence.

The simulated NVIDIA world (tests/vectors/gpu.py) stands in for NVIDIA's services, because real
GPU evidence cannot be bound to a fresh broker nonce; the real artifacts are exercised by the
unit tests with the same verifiers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from broker.client import BrokerClientError
from tests.integration.conftest import RunningBroker
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.support.constants import GPU_KEY, KEY
from tests.vectors.gpu import (
    DRIVER,
    OcspResponder,
    RimAuthority,
    SimulatedGpu,
    SimulatedNras,
    pem,
)

GPU_POLICY = {GPU_KEY: {"min_gpus": 1, "min_driver": "550.54", "ocsp_unknown_ok": True}}


@asynccontextmanager
async def serve_ocsp(responder: OcspResponder) -> AsyncIterator[str]:
    """The simulated OCSP responder over HTTP on loopback; yields its URL."""

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=responder.answer(await request.read()))

    app = web.Application()
    app.router.add_post("/", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/"
    finally:
        await runner.cleanup()


class LocalGpu:
    evidence_kind = "nvidia"

    def __init__(self, gpu: SimulatedGpu, **report: Any) -> None:
        self.gpu, self.report = gpu, report

    async def evidence(self, gpu_nonce: bytes) -> object:
        return self.gpu.evidence(gpu_nonce, **self.report)


class Nras:
    evidence_kind = "nras"

    def __init__(self, nras: SimulatedNras, **result: Any) -> None:
        self.nras, self.result = nras, result

    async def evidence(self, gpu_nonce: bytes) -> object:
        return self.nras.result(gpu_nonce, **self.result)


# A second device (same firmware, its own identity) whose root the GPU brokers also trust.
SECOND_GPU = SimulatedGpu(datetime.now(UTC))


class TwoGpus:
    """Evidence of two distinct devices in one request, each with its own feature flag."""

    evidence_kind = "nvidia"

    def __init__(self, gpu: SimulatedGpu, flags: tuple[int, int]) -> None:
        self.gpus, self.flags = (gpu, SECOND_GPU), flags

    async def evidence(self, gpu_nonce: bytes) -> object:
        first, second = (
            g.evidence(gpu_nonce, feature_flags=(f,))
            for g, f in zip(self.gpus, self.flags, strict=True)
        )
        first["evidence_list"] += second["evidence_list"]
        return first


class FixedNonceGpu(LocalGpu):
    async def evidence(self, gpu_nonce: bytes) -> object:
        return self.gpu.evidence(bytes(32))  # evidence made for someone else's nonce


@pytest.fixture
def world() -> tuple[SimulatedGpu, RimAuthority, SimulatedNras]:
    now = datetime.now(UTC)
    return SimulatedGpu(now), RimAuthority(now), SimulatedNras(now)


@pytest.fixture
async def gpu_broker(
    start_broker: Callable[..., Any], world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> RunningBroker:
    return await start_gpu_broker(start_broker, world)


async def start_gpu_broker(
    start_broker: Callable[..., Any],
    world: tuple[SimulatedGpu, RimAuthority, SimulatedNras],
    ocsp_url: str | None = None,
    environ: dict[str, str] | None = None,
    attest: bool = False,
) -> RunningBroker:
    gpu, authority, nras = world

    def setup(workdir: Path) -> None:
        if attest:
            with_result_key(workdir)
        (workdir / "gpu").mkdir()
        (workdir / "gpu" / "device_root.pem").write_bytes(pem([gpu.root, SECOND_GPU.root]))
        (workdir / "gpu" / "rim_root.pem").write_bytes(pem([authority.root]))
        (workdir / "gpu" / "nras_intermediate.pem").write_bytes(pem([nras.intermediate]))
        (workdir / "gpu" / "nras_jwks.json").write_text(json.dumps(nras.jwks()))
        rims = workdir / "gpu" / "rims"
        rims.mkdir()
        driver = {i - 1: v for i, v in gpu.measurements.items() if i <= 4}
        vbios = {i - 1: v for i, v in gpu.measurements.items() if i > 4}
        (rims / "NV_GPU_DRIVER_GH100_550.90.07.swidtag").write_bytes(authority.rim(DRIVER, driver))
        (rims / "NV_GPU_VBIOS_1010_0200_882_96009F0001.swidtag").write_bytes(
            authority.rim("96.00.9F.00.01", vbios)
        )

    extra = f"""
[[issuers]]
kind = "nras"
issuer = "{nras.issuer}"
jwks_file = "gpu/nras_jwks.json"
root_cert = "gpu/nras_intermediate.pem"

[nvidia]
device_root = "gpu/device_root.pem"
rim_root = "gpu/rim_root.pem"
rim_dir = "gpu/rims"
"""
    if ocsp_url:
        extra += f'ocsp_url = "{ocsp_url}"\nocsp_cache_seconds = 0\n'
    if attest:
        extra += "\n" + ATTEST_TOML

    return await start_broker(  # type: ignore[no-any-return]
        extra_toml=extra, gpu_keys=GPU_POLICY, workdir_setup=setup, environ=environ
    )


async def test_cpu_plus_local_gpu_evidence_releases_gpu_key(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    async with gpu_broker.client() as client:
        released = await client.release(
            GPU_KEY, gpu_broker.token_source(gpu_cc_mode="ON"), gpu_source=LocalGpu(world[0])
        )
    assert len(released.dek) == 32
    record = gpu_broker.records()[-1]
    assert record["result"] == "allow"
    assert set(record["evidence_digests"]) == {"gca", "nvidia"}


async def test_cpu_plus_nras_result_releases_gpu_key(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    async with gpu_broker.client() as client:
        released = await client.release(
            GPU_KEY, gpu_broker.token_source(gpu_cc_mode="ON"), gpu_source=Nras(world[2], gpus=2)
        )
    assert released.key == GPU_KEY


async def test_gpu_key_denied_without_gpu_evidence(gpu_broker: RunningBroker) -> None:
    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(GPU_KEY, gpu_broker.token_source(gpu_cc_mode="ON"))
    assert caught.value.code == "policy_denied"
    assert (
        f"key {GPU_KEY} needs at least 1 attested GPU(s), got 0" in caught.value.details["reasons"]
    )


async def test_gpu_with_changed_firmware_denied_with_reason(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    gpu = world[0]
    tampered = {**gpu.measurements, 3: b"\x66" * 48}
    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(
                GPU_KEY,
                gpu_broker.token_source(gpu_cc_mode="ON"),
                gpu_source=LocalGpu(gpu, measurements=tampered),
            )
    assert caught.value.code == "policy_denied"
    assert "GPU GPU-0: measurements mismatch" in caught.value.details["reasons"]


async def test_gpu_without_cc_mode_claim_denied(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(GPU_KEY, gpu_broker.token_source(), gpu_source=LocalGpu(world[0]))
    assert (
        "GPU GPU-0: confidential computing mode is unknown, not on"
        in caught.value.details["reasons"]
    )


async def test_gpu_evidence_for_another_nonce_rejected(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(
                GPU_KEY,
                gpu_broker.token_source(gpu_cc_mode="ON"),
                gpu_source=FixedNonceGpu(world[0]),
            )
    assert (caught.value.status, caught.value.code) == (401, "nonce_mismatch")


async def test_nras_result_for_another_nonce_rejected(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    class StaleNras(Nras):
        async def evidence(self, gpu_nonce: bytes) -> object:
            return self.nras.result(bytes(32))

    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(
                GPU_KEY, gpu_broker.token_source(gpu_cc_mode="ON"), gpu_source=StaleNras(world[2])
            )
    assert caught.value.code == "nonce_mismatch"


async def test_nras_failed_measurements_denied(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(
                GPU_KEY,
                gpu_broker.token_source(gpu_cc_mode="ON"),
                gpu_source=Nras(world[2], measres="fail"),
            )
    assert "GPU GPU-0: measurements mismatch" in caught.value.details["reasons"]


async def test_gpu_from_an_untrusted_device_root_rejected(gpu_broker: RunningBroker) -> None:
    stranger = SimulatedGpu(datetime.now(UTC))
    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(
                GPU_KEY, gpu_broker.token_source(gpu_cc_mode="ON"), gpu_source=LocalGpu(stranger)
            )
    assert caught.value.code == "cert_chain_invalid"


async def test_missing_rims_leave_measurements_unverified_and_deny(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    for rim in (gpu_broker.workdir / "gpu" / "rims").iterdir():
        rim.unlink()
    async with gpu_broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(
                GPU_KEY, gpu_broker.token_source(gpu_cc_mode="ON"), gpu_source=LocalGpu(world[0])
            )
    assert "GPU GPU-0: measurements unverified" in caught.value.details["reasons"]


async def test_cpu_only_key_still_released_with_gpu_evidence(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    async with gpu_broker.client() as client:
        released = await client.release(
            KEY, gpu_broker.token_source(), gpu_source=LocalGpu(world[0])
        )
    assert released.key == KEY


async def test_two_gpu_pieces_refused(gpu_broker: RunningBroker) -> None:
    async with gpu_broker.client() as client:
        challenge = await client.challenge()
        with pytest.raises(BrokerClientError) as caught:
            await client._post(
                "/v1/release",
                {
                    "key": GPU_KEY,
                    "nonce": challenge.nonce,
                    "runner_key": {"kty": "OKP", "crv": "X25519", "x": "CQ" + "A" * 41},
                    "evidence": {"gca": "x", "nras": [], "nvidia": {}},
                },
            )
    assert (caught.value.status, caught.value.code) == (400, "evidence_unsupported")


async def test_revoked_gpu_certificate_denied_through_ocsp(
    start_broker: Callable[..., Any], world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    gpu, authority = world[0], world[1]
    responder = OcspResponder(gpu, extra_chains=[(authority.chain, authority.keys)])

    async with serve_ocsp(responder) as url:
        broker = await start_gpu_broker(start_broker, world, ocsp_url=url)
        token = broker.token_source(gpu_cc_mode="ON")
        async with broker.client() as client:
            await client.release(GPU_KEY, token, gpu_source=LocalGpu(gpu))  # all good
            responder.revoked = frozenset({gpu.chain[1].serial_number})
            with pytest.raises(BrokerClientError) as caught:
                await client.release(GPU_KEY, token, gpu_source=LocalGpu(gpu))
        assert "GPU GPU-0: device certificate status revoked" in caught.value.details["reasons"]
        # Per release: 3 device-chain certificates + 3 for the signer chain both RIMs share
        # (each certificate asked about once); ocsp_cache_seconds = 0: asked again each time.
        assert responder.requests == 2 * (3 + 3)


async def refused(broker: RunningBroker, gpu_source: Any) -> BrokerClientError:
    """Release GPU_KEY with CC on and this GPU evidence; the refusal it must get."""
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(
                GPU_KEY, broker.token_source(gpu_cc_mode="ON"), gpu_source=gpu_source
            )
    return caught.value


async def test_gpus_in_mixed_modes_denied(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    error = await refused(gpu_broker, TwoGpus(world[0], (0, 2)))  # SPT + PPCIe
    assert "GPUs run in mixed modes (ppcie, spt); one mode is required" in error.details["reasons"]


async def test_one_gpu_sent_twice_is_refused_and_recorded(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    """Two reports of one device must not meet a policy's min_gpus: 2."""
    error = await refused(gpu_broker, LocalGpu(world[0], feature_flags=(0, 0)))
    assert error.code == "gpu_evidence_duplicate"
    record = [r for r in gpu_broker.records() if r["type"] == "release"][-1]
    assert (record["result"], record["code"]) == ("deny", "gpu_evidence_duplicate")


@pytest.mark.parametrize("declared", [None, "HOPPER"])
async def test_gpu_architecture_inferred_from_the_certificate(
    gpu_broker: RunningBroker,
    world: tuple[SimulatedGpu, RimAuthority, SimulatedNras],
    declared: str | None,
) -> None:
    async with gpu_broker.client() as client:
        released = await client.release(
            GPU_KEY,
            gpu_broker.token_source(gpu_cc_mode="ON"),
            gpu_source=LocalGpu(world[0], declared_arch=declared),
        )
    assert released.key == GPU_KEY


async def test_declared_arch_contradicting_the_evidence_names_both(
    gpu_broker: RunningBroker, world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    error = await refused(gpu_broker, LocalGpu(world[0], declared_arch="BLACKWELL"))
    assert error.code == "gpu_arch_mismatch"
    assert "BLACKWELL" in error.message
    assert "HOPPER" in error.message


async def test_revoked_rim_signer_denied_through_ocsp(
    start_broker: Callable[..., Any], world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    gpu, authority = world[0], world[1]
    responder = OcspResponder(gpu, extra_chains=[(authority.chain, authority.keys)])
    responder.revoked = frozenset({authority.chain[0].serial_number})  # the RIM signer

    async with serve_ocsp(responder) as url:
        broker = await start_gpu_broker(start_broker, world, ocsp_url=url)
        error = await refused(broker, LocalGpu(gpu))
        assert "GPU GPU-0: device certificate status revoked" in error.details["reasons"]


async def test_unreadable_rim_directory_is_503_and_logged(
    start_broker: Callable[..., Any], world: tuple[SimulatedGpu, RimAuthority, SimulatedNras]
) -> None:
    broker = await start_gpu_broker(start_broker, world)
    rim = broker.workdir / "gpu" / "rims" / "NV_GPU_DRIVER_GH100_550.90.07.swidtag"
    rim.unlink()
    rim.mkdir()  # reading it fails with an OSError other than "not found" (as root: no EACCES)
    error = await refused(broker, LocalGpu(world[0]))
    assert (error.status, error.code) == (503, "rim_source_unavailable")
    record = broker.records()[-1]
    assert (record["result"], record["code"]) == ("error", "rim_source_unavailable")


@pytest.mark.parametrize("revoked", ["device", "rim"])
async def test_what_ocsp_revokes_revokes_the_attestations_that_used_it(
    start_broker: Callable[..., Any],
    world: tuple[SimulatedGpu, RimAuthority, SimulatedNras],
    revoked: str,
) -> None:
    """A result attested with this GPU's evidence keeps releasing until the broker sees (in any
    later verification: here a full-evidence release) the GPU's certificate or a RIM signer it
    used revoked by OCSP; then the result is revoked, logged with what OCSP revoked, and the
    next release on it is refused with that reason."""
    gpu, authority = world[0], world[1]
    responder = OcspResponder(gpu, extra_chains=[(authority.chain, authority.keys)])
    async with serve_ocsp(responder) as url:
        broker = await start_gpu_broker(start_broker, world, ocsp_url=url, attest=True)
        token = broker.token_source(gpu_cc_mode="ON")
        async with broker.client() as client:
            attestation = await client.attest(token, gpu_source=LocalGpu(gpu))
            await attestation.release(GPU_KEY)
            responder.revoked = frozenset(
                {
                    gpu.chain[1].serial_number
                    if revoked == "device"
                    else authority.chain[0].serial_number
                }
            )
            with pytest.raises(BrokerClientError):  # the broker sees it here
                await client.release(GPU_KEY, token, gpu_source=LocalGpu(gpu))
            with pytest.raises(BrokerClientError) as caught:
                await attestation.release(GPU_KEY)
    assert caught.value.code == "attestation_revoked"
    assert caught.value.details["reason"].startswith("revoked by OCSP: ")
    (record,) = [r for r in broker.records() if r["type"] == "attestation_revoked"]
    assert record["who"] == "ocsp"
    prefix = "gpu:" if revoked == "device" else "rim:"
    assert record["revoked"]
    assert all(item.startswith(prefix) for item in record["revoked"])
