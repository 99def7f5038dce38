"""Issue 28 items 9 and 10: the package as users install it. ``python -m build`` makes an sdist
and a wheel (built once per session); the wheel goes into fresh virtual environments with pip:

* with only the base dependencies it is the runner SDK, and its ``broker`` script says in one
  line which extra is missing (exit 2) instead of a traceback on ``pkcs11``; with ``[gcs]`` it
  reads ``gs://``;
* with the ``[server]`` dependencies it is the broker: ``dev init`` finds the shipped policies
  inside the package, ``weights encrypt … gs://`` uploads (fake-gcs-server on loopback), and
  ``policy eval`` / ``policy replay`` of a bundle run with no OPA anywhere (the bundle's own
  Wasm), deciding as the OPA-built engine does; a directory without OPA is one line naming it
  and both ways out.

pip installs the wheel itself (``--no-deps``, no index); its dependencies are linked from this
test environment (no network, seconds instead of minutes on a 2-core machine).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tarfile
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import RunningBroker
from tests.integration.test_client_install import closure, link_distribution
from tests.support.cli import run
from tests.support.constants import ALLOWED, AUDIENCE, KEY
from tests.support.processes import fake_gcs_server, free_port

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
IMAGE = "sha256:" + "77" * 32
BARE_PATH = "/usr/bin:/bin"  # no .venv/bin: no opa, no fake-gcs-server, no other broker
# Builds, pip and fresh interpreters on a loaded 2-core CI machine: minutes, not seconds.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``python -m build``: the sdist and the wheel, once for all workers of the session."""
    base = tmp_path_factory.getbasetemp()  # under xdist, its parent is this session's
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "wheelhouse"
    shared.mkdir(exist_ok=True)
    with (shared / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not list(shared.glob("*.whl")):
            done = subprocess.run(
                [sys.executable, "-m", "build", "--outdir", str(shared), str(ROOT)],
                capture_output=True, text=True, timeout=600, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = shared.glob("*.tar.gz")
    (wheel,) = shared.glob("*.whl")
    return sdist, wheel


def fresh_venv(where: Path, wheel: Path, extras: tuple[str, ...]) -> Path:
    """A new venv: the wheel installed by pip, its (extras') dependencies linked in."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    python = where / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    site = next(where.glob("lib/python3*/site-packages"))
    wanted = list(PROJECT["dependencies"])
    for extra in extras:
        wanted += PROJECT["optional-dependencies"][extra]
    for name in sorted(closure(wanted)):
        link_distribution(name, site)
    return where


def in_venv(where: Path, *argv: str, cwd: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": BARE_PATH, "HOME": str(cwd), **environ}  # no BROKER_OPA, no PYTHONPATH
    return subprocess.run(
        [str(where / "bin" / argv[0]), *argv[1:]],
        capture_output=True, text=True, timeout=300, check=False, cwd=cwd, env=env,
    )  # fmt: skip


def test_build_makes_an_sdist_and_a_wheel_with_the_shipped_files(built: tuple[Path, Path]) -> None:
    sdist, wheel = built
    shipped = {"broker/shipped/policies/broker/release.rego", "broker/shipped/certs/README.md"}
    assert shipped <= set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert shipped | {"pyproject.toml", "broker/client/sdk.py"} <= names
    entry = zipfile.ZipFile(wheel).read(
        next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("entry_points.txt"))
    )
    assert b"broker = broker.cli.entry:main" in entry


def test_the_sdk_only_wheel_imports_the_sdk_and_its_broker_names_the_missing_extra(
    built: tuple[Path, Path], tmp_path: Path
) -> None:
    where = fresh_venv(tmp_path / "sdk", built[1], ())
    imported = in_venv(
        where, "python", "-I", "-c",
        "import broker.client, broker.client.attested, broker.client.query, sys; "
        "print(broker.client.__file__); "
        "assert not [m for m in sys.modules if m.split('.')[0] in {'wasmtime', 'pkcs11'}]",
        cwd=tmp_path,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith(str(where))  # the installed copy, not the repository
    for argv in (("--help",), ("keys", "list", "--config", "x.toml")):
        told = in_venv(where, "broker", *argv, cwd=tmp_path)
        assert told.returncode == 2
        assert "Traceback" not in told.stderr
        (line,) = told.stderr.splitlines()  # one line
        assert "needs the [server] extra" in line
        assert "pip install 'sealed-runner-broker[server]'" in line


@pytest.fixture
def gcs(tmp_path: Path) -> Iterator[str]:
    seed = tmp_path / "gcs-seed"
    (seed / "weights").mkdir(parents=True)
    with fake_gcs_server(seed) as port:
        yield f"http://127.0.0.1:{port}"


def storage_client(emulator: str) -> Any:
    from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415
    from google.cloud import storage  # type: ignore[attr-defined,import-untyped,unused-ignore]  # noqa: PLC0415

    os.environ["STORAGE_EMULATOR_HOST"] = emulator
    return storage.Client(project="test", credentials=AnonymousCredentials())  # type: ignore[no-untyped-call]


def test_the_server_wheel_inits_a_workspace_and_encrypts_to_gs(
    built: tuple[Path, Path], tmp_path: Path, gcs: str
) -> None:
    where = fresh_venv(tmp_path / "server", built[1], ("server",))
    init = in_venv(
        where, "broker", "dev", "init", "ws", "--image", IMAGE, "--port", str(free_port()),
        cwd=tmp_path,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    key = json.loads(init.stdout)["key"]
    plain = os.urandom(70_000)
    (tmp_path / "m.safetensors").write_bytes(plain)
    made = in_venv(
        where, "broker", "weights", "encrypt", "m.safetensors", "gs://weights/llama/m.brkw",
        "--key", key, "--config", "ws/broker.toml", cwd=tmp_path, STORAGE_EMULATOR_HOST=gcs,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["uploaded"] == ["gs://weights/llama/m.brkw"]
    from broker.client.weights import key_of_file  # noqa: PLC0415

    client = storage_client(gcs)
    try:
        assert key_of_file("gs://weights/llama/m.brkw", {"client": client}) == (key, 1)
    finally:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    # A runner's install (the SDK and [gcs]) reads it back from gs:// as a runner does.
    runner = fresh_venv(tmp_path / "runner", built[1], ("gcs",))
    read = in_venv(
        runner, "python", "-I", "-c",
        "from broker.client.weights import key_of_file; "
        "print(key_of_file('gs://weights/llama/m.brkw', {}))",
        cwd=tmp_path, STORAGE_EMULATOR_HOST=gcs,
    )  # fmt: skip
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip() == repr((key, 1))
    missing = in_venv(
        where, "broker", "weights", "encrypt", "m.safetensors", "gs://weights", "--key", key,
        "--config", "ws/broker.toml", cwd=tmp_path,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "expected gs://BUCKET/OBJECT" in missing.stderr


async def test_policy_eval_and_replay_of_a_bundle_need_no_opa(
    built: tuple[Path, Path], tmp_path: Path, broker: RunningBroker
) -> None:
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())  # one decision to replay
    bundle = tmp_path / "bundle.tar.gz"
    made = run("policy", "build", str(broker.workdir / "policies"), "-o", str(bundle))
    assert made.returncode == 0, made.stderr
    document = {"request": {"key": KEY}, "claims": {"aud": AUDIENCE}, "tee": {"workload": {}}}
    (tmp_path / "input.json").write_text(json.dumps(document))
    log = str(broker.settings.audit.log)
    with_opa = [
        run("policy", "eval", "--policy", str(bundle), "--input", str(tmp_path / "input.json")),
        run("policy", "replay", "--policy", str(bundle), "--log", log),
    ]
    where = fresh_venv(tmp_path / "server", built[1], ("server",))
    without = [
        in_venv(where, "broker", "policy", "eval", "--policy", str(bundle), "--input",
                "input.json", cwd=tmp_path),
        in_venv(where, "broker", "policy", "replay", "--policy", str(bundle), "--log", log,
                cwd=tmp_path),
    ]  # fmt: skip
    for opa, none in zip(with_opa, without, strict=True):
        assert (opa.returncode, none.returncode) == (0, 0), none.stderr
        assert none.stdout == opa.stdout  # the same decisions, the same digest
        assert "no OPA here" in none.stderr
    summary = json.loads(without[1].stdout.splitlines()[-1])["summary"]
    assert summary["decisions"] >= 1
    assert summary["decisions"] == summary["unchanged"]
    refused = in_venv(
        where, "broker", "policy", "eval", "--policy", str(broker.workdir / "policies"),
        "--input", "input.json", cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()
    assert str(broker.workdir / "policies") in line
    assert "broker policy build" in line
    assert "install OPA" in line
    assert "make test" not in line
    assert ALLOWED  # the test broker's policy allows this image; the input above is denied
