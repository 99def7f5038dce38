"""``broker dev``: a runner developer's workspace — init, serve, release with the SDK's
``DevTokenSource.from_workspace``, tokens for curl — and the development issuer refused off
loopback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jwt
import pytest

from broker.config import load_settings
from broker.core.errors import ConfigError
from broker.dev.issuer import ISSUER_FILE, DevIssuer, DevTokenSource
from tests.integration.conftest import RunningBroker
from tests.support.cli import run
from tests.support.processes import free_port

IMAGE = "sha256:" + "ab" * 32


def init(workspace: Path) -> dict[str, Any]:
    done = run("dev", "init", str(workspace), "--image", IMAGE, "--port", str(free_port()))
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


async def test_a_workspace_serves_and_the_sdk_releases_with_its_issuer(
    tmp_path: Path, start_broker: Any
) -> None:
    workspace = tmp_path / "dev"
    told = await asyncio.to_thread(init, workspace)
    assert told["serve"] == f"broker serve --config {workspace / 'broker.toml'}"
    issuer = await asyncio.to_thread(DevIssuer.load, workspace / ISSUER_FILE)
    broker: RunningBroker = await start_broker(reuse=(workspace / "broker.toml", issuer))
    source = await asyncio.to_thread(DevTokenSource.from_workspace, workspace, image=IMAGE)
    async with broker.client() as client:
        released = await client.release(told["key"], source)
    assert (released.key, released.version, len(released.dek)) == ("models/dev", 1, 32)
    # A token for curl, from the same persistent issuer.
    done = await asyncio.to_thread(
        run, "dev", "token", str(workspace), "--image", IMAGE, "--nonce", "n1", "--nonce", "n2"
    )
    assert done.returncode == 0, done.stderr
    claims = jwt.decode(done.stdout.strip(), options={"verify_signature": False})
    assert (claims["aud"], claims["eat_nonce"]) == (told["audience"], ["n1", "n2"])
    assert claims["submods"]["container"]["image_digest"] == IMAGE
    again = await asyncio.to_thread(run, "dev", "init", str(workspace), "--image", IMAGE)
    assert again.returncode == 2  # an existing workspace is never overwritten
    assert "already holds a workspace" in again.stderr


def test_the_development_issuer_is_refused_off_loopback(tmp_path: Path) -> None:
    workspace = tmp_path / "dev"
    init(workspace)
    config = workspace / "broker.toml"
    text = config.read_text()
    public = text.replace('listen = "127.0.0.1:', 'listen = "0.0.0.0:', 1)
    config.write_text(public)
    with pytest.raises(ConfigError, match=r"issuers\[0\]\.issuer.*loopback"):
        load_settings(config, {})
    refused = run("dev", "token", str(workspace), "--image", IMAGE, "--nonce", "n")
    assert refused.returncode == 2
    assert "loopback" in refused.stderr
