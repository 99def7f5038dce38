"""A broker deciding with each engine configuration: an OPA server sidecar (real ``opa run
--server`` on loopback), and a signed pre-built bundle."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker.client import BrokerClientError
from broker.policy.build import build_bundle, compile_policy_dir
from broker.policy.testing import find_opa
from tests.integration.conftest import RunningBroker
from tests.policy_helpers import signing_pair
from tests.support.constants import KEY


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OpaSidecar:
    def __init__(self, policy_dir: Path) -> None:
        self.policy_dir = policy_dir
        self.port = _free_port()
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        opa = await asyncio.to_thread(find_opa)
        self.process = await asyncio.create_subprocess_exec(
            str(opa), "run", "--server", "--addr", f"127.0.0.1:{self.port}",
            "--log-level", "error", "--ignore", "*_test.rego", str(self.policy_dir),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(200):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            await self.process.wait()


@pytest.fixture
async def opa_broker(start_broker: Any) -> AsyncIterator[tuple[RunningBroker, OpaSidecar]]:
    holder: dict[str, OpaSidecar] = {}

    def setup(workdir: Path) -> None:
        holder["sidecar"] = OpaSidecar(workdir / "policies")

    # The workspace's own policy directory is what the sidecar serves.
    probe: RunningBroker = await start_broker(workdir_setup=setup)
    sidecar = holder["sidecar"]
    await sidecar.start()
    broker: RunningBroker = await start_broker(
        reuse=(probe.workdir / "broker.toml", probe.issuer),
        environ={"BROKER_POLICY_ENGINE": "opa", "BROKER_POLICY_OPA_URL": sidecar.url},
    )
    yield broker, sidecar
    await sidecar.stop()


async def test_opa_server_engine_decides_releases(
    opa_broker: tuple[RunningBroker, OpaSidecar],
) -> None:
    broker, _ = opa_broker
    async with broker.client() as client:
        released = await client.release(KEY, broker.token_source())
        assert len(released.dek) == 32
        with pytest.raises(BrokerClientError) as denied:
            await client.release(KEY, broker.token_source("sha256:" + "0" * 64))
    assert denied.value.code == "policy_denied"
    assert any("is not allowed for key" in r for r in denied.value.details["reasons"])


async def test_opa_server_gone_is_503_never_an_allow(
    opa_broker: tuple[RunningBroker, OpaSidecar],
) -> None:
    broker, sidecar = opa_broker
    await sidecar.stop()
    async with broker.client() as client:
        with pytest.raises(BrokerClientError) as caught:
            await client.release(KEY, broker.token_source())
    assert (caught.value.status, caught.value.code) == (503, "policy_unavailable")
    assert broker.records()[-1]["result"] == "error"


async def test_signed_bundle_as_the_policy(start_broker: Any, tmp_path: Path) -> None:
    signing_pair(tmp_path, "rsa")
    bundle = tmp_path / "bundle.tar.gz"
    digests: list[str] = []

    def build(workdir: Path) -> None:
        digests.append(build_bundle(workdir / "policies", bundle, opa=find_opa()).digest)
        digests.append(compile_policy_dir(workdir / "policies", opa=find_opa()).digest)
        build_bundle(
            workdir / "policies", bundle, opa=find_opa(), signing_key=tmp_path / "sign.pem",
            scope="test",
        )  # fmt: skip

    broker: RunningBroker = await start_broker(
        workdir_setup=build,
        environ={
            "BROKER_POLICY_BUNDLE": str(bundle),
            "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": str(tmp_path / "verify.pem"),
            "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": "test",
        },
    )
    async with broker.client() as client:
        assert len((await client.release(KEY, broker.token_source())).dek) == 32
    digest = broker.records()[-1]["policy_digest"]
    # the digest names the policy, not its packaging: the directory served as it is, the
    # bundle built from it, and that bundle signed all decide under one digest
    assert digests == [digest, digest]
    (change,) = [r for r in broker.records() if r["type"] == "policy_change"]
    assert (change["new_digest"], change["signed"], change["trigger"]) == (digest, True, "startup")
