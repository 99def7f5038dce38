"""Workload certificates and mTLS between runners (issue 32): what an issuance and a handshake
cost, next to a challenge, a release and a server-auth-only handshake in the same run.

One ``broker serve`` (plain HTTP on 127.0.0.1, one worker, ``[attest]`` and ``[identity]`` on,
the development CA of ``broker/dev/identity_ca.py``, the allowed image mapped to a SPIFFE path in
the identity policy's data, as the integration tests set it up). Printed:

* ``identity_*``: ``Attestation.identity()`` through the SDK, sequentially, on one attestation —
  each call makes a P-256 key and its CSR, ``POST /v1/identity`` under a DPoP proof (the broker:
  EAR, proof, identity policy, leaf signed, durable ``identity`` record), checks that the leaf
  certifies the key and names the SPIFFE ID, then fetches the trust bundle
  (``GET /v1/identity/bundle``; ``bundle_p50_ms`` is that GET alone, so the issuance itself is
  about the difference);
* ``challenge_p50_ms`` and ``release_p50_ms`` (``att.release(key)`` on the same attestation),
  asked in turn with the issuances, blocks of ``BLOCK`` each, so all meet the same machine;
* ``mtls_*``: a fresh TLS connection from one runner's ``client_context`` to another runner's
  ``server_context`` (both on SVIDs from two attestations) on 127.0.0.1: ``mtls.connect``
  (handshake, the server's SPIFFE ID checked by the client) then one byte each way through
  ``mtls.guarded`` (the client's SPIFFE ID checked by the server before it reads the byte);
* ``server_auth_*``: the same with the same server certificate and roots but no client
  certificate and no SPIFFE check (server ``CERT_NONE``, a plain client context), and the ratio.

Both ends of a handshake run in this process on one event loop: a handshake's figure is the two
sides' work added up, as when both runners share one core.

    make bench            # or: .venv/bin/python bench/identity_bench.py --issuances 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from release_bench import Broker, bench_workspace, wait_ready

from broker.client import BrokerClient
from broker.client.identity import Identity
from broker.client.mtls import SpiffeContext, connect, guarded
from broker.dev.identity_ca import make_dev_identity_ca
from broker.dev.issuer import DevIssuer, DevTokenSource, Workload
from broker.dev.workspace import write_private_pem
from tests.support.constants import ALLOWED, KEY

TRUST_DOMAIN = "runners.bench.invalid"
SPIFFE_PATH = "shards/bench"
SPIFFE_ID = f"spiffe://{TRUST_DOMAIN}/{SPIFFE_PATH}"
BLOCK = 25
EXTRA_TOML = f"""
[attest]
enabled = true
signing_key = "result-signing.pem"

[identity]
enabled = true
trust_domain = "{TRUST_DOMAIN}"
ca_certificates = "identity/ca-chain.pem"
ca_key = "identity/ca.key"
max_lifetime_seconds = 3600
"""


def workspace(workdir: Path, issuer: DevIssuer) -> Path:
    """Plain HTTP, attestation results and workload certificates on, a development CA."""
    workdir.mkdir(parents=True)
    write_private_pem(workdir / "result-signing.pem", ec.generate_private_key(ec.SECP256R1()))
    make_dev_identity_ca(workdir / "identity", TRUST_DOMAIN, now=datetime.now(UTC))
    config = bench_workspace(workdir, issuer, nonce_ttl_seconds=3600, extra_toml=EXTRA_TOML)
    data_file = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text(encoding="utf-8"))
    data["identities"] = {ALLOWED: SPIFFE_PATH}
    data_file.write_text(json.dumps(data), encoding="utf-8")
    return config


def token_source(issuer: DevIssuer) -> DevTokenSource:
    return DevTokenSource(issuer, Workload(image_digest=ALLOWED), lambda: datetime.now(UTC))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000, 3)


async def timed(times: list[float], call: Callable[[], Awaitable[object]]) -> None:
    started = time.perf_counter()
    await call()
    times.append(time.perf_counter() - started)


async def broker_round_trips(url: str, issuer: DevIssuer, count: int) -> dict[str, float]:
    """Issuances, bundle GETs, challenges and releases on one attestation, in blocks, in turn."""
    source = token_source(issuer)
    times: dict[str, list[float]] = {"identity": [], "bundle": [], "challenge": [], "release": []}
    async with BrokerClient(url) as client:
        attestation = await client.attest(source)
        for _ in range(10):  # warm every path
            await attestation.identity()
            await client.challenge()
            await attestation.release(KEY)
        for _ in range(0, count, BLOCK):
            for _ in range(BLOCK):
                await timed(times["identity"], attestation.identity)
            for _ in range(BLOCK):
                await timed(times["bundle"], client.identity_bundle)
            for _ in range(BLOCK):
                await timed(times["challenge"], client.challenge)
            for _ in range(BLOCK):
                await timed(times["release"], lambda: attestation.release(KEY))
        if attestation.renewals:
            raise SystemExit("the attestation was renewed during the run: raise its TTL")
    return {
        "identity_p50_ms": percentile(times["identity"], 0.5),
        "identity_p90_ms": percentile(times["identity"], 0.9),
        "bundle_p50_ms": percentile(times["bundle"], 0.5),
        "challenge_p50_ms": percentile(times["challenge"], 0.5),
        "release_p50_ms": percentile(times["release"], 0.5),
        "identity_vs_release_p50": round(
            percentile(times["identity"], 0.5) / percentile(times["release"], 0.5), 2
        ),
    }


class _Echo(asyncio.Protocol):
    """Answers every byte it reads (the server's application)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


async def two_identities(url: str, issuer: DevIssuer) -> tuple[Identity, Identity]:
    """Two runners: each its own attestation and SVID."""
    source = token_source(issuer)
    made = []
    for _ in range(2):
        async with BrokerClient(url) as client:
            made.append(await (await client.attest(source)).identity())
    return made[0], made[1]


async def handshakes(server_id: Identity, client_id: Identity, count: int) -> dict[str, Any]:
    """``count`` fresh connections each way (mTLS + SPIFFE checks, then server-auth only), in
    blocks of ``BLOCK``, in turn: connect, one byte there and back, close."""
    loop = asyncio.get_running_loop()
    mtls_server = await server_id.server_context(allowed=[SPIFFE_ID])
    mtls_client = await client_id.client_context(allowed=[SPIFFE_ID])
    plain_server = await server_id.server_context(allowed=[SPIFFE_ID])
    plain_server.verify_mode = ssl.CERT_NONE  # no client certificate asked for
    plain_server.sslobject_class = ssl.SSLObject  # and no SPIFFE check in its handshake
    plain_client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    plain_client.minimum_version = ssl.TLSVersion.TLSv1_2
    plain_client.check_hostname = False
    plain_client.load_verify_locations(cadata=client_id.bundle_pem)
    mutual = await loop.create_server(guarded(_Echo, mtls_server), "127.0.0.1", 0, ssl=mtls_server)
    plain = await loop.create_server(_Echo, "127.0.0.1", 0, ssl=plain_server)
    mutual_port = mutual.sockets[0].getsockname()[1]
    plain_port = plain.sockets[0].getsockname()[1]
    times: dict[str, list[float]] = {
        "mtls": [],
        "plain": [],
        "mtls_connect": [],
        "plain_connect": [],
    }
    versions: set[str] = set()

    async def one(kind: str, port: int, context: ssl.SSLContext) -> None:
        started = time.perf_counter()
        if isinstance(context, SpiffeContext):
            reader, writer, peer = await connect("127.0.0.1", port, context)
            if peer != SPIFFE_ID:
                raise SystemExit(f"peer {peer}")
        else:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname=""
            )
        connected = time.perf_counter()
        versions.add(str(writer.get_extra_info("ssl_object").version()))
        writer.write(b"x")
        if await reader.readexactly(1) != b"x":
            raise SystemExit("echo")
        done = time.perf_counter()
        times[kind].append(done - started)
        times[kind + "_connect"].append(connected - started)
        writer.close()
        await writer.wait_closed()

    try:
        for _ in range(20):  # warm both paths
            await one("mtls", mutual_port, mtls_client)
            await one("plain", plain_port, plain_client)
        for values in times.values():
            values.clear()
        for _ in range(0, count, BLOCK):
            for _ in range(BLOCK):
                await one("mtls", mutual_port, mtls_client)
            for _ in range(BLOCK):
                await one("plain", plain_port, plain_client)
    finally:
        mutual.close()
        plain.close()
    return {
        "tls_versions": sorted(versions),
        "mtls_handshake_p50_ms": percentile(times["mtls"], 0.5),
        "mtls_handshake_p90_ms": percentile(times["mtls"], 0.9),
        "mtls_connect_only_p50_ms": percentile(times["mtls_connect"], 0.5),
        "server_auth_handshake_p50_ms": percentile(times["plain"], 0.5),
        "server_auth_handshake_p90_ms": percentile(times["plain"], 0.9),
        "server_auth_connect_only_p50_ms": percentile(times["plain_connect"], 0.5),
        "mtls_vs_server_auth_p50": round(
            percentile(times["mtls"], 0.5) / percentile(times["plain"], 0.5), 2
        ),
    }


async def main(issuances: int, connections: int) -> None:
    load = round(os.getloadavg()[0], 2)  # before this run adds its own
    with tempfile.TemporaryDirectory(prefix="broker-identity-bench-") as tmp:
        issuer = DevIssuer(dev_mode=True)
        config = workspace(Path(tmp) / "b", issuer)
        broker = Broker(config, 1)
        try:
            await wait_ready(broker.url + "/readyz")
            issued = await broker_round_trips(broker.url, issuer, issuances)
            server_id, client_id = await two_identities(broker.url, issuer)
        finally:
            broker.stop()
        tls = await handshakes(server_id, client_id, connections)
    print(
        json.dumps(
            {
                "issuances": issuances,
                "connections": connections,
                "cpus": os.cpu_count(),
                "load_average_1m": load,
                **issued,
                **tls,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--issuances", type=int, default=200)
    parser.add_argument("--connections", type=int, default=500)
    args = parser.parse_args()
    asyncio.run(main(args.issuances, args.connections))
