"""The ``broker`` command as a user runs it: real files, real ports. Most commands run in process
(``tests/support/cli.py``: the same ``cli.main``); the executable itself, ``serve`` and the demo
run as real subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.client import BrokerClient, ReleasedDek
from broker.client.unwrap import new_ephemeral_key
from broker.crypto.jwk import public_jwk, thumbprint
from broker.demo import ALLOWED_DIGEST, DEMO_KEY
from broker.dev.issuer import DevTokenSource
from broker.keys.admin import cli_actor
from tests.integration.conftest import write_config, write_statement_key
from tests.support.cli import run
from tests.support.health import HEALTH_ENV, readyz_blocking
from tests.support.issuers import dev_issuer
from tests.support.key_changes import outcomes
from tests.support.processes import wait_ready
from tests.unit.test_audit_log import write_log

ROOT = Path(__file__).parents[2]
BROKER = [sys.executable, "-m", "broker.cli"]


@pytest.fixture(autouse=True)
def blockbuster() -> None:
    """These tests are synchronous: they drive subprocesses, not the event loop."""


def run_process(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``broker ARGS`` as its own process (the executable, its imports, its exit)."""
    return subprocess.run(
        [*BROKER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def configured(tmp_path: Path) -> Path:
    return write_config(tmp_path / "b", dev_issuer())


def test_keys_create_and_list(tmp_path: Path) -> None:
    config = configured(tmp_path)
    created = run_process(
        "keys", "create", "models/a", "--purpose", "model-weights", "--config", str(config)
    )
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["version"] == 1
    again = run("keys", "create", "models/a", "--purpose", "model-weights", "--config", str(config))
    assert again.returncode == 1
    assert "key_exists" in again.stderr
    listed = run("keys", "list", "--config", str(config))
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["state"]) for r in rows] == [("models/a", "enabled")]
    assert "wrapped" not in listed.stdout


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = configured(tmp_path)
    config.write_text(
        config.read_text().replace(
            'listen = "127.0.0.1:0"', 'listen = "0.0.0.0:1"\ninsecure_http = true'
        )
    )
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "server.insecure_http" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_runs_tls_until_sigterm(tmp_path: Path) -> None:
    config = configured(tmp_path)
    port = free_port()
    assert (
        run(
            "keys", "create", "models/a", "--purpose", "generic", "--config", str(config)
        ).returncode
        == 0
    )
    process = subprocess.Popen(
        [*BROKER, "serve", "--config", str(config)],
        cwd=ROOT,
        env={
            **os.environ,
            "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
            "BROKER_SERVER_READYZ_RATE_PER_IP": "0",  # polled below
            **HEALTH_ENV,  # /readyz details for an admin token
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    context = ssl.create_default_context(cafile=str(tmp_path / "b" / "tls" / "ca.pem"))
    url = f"https://127.0.0.1:{port}"
    try:
        wait_ready(port, context)  # up to 30 s: three test workers share two cores
        _, body = readyz_blocking(url, context)
        assert body["status"] == "ready"
        with pytest.raises(OSError, match=r"Connection reset|Remote end closed|EOF"):  # TLS only
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
        # SIGHUP reloads the policy: a changed data file goes live, with a change record.
        data = tmp_path / "b" / "policies" / "broker" / "data.json"
        data.write_text(data.read_text().replace('"images"', '"images_renamed"'))
        process.send_signal(signal.SIGHUP)
        for _ in range(300):
            checks = readyz_blocking(url, context)[1]["checks"]
            if checks["policy"] != body["checks"]["policy"] and "policy_last_reload" in checks:
                break
            time.sleep(0.1)
        assert checks["policy_last_reload"].startswith("ok at")
        assert "(sighup)" in checks["policy_last_reload"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=15)
    assert process.returncode == 0


def test_audit_verify_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    asyncio.run(write_log(path, 3))
    ok = run("audit", "verify", str(path))
    assert ok.returncode == 0
    assert json.loads(ok.stdout)["records"] == 3
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[2])
    bad = run("audit", "verify", str(path))
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["first_bad_index"] == 1  # the second record (0-based)
    assert run("audit", "verify", str(tmp_path / "missing.log")).returncode == 2


def test_policy_test_passes_on_shipped_policy_and_fails_on_a_broken_one(tmp_path: Path) -> None:
    assert run("policy", "test", "policies").returncode == 0
    broken = tmp_path / "p"
    broken.mkdir()
    (broken / "x.rego").write_text("package x\nimport rego.v1\nallow if input.ok\n")
    (broken / "x_test.rego").write_text(
        "package x_test\nimport rego.v1\ntest_allows if data.x.allow with input as {}\n"
    )
    result = run("policy", "test", str(broken))
    assert result.returncode == 1
    assert "FAIL" in result.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One run of ``broker demo --workdir DIR`` (slow) for the tests below: (DIR, its output)."""
    workdir = tmp_path_factory.mktemp("demo") / "demo"
    result = run_process("demo", "--workdir", str(workdir), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir, result.stdout


def test_demo_runs_end_to_end(demo: tuple[Path, str]) -> None:
    _, stdout = demo
    assert "denied 403 policy_denied" in stdout
    assert (
        "decision log verified: 24 records (create, create ok, create, create ok, "
        "weights-encrypt, policy_change, identity_ca, "
        "allow, deny, attestation allow, attested_release allow, attestation allow, "
        "identity allow, attestation allow, identity allow, kbs_auth allow, kbs_attest allow, "
        "kbs_resource allow, policy_change, "
        "attestation_revoked, attestation_revoked, attestation_revoked, deny, "
        "attested_release deny)" in stdout
    )
    # issue 32: two attested runners over mTLS on their SVIDs; an unattested one refused
    assert "[mtls] two runners attested and got certificates for spiffe://" in stdout
    assert "over mTLS, each checked the other's SPIFFE ID: spiffe://" in stdout
    assert "got 'layer 5 activations'" in stdout
    assert "a third, unattested client is refused at the handshake" in stdout
    # issue 33: a Confidential Containers guest fetches the demo key over the KBS protocol
    assert "[kbs] a CoCo guest (sample evidence: DEVELOPMENT switch) ran /kbs/v0/auth" in stdout
    assert "decrypts to models/demo-llama v1" in stdout
    assert "the formerly allowed image is now denied" in stdout
    # attest once: the weights key and a query key on one result, then revoked by the reload
    assert "released models/demo-llama v1 (AES-256) on it with a DPoP proof" in stdout
    assert "released queries/demo-chat v1" in stdout
    assert "is refused: 401 attestation_revoked" in stdout
    assert "no longer allows it: image sha256:" in stdout
    assert "`broker weights encrypt model/ bucket/` sealed model.safetensors" in stdout
    assert "read tensor layer.5.weight (65536 floats)" in stdout
    assert "SHA-256 matches the manifest" in stdout


def test_the_demo_workspace_mints_dev_tokens_and_releases_when_served(
    demo: tuple[Path, str],
) -> None:
    """After the demo, DIR is a ``broker dev`` workspace: ``broker dev token DIR`` and
    ``DevTokenSource.from_workspace(DIR)`` mint from its issuer, and ``broker serve --config
    DIR/broker.toml`` releases the demo key on them (the demo used to keep its issuer in memory
    only, and left the image withdrawn)."""
    workdir, stdout = demo
    assert f"broker dev token {workdir} --image {ALLOWED_DIGEST}" in stdout
    port = free_port()
    process = subprocess.Popen(
        [*BROKER, "serve", "--config", str(workdir / "broker.toml")],
        cwd=ROOT,
        env={**os.environ, "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tls = ssl.create_default_context(cafile=str(workdir / "tls" / "ca.pem"))
    printed = re.search(r"\[console\] log in with the auditor token (\S+)\n", stdout)
    assert printed is not None, stdout
    assert "[console] served as above: https://127.0.0.1:8443/console/" in stdout
    try:
        wait_ready(port, tls)
        released, curl_status = asyncio.run(_release_from_workspace(workdir, port, tls))
        console = asyncio.run(_console_opens(f"https://127.0.0.1:{port}", tls, printed.group(1)))
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert (released.key, released.version, len(released.dek)) == (DEMO_KEY, 1, 32), stderr
    assert curl_status == 200, stderr
    assert console == (303, 200), stderr


async def _console_opens(url: str, tls: ssl.SSLContext, token: str) -> tuple[int, int]:
    """The demo's printed auditor token logs in to the served workspace's console: the log-in's
    status, then the log health page's."""
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{url}/console/login",
            data={"token": token},
            headers={"Origin": url},
            ssl=tls,
            allow_redirects=False,
        ) as response:
            login = response.status
            cookie = response.cookies["__Host-console-session"].value
        async with session.get(
            f"{url}/console/",
            headers={"Cookie": f"__Host-console-session={cookie}"},
            ssl=tls,
            allow_redirects=False,
        ) as response:
            return login, response.status


async def _release_from_workspace(
    workdir: Path, port: int, tls: ssl.SSLContext
) -> tuple[ReleasedDek, int]:
    """The SDK with ``DevTokenSource.from_workspace``, then a token from ``broker dev token``
    in a hand-made request (what a curl user does)."""
    url = f"https://127.0.0.1:{port}"
    source = DevTokenSource.from_workspace(workdir, image=ALLOWED_DIGEST)
    async with BrokerClient(url, ssl_context=tls) as client:
        released = await client.release(DEMO_KEY, source)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/challenge", json={}, ssl=tls) as response:
            nonce = (await response.json())["nonce"]
        jwk = public_jwk(new_ephemeral_key().public_key())
        minted = await asyncio.to_thread(
            run_process, "dev", "token", str(workdir), "--image", ALLOWED_DIGEST,
            f"--nonce={nonce}", f"--nonce={thumbprint(jwk)}",  # either may start with "-"
        )  # fmt: skip
        assert minted.returncode == 0, minted.stderr
        body = {"key": DEMO_KEY, "nonce": nonce, "evidence": {"gca": minted.stdout.strip()},
                "runner_key": jwk}  # fmt: skip
        async with session.post(f"{url}/v1/release", json=body, ssl=tls) as response:
            return released, response.status


REAL = ROOT / "tests" / "fixtures" / "real"


def verify(*args: str) -> tuple[int, dict[str, Any]]:
    result = run("verify", *args)
    return result.returncode, json.loads(result.stdout)


def test_verify_real_oidc_token_with_all_checks(tmp_path: Path) -> None:
    samples = json.loads((REAL / "gca" / "cs_oidc_samples_2025-12-02.json").read_text())
    token = tmp_path / "t.jwt"
    token.write_text(samples["samples"][1]["raw_token"])
    code, out = verify(
        "gca",
        str(token),
        "--jwks",
        str(REAL / "gca" / "google_cs_jwks_2025-12-02.json"),
        "--at",
        "2025-12-02T20:50:40Z",
        "--audience",
        "https://synddb-sequencer.example.com",
        "--nonce",
        "sp1-test-nonce-1764708636",
    )
    assert code == 0
    assert out["skipped"] == ["runner key binding"]  # --nonce alone: membership only
    assert out["tee"]["technology"] == "sev"
    code, out = verify(
        "gca", str(token), "--jwks", str(REAL / "gca" / "google_cs_jwks_2025-12-02.json")
    )
    assert code == 1
    assert out["error"]["code"] == "token_expired"


def test_verify_real_pki_token_lists_skipped_checks() -> None:
    code, out = verify(
        "gca", str(REAL / "gca" / "cs_pki_token_tdx_2025-04.jwt"), "--at", "2025-04-23T16:27:20Z"
    )
    assert code == 0
    assert out["token_type"] == "pki"
    assert out["skipped"] == ["audience", "nonce"]


def test_verify_real_ita_token() -> None:
    code, out = verify(
        "ita",
        str(REAL / "ita" / "ita_tdx_token_2023-12.jwt"),
        "--jwks",
        str(REAL / "ita" / "ita_certs_jwks_2023-09.json"),
        "--issuer",
        "Intel Trust Authority",
        "--at",
        "2023-12-05T00:10:00Z",
    )
    assert code == 0
    assert out["tee"]["tcb_status"] == "OutOfDate"


def test_verify_real_nras_result_with_nonce() -> None:
    evidence = json.loads((REAL / "nvidia" / "nras_gpu_evidence_2026-09-16.json").read_text())
    args = [
        "nras",
        str(REAL / "nvidia" / "nras_response_2026-09-16.json"),
        "--jwks",
        str(REAL / "nvidia" / "nras_jwks_subset_2026-09-16.json"),
        "--at",
        "2026-09-16T20:51:00Z",
    ]
    code, out = verify(*args, "--nonce", evidence["nonce"])
    assert code == 0
    assert out["gpus"][0]["driver_version"] == "595.71.05"
    code, out = verify(*args, "--nonce", "00" * 32)
    assert (code, out["error"]["code"]) == (1, "nonce_mismatch")


def _rim_arg(text: str) -> str:
    rim_id, equals, name = text.partition("=")
    return f"{rim_id}={REAL / 'nvidia' / name}" if equals else str(REAL / "nvidia" / text)


@pytest.mark.parametrize(
    ("rims", "at", "expected"),
    [
        (
            [
                "NV_GPU_DRIVER_GH100_550.90.07.swidtag",
                "NV_GPU_VBIOS_1010_0200_882_96009F0001.swidtag",
            ],
            "2026-03-01T00:00:00Z",
            "match",
        ),
        (
            [  # NVIDIA's test RIMs offered for the ids this report names: versions differ
                "NV_GPU_DRIVER_GH100_550.90.07=Driver_RIM_test_no_gpu.swidtag",
                "NV_GPU_VBIOS_1010_0200_882_96009F0001=1010_0200_882_96005E0001_test_no_gpu.swidtag",
            ],
            "2025-01-01T00:00:00Z",
            "mismatch",
        ),
    ],
)
def test_verify_real_hopper_report_against_rims(rims: list[str], at: str, expected: str) -> None:
    code, out = verify(
        "nvidia",
        str(REAL / "nvidia" / "hopperAttestationReport.txt"),
        "--chain",
        str(REAL / "nvidia" / "hopperCertChain.txt"),
        "--at",
        at,
        *(arg for r in rims for arg in ("--rim", _rim_arg(r))),  # repeated flags
    )
    assert code == 0
    (gpu,) = out["gpus"]
    assert gpu["measurements"] == expected
    assert (gpu["driver_version"], gpu["vbios_version"]) == ("550.90.07", "96.00.9F.00.01")


def test_key_lifecycle_commands_log_every_change(tmp_path: Path) -> None:
    config = configured(tmp_path)
    signing = {"BROKER_KEYS_SIGNING_KEY": str(write_statement_key(tmp_path / "statement.pem"))}
    material = tmp_path / "dek.bin"
    material.write_bytes(bytes(range(32)))
    steps = [
        (
            "keys",
            "import",
            "models/byok",
            "--purpose",
            "model-weights",
            "--material-file",
            str(material),
        ),
        ("keys", "rotate", "models/byok"),
        ("keys", "disable", "models/byok", "--version", "1"),
        ("keys", "enable", "models/byok", "--version", "1"),
        ("keys", "destroy", "models/byok", "--version", "1", "--yes"),
        ("keys", "create", "models/q", "--purpose", "query", "--algorithm", "HPKE-X25519"),
    ]
    for step in steps:
        result = run(*step, "--config", str(config), env=signing)
        assert result.returncode == 0, (step, result.stderr)
    refused = run("keys", "destroy", "models/byok", "--version", "2", "--config", str(config))
    assert refused.returncode == 2  # destroy needs --yes
    shown = json.loads(run("keys", "show", "models/byok", "--config", str(config)).stdout)
    assert [(v["version"], v["state"]) for v in shown] == [(1, "destroyed"), (2, "enabled")]
    listed = json.loads(run("keys", "list", "--config", str(config)).stdout)
    assert {v["algorithm"] for v in listed} == {"AES-256", "HPKE-X25519"}
    log = tmp_path / "b" / "decisions.log"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert outcomes(records) == [  # each change: its intent, then its outcome naming it
        ("create", 1, "ok", None), ("rotate", 2, "ok", None), ("disable", 1, "ok", None),
        ("enable", 1, "ok", None), ("destroy", 1, "ok", None), ("create", 1, "ok", None),
    ]  # fmt: skip
    assert len(records) == 12
    assert {r["who"] for r in records} == {cli_actor()}  # user@host of whoever ran them
    assert run("audit", "verify", str(log)).returncode == 0


def _simulated_gpu_files(tmp_path: Path, arch: str, gpu_nonce: bytes) -> dict[str, Path]:
    """Simulated NVIDIA evidence and trust files in NVIDIA's formats, for ``broker verify``."""
    from tests.vectors.gpu import RimAuthority, SimulatedGpu, pem  # noqa: PLC0415

    now = datetime.now(UTC)
    gpu, authority = SimulatedGpu(now, arch=arch), RimAuthority(now)
    files = {
        "evidence": tmp_path / "evidence.json",
        "root": tmp_path / "device_root.pem",
        "rim_root": tmp_path / "rim_root.pem",
        "rims": tmp_path / "rims",
    }
    files["evidence"].write_text(json.dumps(gpu.evidence(gpu_nonce, declared_arch=None)))
    files["root"].write_bytes(pem([gpu.root]))
    files["rim_root"].write_bytes(pem([authority.root]))
    files["rims"].mkdir()
    driver = {i - 1: v for i, v in gpu.measurements.items() if i <= 4}
    vbios = {i - 1: v for i, v in gpu.measurements.items() if i > 4}
    from broker.attestation.nvidia import local, spdm  # noqa: PLC0415

    report = spdm.parse_report(gpu.report(gpu_nonce))
    driver_id, vbios_id = local.rim_ids_for(arch, report)
    (files["rims"] / f"{driver_id}.swidtag").write_bytes(authority.rim("550.90.07", driver))
    (files["rims"] / f"{vbios_id}.swidtag").write_bytes(authority.rim("96.00.9F.00.01", vbios))
    return files


@pytest.mark.parametrize("arch", ["HOPPER", "BLACKWELL"])
def test_verify_checks_the_gpu_nonce_binding_like_the_service(tmp_path: Path, arch: str) -> None:
    from broker.core.binding import binding_digest  # noqa: PLC0415

    nonce, thumb = (
        "bWFkZS11cC1ub25jZS1mb3ItdGhlLWNsaS10ZXN0",
        "dGh1bWJwcmludC1vZi10aGUtcnVubmVyLWtleQ",
    )
    files = _simulated_gpu_files(tmp_path, arch, binding_digest(nonce, thumb))
    args = [
        "nvidia",
        str(files["evidence"]),
        "--root",
        str(files["root"]),
        "--rim-root",
        str(files["rim_root"]),
        "--rim-dir",
        str(files["rims"]),
        "--nonce",
        nonce,
    ]
    code, out = verify(*args, "--thumbprint", thumb)  # no --arch: inferred (item 12)
    assert code == 0, out
    (gpu,) = out["gpus"]
    assert (gpu["arch"], gpu["measurements"]) == (arch, "match")
    assert "gpu nonce" not in out["skipped"]
    code, out = verify(*args, "--thumbprint", "another-runner-key")
    assert (code, out["error"]["code"]) == (1, "nonce_mismatch")


def test_verify_takes_rims_repeated_or_space_separated(tmp_path: Path) -> None:
    files = _simulated_gpu_files(tmp_path, "HOPPER", bytes(32))
    rims = sorted(str(p) for p in files["rims"].iterdir())
    common = [
        "nvidia",
        str(files["evidence"]),
        "--root",
        str(files["root"]),
        "--rim-root",
        str(files["rim_root"]),
        "--nonce",
        "00" * 32,
    ]
    for form in (["--rim", rims[0], "--rim", rims[1]], ["--rim", *rims]):
        code, out = verify(*common, *form)
        assert code == 0, out
        assert out["gpus"][0]["measurements"] == "match"
