"""A policy mounted the way the kubelet mounts a ConfigMap, served by ``broker serve``.

The kubelet's volume layout, exactly: the files live in ``..<timestamp>/``, ``..data`` is a
link to it, and each item is a link into ``..data`` (``broker -> ..data/broker``). An update
writes a new ``..<timestamp>/``, points a temporary link at it and renames that link over
``..data`` (one atomic step), then deletes the old directory. The broker used to walk all three
and refuse the policy (``multiple default rules data.broker.release.allow``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from broker.dev.issuer import DevIssuer
from broker.policy.bundle import load_policy_dir
from tests.integration.conftest import write_config
from tests.support.constants import KEY
from tests.support.issuers import dev_issuer
from tests.support.processes import (
    ROOT,
    create_key_with_cli,
    free_port,
    release_body,
    wait_ready,
)

pytestmark = pytest.mark.timeout(180)


def kubelet_volume(volume: Path, source: Path, stamp: str) -> None:
    """Lay out (or atomically update) ``volume`` as the kubelet's atomic writer does."""
    volume.mkdir(parents=True, exist_ok=True)
    fresh = volume / f"..{stamp}"
    shutil.copytree(source, fresh)
    old = os.readlink(volume / "..data") if (volume / "..data").is_symlink() else None
    (volume / "..data_tmp").symlink_to(fresh.name)
    os.rename(volume / "..data_tmp", volume / "..data")  # the one atomic step
    for item in os.listdir(source):
        if not (volume / item).is_symlink():
            (volume / item).symlink_to(f"..data/{item}")
    if old is not None:
        shutil.rmtree(volume / old)


def test_the_kubelet_layout_reads_as_the_plain_directory(tmp_path: Path) -> None:
    source = Path(ROOT) / "policies"
    kubelet_volume(tmp_path / "volume", source, "2026_12_01_10_00_00.000000001")
    assert sorted(os.listdir(tmp_path / "volume")) == [
        "..2026_12_01_10_00_00.000000001", "..data", "broker",
    ]  # fmt: skip
    mounted, plain = load_policy_dir(tmp_path / "volume"), load_policy_dir(source)
    assert dict(mounted.files) == dict(plain.files)
    assert mounted.digest == plain.digest


async def allowed(
    session: aiohttp.ClientSession, url: str, tls: ssl.SSLContext, issuer: DevIssuer
) -> bool:
    body = await release_body(session, url, tls, issuer)
    async with session.post(url + "/v1/release", json=body, ssl=tls) as response:
        payload = await response.json()
        if response.status == 200:
            return True
        assert payload["error"]["code"] == "policy_denied", payload
        return False


async def test_broker_serve_on_a_configmap_volume_follows_the_atomic_swap(tmp_path: Path) -> None:
    issuer = dev_issuer()
    config = await asyncio.to_thread(write_config, tmp_path / "b", issuer)
    await asyncio.to_thread(create_key_with_cli, config)
    policies = tmp_path / "b" / "policies"
    volume = tmp_path / "configmap"
    await asyncio.to_thread(kubelet_volume, volume, policies, "2026_12_01_10_00_00.000000001")
    tls = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "serve", "--config", str(config)],
        cwd=ROOT,
        env={
            **os.environ,
            "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
            "BROKER_POLICY_DIR": str(volume),
            "BROKER_POLICY_RELOAD_SECONDS": "1",
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_ready, port, tls)
        async with aiohttp.ClientSession() as session:
            assert await allowed(session, url, tls, issuer)
            # The security team withdraws the image: a new ConfigMap version, swapped in.
            data = json.loads((policies / "broker" / "data.json").read_text())
            data["images"][KEY] = []
            (policies / "broker" / "data.json").write_text(json.dumps(data))
            await asyncio.to_thread(
                kubelet_volume, volume, policies, "2026_12_01_10_05_00.000000002"
            )
            for _ in range(100):
                if not await allowed(session, url, tls, issuer):
                    break
                await asyncio.sleep(0.2)
            else:
                pytest.fail("the swapped ConfigMap never went live")
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "b" / "decisions.log").read_text().splitlines()
    ]
    changes = [r for r in records if r["type"] == "policy_change"]
    assert [c["trigger"] for c in changes] == ["startup", "poll"], changes
    assert changes[1]["old_digest"] == changes[0]["new_digest"]
    releases = [r for r in records if r["type"] == "release"]
    assert releases[0]["policy_digest"] == changes[0]["new_digest"]
    assert releases[-1]["policy_digest"] == changes[1]["new_digest"]
    assert not [r for r in records if r["type"] == "policy_reload_failed"]
