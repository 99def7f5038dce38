"""The runner SDK installs without the server: a fresh venv that holds only the distributions
the project's base ``dependencies`` resolve to (no ``[server]`` extra) imports every SDK module and
decrypts a weights file, and no server dependency is imported on the way.

The venv is real (``python -m venv``); its site-packages gets links to exactly the resolved
distributions' files from the test venv (no network), and the repository's ``broker`` package.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = (
    "wasmtime",
    "prometheus_client",
    "asyncpg",
    "redis",
    "grpc",
    "pkcs11",
    "signxml",
    "lxml",
    "opa_client",
    "uvloop",
    "google",
    "tqdm",
)


def closure(requirements: list[str], extras: frozenset[str] = frozenset()) -> set[str]:
    """Names of the installed distributions ``requirements`` resolve to, transitively."""
    seen: set[str] = set()
    todo = [(Requirement(text), extras) for text in requirements]
    while todo:
        requirement, wanted = todo.pop()
        env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
        marker = requirement.marker
        if marker is not None and not any(
            marker.evaluate({**env, "extra": extra}) for extra in (wanted or {""})
        ):
            continue
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        todo += [(Requirement(t), frozenset(requirement.extras)) for t in dist.requires or []]
    return seen


def link_distribution(name: str, site: Path) -> None:
    dist = importlib.metadata.distribution(name)
    tops = set()
    for file in dist.files or []:
        top = file.parts[0]
        # the metadata too: a package may read its own (dcap-qvl: importlib.metadata.version)
        if top.endswith(".pth") or top in {"..", "__pycache__"}:
            continue
        tops.add(top)
    for top in tops:
        source = Path(str(dist.locate_file(top)))
        target = site / top
        if source.exists() and not target.exists():
            target.symlink_to(source)


CHECK = """
import asyncio, importlib, pkgutil, sys
import broker.client
for module in pkgutil.walk_packages(broker.client.__path__, "broker.client."):
    importlib.import_module(module.name)
from broker.client.weights import decrypt_to, open_encrypted
dek = bytes.fromhex(sys.argv[3])
with open_encrypted(sys.argv[1], dek, "models/tiny#1") as reader:
    data = reader.read()
asyncio.run(decrypt_to(sys.argv[1], sys.argv[2], dek, "models/tiny#1"))
assert open(sys.argv[2], "rb").read() == data
from broker.client.weights import SourceError
try:
    open_encrypted("gs://bucket/model.enc", dek)
except SourceError as exc:  # a clear word, not an ImportError from deep inside
    assert "[gcs]" in str(exc), exc
else:
    raise AssertionError("gs:// opened without google-cloud-storage")
server = sorted(m for m in sys.modules if m.split(".")[0] in SERVER_ONLY)
assert not server, server
print(len(data))
"""


def test_the_sdk_runs_in_a_venv_without_the_server_dependencies(tmp_path: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = closure(project["dependencies"])
    assert not {"wasmtime", "prometheus-client", "asyncpg", "redis"} & names
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    site = next(env_dir.glob("lib/python3*/site-packages"))
    for name in sorted(names):
        link_distribution(name, site)
    (site / "broker").symlink_to(ROOT / "broker")
    plain = os.urandom(300_000)
    dek = os.urandom(32)
    sealed = tmp_path / "tiny.enc"
    from broker.crypto.weights import encrypt_stream  # noqa: PLC0415

    with (tmp_path / "tiny.bin").open("wb") as raw:
        raw.write(plain)
    with (tmp_path / "tiny.bin").open("rb") as source, sealed.open("wb") as sink:
        encrypt_stream(dek, "models/tiny#1", source, sink)
    python = env_dir / "bin" / "python"
    code = f"SERVER_ONLY = {SERVER_ONLY!r}\n{CHECK}"
    result = subprocess.run(
        [str(python), "-I", "-c", code, str(sealed), str(tmp_path / "out.bin"), dek.hex()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(len(plain))
    # The venv really is without the server: importing it fails there.
    server = subprocess.run(
        [str(python), "-I", "-c", "import broker.app"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert server.returncode != 0
    assert "ModuleNotFoundError" in server.stderr
    assert sys.prefix != str(env_dir)
