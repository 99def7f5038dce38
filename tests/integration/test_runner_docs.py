"""Issue 28 item 8: every Python snippet of docs/runner.md is a complete program that runs.
Each block is extracted and run as its own process (``python -c``) against a loopback broker,
with the environment the page documents (``BROKER_URL``, ``BROKER_CA``, ``WEIGHTS``,
``LOG_KEY``, ``TEE_LAUNCHER_SOCKET``, ``STATEMENT_KEY``; ``IMAGE`` for the development
workspace). A snippet missing an import, or using an option the SDK does not have, fails here;
so does a new snippet no test runs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from jwt import PyJWK

from broker.dev.issuer import ISSUER_FILE, DevIssuer
from tests.integration.attested import ADMIN, admin_post
from tests.integration.conftest import RunningBroker
from tests.integration.identity import IDENTITY_TOML, SPIFFE_ID, with_identity
from tests.integration.test_admin_and_query_keys import write_signing_key
from tests.integration.test_attest import ATTEST_TOML, with_result_key
from tests.integration.test_broker_attestation import Sealed, sealed_broker, socket_dir
from tests.integration.test_token_sources import serve_launcher
from tests.support.cli import run
from tests.support.constants import ALLOWED, AUDIENCE, KEY
from tests.support.processes import free_port
from tests.support.weights import sealed_before_a_rotation

ROOT = Path(__file__).resolve().parents[2]
RUNNER_MD = ROOT / "docs" / "runner.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)
QUERY_KEY = "queries/chat"  # the name the snippets use
DEV_IMAGE = "sha256:" + "5e" * 32
# Builds, pip and fresh interpreters on a loaded 2-core CI machine: minutes, not seconds.
pytestmark = pytest.mark.timeout(300)
__all__ = ["sealed_broker", "socket_dir"]  # issue 29's sealed broker fixtures, used by name


def snippets() -> dict[str, str]:
    """Each python block of docs/runner.md under the heading it follows."""
    text = RUNNER_MD.read_text(encoding="utf-8")
    found: dict[str, str] = {}
    for match in BLOCK.finditer(text):
        headings = HEADING.findall(text, 0, match.start())
        title = headings[-1] if headings else "top"
        assert title not in found, f"two snippets under {title!r}: name them apart"
        found[title] = match.group(1)
    return found


EXPECTED = {  # snippet -> what its output must say
    "Runner SDK": f"{KEY}#1: 32 bytes",
    "Options: `expected_key`, `source_options`, `key_of_file`, errors": f"released {KEY}#1",
    "Attest once, release many": f"{KEY}#1; 2 files",
    "Developing without a TEE": "released models/dev#1",
    "Encrypted weights": "read from the middle",
    "Queries and answers": "answer to question",
    "Verifying the broker": f"broker image {ALLOWED} attested until",
    "Runners talking to runners: workload certificates and mTLS": f"{SPIFFE_ID} got activations",
}


def test_every_snippet_is_run_and_names_every_import() -> None:
    found = snippets()
    assert set(found) == set(EXPECTED)  # a new snippet needs its run here
    for title, code in found.items():
        lint = subprocess.run(
            [str(Path(sys.executable).parent / "ruff"), "check", "--isolated", "--select",
             "F,E9", "--stdin-filename", "snippet.py", "-"],
            input=code, capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        assert lint.returncode == 0, f"{title}: {lint.stdout}"  # F821: a name never imported


async def run_snippet(title: str, environ: dict[str, str], cwd: Path) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", snippets()[title], env={**os.environ, **environ}, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode == 0, f"{title}:\n{err.decode()}"
    assert EXPECTED[title] in out.decode(), out.decode()
    return out.decode()


def with_query_key_allowed(workdir: Path) -> None:
    write_signing_key(workdir)
    data_file = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text())
    data["images"][QUERY_KEY] = [ALLOWED]
    data_file.write_text(json.dumps(data))


async def public_get(broker: RunningBroker, path: str) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + path, ssl=broker.client_tls) as response,
    ):
        assert response.status == 200, path
        return await response.json()


async def test_the_runner_snippets_run_against_a_loopback_broker(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    def setup(workdir: Path) -> None:
        with_result_key(workdir)
        with_query_key_allowed(workdir)
        with_identity(workdir)

    broker: RunningBroker = await start_broker(
        extra_toml=ATTEST_TOML + IDENTITY_TOML,
        workdir_setup=setup,
        environ={
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(ADMIN.encode()).hexdigest(),
            "BROKER_KEYS_SIGNING_KEY": str(tmp_path / "broker0" / "statement.key"),
        },
    )
    status, _ = await admin_post(broker, "/v1/admin/keys", {"name": QUERY_KEY, "purpose": "query"})
    assert status == 201
    sealed, plain = await sealed_before_a_rotation(broker.workdir, "model.safetensors", 300_000)
    statement = PyJWK((await public_get(broker, "/v1/statement-keys"))["keys"][0]).key
    pem = statement.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    await asyncio.to_thread((tmp_path / "statement.pem").write_bytes, pem)
    out = tmp_path / "model.safetensors"
    async with serve_launcher(broker.issuer, str(tmp_path / "teeserver.sock")) as (_, socket):
        environ = {
            "BROKER_URL": broker.url,
            "BROKER_CA": str(broker.workdir / "tls" / "ca.pem"),
            "WEIGHTS": str(sealed),
            "WEIGHTS_OUT": str(out),
            "LOG_KEY": (await public_get(broker, "/v1/log/key"))["verifier_key"],
            "TEE_LAUNCHER_SOCKET": socket,
            "STATEMENT_KEY": str(tmp_path / "statement.pem"),
        }
        for title in set(EXPECTED) - {"Developing without a TEE", "Verifying the broker"}:
            await run_snippet(title, environ, tmp_path)
    assert await asyncio.to_thread(out.read_bytes) == plain
    kinds = [r["type"] for r in broker.records()]
    assert "attested_release" in kinds
    assert "release" in kinds
    assert kinds.count("identity") == 2


async def test_the_development_snippet_runs_on_a_dev_init_workspace(
    start_broker: Callable[..., Any], tmp_path: Path
) -> None:
    """As docs/runner.md says: ``broker dev init ./dev``, serve it, run the snippet from the
    directory holding ``dev``."""
    here = tmp_path / "project"
    here.mkdir()
    made = await asyncio.to_thread(
        run, "dev", "init", str(here / "dev"), "--image", DEV_IMAGE, "--port", str(free_port())
    )
    assert made.returncode == 0, made.stderr
    issuer = await asyncio.to_thread(DevIssuer.load, here / "dev" / ISSUER_FILE)
    broker: RunningBroker = await start_broker(reuse=(here / "dev" / "broker.toml", issuer))
    await run_snippet(
        "Developing without a TEE", {"BROKER_URL": broker.url, "IMAGE": DEV_IMAGE}, here
    )


def test_the_verifying_snippet_checks_a_sealed_broker(
    sealed_broker: Sealed, tmp_path: Path
) -> None:
    """Issue 29: a broker attested through the development launcher (its issuer's JWKS)."""
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(sealed_broker.issuer.jwks()))
    environ = {
        "BROKER_URL": sealed_broker.url,
        "BROKER_CA": str(sealed_broker.workdir / "tls" / "ca.pem"),
        "BROKER_IMAGE": ALLOWED,
        "ATTESTATION_JWKS": str(jwks),
        "BROKER_AUDIENCE": AUDIENCE,
        "ATTESTATION_ISSUER": sealed_broker.issuer.issuer,
    }
    asyncio.run(run_snippet("Verifying the broker", environ, tmp_path))
