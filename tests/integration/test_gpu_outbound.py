"""Nothing goes out before the evidence is authentic (issue 27, item 4).

The finding: one unauthenticated release carrying 8 junk GPU entries (each a 21-certificate
chain of the attacker's own, an SPDM report it signed itself, a driver version of its choosing)
made 152 OCSP POSTs and 9 RIM GETs (attacker-chosen RIM ids) before any signature, chain root or
chain length was checked. Here real loopback OCSP and RIM servers count what a broker asks them.

Now the CPU token is verified first, then each GPU report's chain length, chain to the pinned
device root and SPDM signature; only then are RIMs (ids of a known form only) and OCSP answers
fetched, at most ``MAX_OUTBOUND_PER_REQUEST`` per request, each counted in
``broker_outbound_requests_total{kind}``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from broker.client.unwrap import new_ephemeral_key
from broker.core.binding import binding_digest
from broker.crypto.jwk import public_jwk, thumbprint
from tests.integration.conftest import RunningBroker
from tests.support.constants import GPU_KEY
from tests.vectors.gpu import (
    DRIVER,
    RIM_IDS,
    OcspResponder,
    RimAuthority,
    SimulatedGpu,
    SimulatedNras,
    pem,
)

GPU_POLICY = {GPU_KEY: {"min_gpus": 1, "min_driver": "550.54", "ocsp_unknown_ok": True}}
JUNK_GPUS = 8
JUNK_CHAIN_LENGTH = 21  # 19 OCSP questions per GPU before: 8 x 19 = 152


@dataclass
class Upstreams:
    """NVIDIA's RIM service and OCSP responder on loopback, counting what they are asked."""

    ocsp: OcspResponder
    rims: dict[str, bytes]
    nras: SimulatedNras
    asked: Counter[str] = field(default_factory=Counter)
    rim_ids: list[str] = field(default_factory=list)
    url: str = ""

    def snapshot(self) -> Counter[str]:
        return Counter(self.asked)


@asynccontextmanager
async def counting_upstreams(
    ocsp: OcspResponder, rims: dict[str, bytes], nras: SimulatedNras
) -> AsyncIterator[Upstreams]:
    upstreams = Upstreams(ocsp, rims, nras)

    async def answer_jwks(request: web.Request) -> web.Response:
        upstreams.asked["jwks"] += 1
        return web.json_response(nras.jwks())

    async def answer_ocsp(request: web.Request) -> web.Response:
        upstreams.asked["ocsp"] += 1
        return web.Response(body=ocsp.answer(await request.read()))

    async def answer_rim(request: web.Request) -> web.Response:
        upstreams.asked["rim"] += 1
        rim_id = request.match_info["rim_id"]
        upstreams.rim_ids.append(rim_id)
        if rim_id not in rims:
            return web.Response(status=404)
        data = rims[rim_id]
        body = {"id": rim_id, "rim": base64.b64encode(data).decode(), "sha256": ""}
        body["sha256"] = hashlib.sha256(data).hexdigest()
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/ocsp", answer_ocsp)
    app.router.add_get("/rims/{rim_id}", answer_rim)
    app.router.add_get("/nras-jwks", answer_jwks)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    upstreams.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield upstreams
    finally:
        await runner.cleanup()


@pytest.fixture
async def world() -> AsyncIterator[tuple[SimulatedGpu, Upstreams]]:
    now = datetime.now(UTC)
    gpu, authority = SimulatedGpu(now), RimAuthority(now)
    driver = {i - 1: v for i, v in gpu.measurements.items() if i <= 4}
    vbios = {i - 1: v for i, v in gpu.measurements.items() if i > 4}
    rims = {
        RIM_IDS[0]: authority.rim(DRIVER, driver),
        RIM_IDS[1]: authority.rim("96.00.9F.00.01", vbios),
    }
    responder = OcspResponder(gpu, extra_chains=[(authority.chain, authority.keys)])
    responder.authority = authority  # type: ignore[attr-defined]
    async with counting_upstreams(responder, rims, SimulatedNras(now)) as upstreams:
        yield gpu, upstreams


async def start_gpu_broker(
    start_broker: Callable[..., Any], gpu: SimulatedGpu, upstreams: Upstreams
) -> RunningBroker:
    authority: RimAuthority = upstreams.ocsp.authority  # type: ignore[attr-defined]

    def setup(workdir: Path) -> None:
        (workdir / "gpu").mkdir()
        (workdir / "gpu" / "device_root.pem").write_bytes(pem([gpu.root]))
        (workdir / "gpu" / "rim_root.pem").write_bytes(pem([authority.root]))
        (workdir / "gpu" / "nras.pem").write_bytes(pem([upstreams.nras.intermediate]))

    extra = f"""
[[issuers]]
kind = "nras"
issuer = "{upstreams.nras.issuer}"
jwks_url = "{upstreams.url}/nras-jwks"
root_cert = "gpu/nras.pem"

[nvidia]
device_root = "gpu/device_root.pem"
rim_root = "gpu/rim_root.pem"
rim_url = "{upstreams.url}/rims"
ocsp_url = "{upstreams.url}/ocsp"
ocsp_cache_seconds = 0
rim_cache_seconds = 1
"""
    broker: RunningBroker = await start_broker(
        extra_toml=extra, gpu_keys=GPU_POLICY, workdir_setup=setup
    )
    return broker


def junk_gpu_entry(gpu_nonce: bytes, driver: str) -> dict[str, str]:
    """One GPU entry an attacker makes alone: a ``JUNK_CHAIN_LENGTH``-certificate chain of its
    own whose leaf names a Hopper GPU, and a report it signed with that leaf, naming ``driver``
    (so the RIM ids are the attacker's to choose)."""
    now = datetime.now(UTC)
    keys = [ec.generate_private_key(ec.SECP384R1()) for _ in range(JUNK_CHAIN_LENGTH)]
    certs: list[x509.Certificate] = []
    for depth, key in enumerate(keys):
        leaf = depth == JUNK_CHAIN_LENGTH - 1
        name = x509.Name(
            [
                x509.NameAttribute(
                    x509.NameOID.COMMON_NAME, "GH100 A01 GSP FMC LF" if leaf else f"CA {depth}"
                )
            ]
        )
        issuer_name = certs[-1].subject if certs else name
        certs.append(
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1))
            .not_valid_after(now + timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=not leaf, path_length=None), critical=True)
            .sign(keys[depth - 1] if depth else key, hashes.SHA384())
        )
    chain = certs[::-1]
    return {
        "evidence": base64.b64encode(signed_report(keys[-1], gpu_nonce, driver)).decode(),
        "certificate": base64.b64encode(pem(chain)).decode(),
    }


def signed_report(key: ec.EllipticCurvePrivateKey, nonce: bytes, driver: str) -> bytes:
    """An SPDM 1.1 GET_MEASUREMENTS request and response in NVML's layout, signed by ``key``."""
    request = bytes([0x11, 0xE0, 0x01, 0xFF]) + nonce + b"\x00"
    value = os.urandom(48)
    record = bytes([1, 1]) + struct.pack("<H", 51) + b"\x01" + struct.pack("<H", 48) + value
    opaque = b"".join(
        struct.pack("<HH", kind, len(data)) + data
        for kind, data in [
            (3, driver.encode() + b"\0"),
            (6, bytes.fromhex("009f009601000000")),
            (15, b"882\0"),
            (17, b"1010\0"),
            (18, b"0200\0"),
            (20, os.urandom(48)),
        ]
    )
    response = (
        bytes([0x11, 0x60, 0x00, 0x00, 1])
        + len(record).to_bytes(3, "little")
        + record
        + os.urandom(32)
        + struct.pack("<H", len(opaque))
        + opaque
    )
    r, s = decode_dss_signature(key.sign(request + response, ec.ECDSA(hashes.SHA384())))
    return request + response + r.to_bytes(48, "big") + s.to_bytes(48, "big")


async def hostile_release(broker: RunningBroker, *, forge_cpu: bool) -> tuple[int, str]:
    """A release with a fresh genuine challenge, a CPU token (forged: payload altered after
    signing, or genuine) and ``JUNK_GPUS`` junk GPU entries; its status and error code."""
    jwk = public_jwk(new_ephemeral_key().public_key())
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{broker.url}/v1/challenge", json={}, ssl=broker.client_tls
        ) as got:
            challenge = await got.json()
        nonce = challenge["nonce"]
        token = await broker.token_source(gpu_cc_mode="ON").token(
            challenge["audience"], [nonce, thumbprint(jwk)]
        )
        if forge_cpu:
            header, payload, signature = token.split(".")
            claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
            claims["submods"]["container"]["image_digest"] = "sha256:" + "66" * 32
            forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
            token = f"{header}.{forged}.{signature}"
        gpu_nonce = binding_digest(nonce, thumbprint(jwk))
        entries = [junk_gpu_entry(gpu_nonce, f"551.{i}.99") for i in range(JUNK_GPUS)]
        body = {
            "key": GPU_KEY,
            "nonce": nonce,
            "runner_key": jwk,
            "evidence": {"gca": token, "nvidia": {"evidence_list": entries}},
        }
        async with session.post(
            f"{broker.url}/v1/release", json=body, ssl=broker.client_tls
        ) as got:
            answer = await got.json()
            return got.status, str(answer.get("error", {}).get("code"))


async def outbound_metric(broker: RunningBroker) -> dict[str, float]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{broker.url}/metrics", ssl=broker.client_tls) as got,
    ):
        text = await got.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("broker_outbound_requests_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            found[kind] = float(line.rsplit(" ", 1)[1])
    return {kind: count for kind, count in found.items() if count}


async def test_junk_gpu_evidence_makes_no_outbound_requests(
    start_broker: Callable[..., Any], world: tuple[SimulatedGpu, Upstreams]
) -> None:
    gpu, upstreams = world
    broker = await start_gpu_broker(start_broker, gpu, upstreams)

    unauthenticated = await hostile_release(broker, forge_cpu=True)
    after_forged = upstreams.snapshot()
    authenticated_cpu = await hostile_release(broker, forge_cpu=False)
    after_junk_gpu = upstreams.snapshot() - after_forged
    async with broker.client() as client:  # a genuine one-GPU release, for comparison
        released = await client.release(
            GPU_KEY, broker.token_source(gpu_cc_mode="ON"), gpu_source=LocalGpu(gpu)
        )
    genuine = upstreams.snapshot() - after_forged - after_junk_gpu
    print(
        f"\noutbound calls: forged CPU + {JUNK_GPUS} junk GPUs {dict(after_forged)}; "
        f"genuine CPU + junk GPUs {dict(after_junk_gpu)}; genuine request {dict(genuine)}"
    )

    assert unauthenticated == (401, "token_signature_invalid")
    assert authenticated_cpu == (401, "cert_chain_invalid")
    assert released.key == GPU_KEY
    assert after_forged == Counter(), after_forged  # nothing at all went out
    assert after_junk_gpu == Counter(), after_junk_gpu
    # the device chain's 3 certificates below the root, and the one signer chain both RIMs
    # share (3, asked about once)
    assert genuine == Counter({"ocsp": 3 + 3, "rim": 2}), genuine
    assert sorted(upstreams.rim_ids) == sorted(RIM_IDS)  # never an attacker-chosen id
    assert await outbound_metric(broker) == {"ocsp": 6.0, "rim": 2.0}


class LocalGpu:
    evidence_kind = "nvidia"

    def __init__(self, gpu: SimulatedGpu) -> None:
        self.gpu = gpu

    async def evidence(self, gpu_nonce: bytes) -> object:
        return self.gpu.evidence(gpu_nonce)


async def test_nras_key_sets_are_fetched_only_after_the_cpu_token_verified(
    start_broker: Callable[..., Any], world: tuple[SimulatedGpu, Upstreams]
) -> None:
    """A forged CPU token with NRAS evidence makes no JWKS request (before: NRAS's key set was
    fetched for it); the genuine request then fetches NRAS's key set, once."""
    gpu, upstreams = world
    broker = await start_gpu_broker(start_broker, gpu, upstreams)
    jwk = public_jwk(new_ephemeral_key().public_key())
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{broker.url}/v1/challenge", json={}, ssl=broker.client_tls
        ) as got:
            challenge = await got.json()
        token = await broker.token_source(gpu_cc_mode="ON").token(
            challenge["audience"], [challenge["nonce"], thumbprint(jwk)]
        )
        header, payload, signature = token.split(".")
        tail = "AAAA" if signature[-4:] != "AAAA" else "BBBB"  # a signature that fails
        body = {
            "key": GPU_KEY,
            "nonce": challenge["nonce"],
            "runner_key": jwk,
            "evidence": {
                "gca": f"{header}.{payload}.{signature[:-4]}{tail}",
                "nras": upstreams.nras.result(binding_digest(challenge["nonce"], thumbprint(jwk))),
            },
        }
        async with session.post(
            f"{broker.url}/v1/release", json=body, ssl=broker.client_tls
        ) as got:
            answer = await got.json()
    assert (got.status, answer["error"]["code"]) == (401, "token_signature_invalid")
    assert upstreams.snapshot() == Counter(), upstreams.asked
    async with broker.client() as client:
        released = await client.release(
            GPU_KEY, broker.token_source(gpu_cc_mode="ON"), gpu_source=Nras(upstreams.nras)
        )
    assert released.key == GPU_KEY
    assert upstreams.snapshot() == Counter({"jwks": 1}), upstreams.asked
    assert await outbound_metric(broker) == {"jwks": 1.0}


class Nras:
    evidence_kind = "nras"

    def __init__(self, nras: SimulatedNras) -> None:
        self.nras = nras

    async def evidence(self, gpu_nonce: bytes) -> object:
        return self.nras.result(gpu_nonce, gpus=1)
