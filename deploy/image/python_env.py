"""The image's Python environment: a venv at ``/opt/broker`` on Debian's python3.11.

1. The broker's wheel is built from a copy of the source (the files git lists, modes and times
   normalised) by the pinned setuptools of ``tools.lock``, with ``SOURCE_DATE_EPOCH`` set.
2. The dependencies are exactly the wheels of ``python.lock``: pip downloads them with
   ``--require-hashes --only-binary :all: --no-deps`` for the image's platform (CPython 3.11,
   manylinux x86_64), so nothing is resolved and nothing is built at image time.
3. ``installer`` writes each wheel into the venv without running any of its code: console
   scripts name ``/opt/broker/bin/python``, no INSTALLER, REQUESTED or direct_url.json is
   written, and no bytecode (it is compiled later by the image's own interpreter).
"""
# ruff: noqa: S603, S607 - build tooling: runs fixed host tools (git, go, apt-get, dpkg-deb, chroot,
# pip) with arguments it builds itself.

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from installer import install
from installer.destinations import SchemeDictionaryDestination
from installer.sources import WheelFile

PREFIX = "/opt/broker"
PYTHON = "python3.11"
SITE_PACKAGES = f"{PREFIX}/lib/{PYTHON}/site-packages"
_LOCKED = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)\s+--hash=sha256:([0-9a-f]{64})\s*$")


@dataclass(frozen=True)
class LockedWheel:
    name: str
    version: str
    sha256: str


def platform_options() -> list[str]:
    """pip options selecting wheels for the image: CPython 3.11 on glibc 2.36, x86_64."""
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    options = ["--only-binary", ":all:", "--implementation", "cp", "--abi", "cp311"]
    options += ["--python-version", "3.11"]
    return options + [option for platform in platforms for option in ("--platform", platform)]


def read_lock(path: Path) -> list[LockedWheel]:
    locked = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            match = _LOCKED.match(line)
            if not match:
                raise ValueError(f"{path}: not `name==version --hash=sha256:…`: {line}")
            locked.append(LockedWheel(*match.groups()))
    return locked


def pip_environ() -> dict[str, str]:
    """The caller's environment without pip settings that would add places to look."""
    return {key: value for key, value in os.environ.items() if key != "PIP_FIND_LINKS"}


def source_tree(repo: Path, dest: Path, epoch: int) -> None:
    """Copy the files git lists (tracked, or new and not ignored) into ``dest``, normalised.

    Modes become 0o644 or 0o755 (executables), directories 0o755, times ``epoch``: a checkout's
    umask and clock then make no difference to the wheel.
    """
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in sorted(set(filter(None, listed.split("\0")))):
        source = repo / rel
        if rel.startswith("build/") or not (source.exists() or source.is_symlink()):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
            continue
        shutil.copyfile(source, target)
        os.chmod(target, 0o755 if os.access(source, os.X_OK) else 0o644)
    for path in sorted(dest.rglob("*"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, 0o755)  # noqa: S103 - a directory of the source
        os.utime(path, (epoch, epoch), follow_symlinks=False)


def build_wheel(src: Path, out: Path, epoch: int) -> Path:
    """The broker's wheel, built in ``src`` by setuptools' PEP 517 backend (this interpreter's)."""
    out.mkdir(parents=True, exist_ok=True)
    hook = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    environ = os.environ | {"SOURCE_DATE_EPOCH": str(epoch), "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", hook, str(out)],
        cwd=src,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the broker's wheel failed:\n{done.stdout}{done.stderr}")
    return out / done.stdout.strip().splitlines()[-1]


def download(lock: Path, dest: Path) -> dict[str, Path]:
    """The locked wheels in ``dest`` (pip reuses files already there); sha256 → file."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {wheel.sha256 for wheel in read_lock(lock)}
    found = {sha256_of(path): path for path in sorted(dest.glob("*.whl"))}
    if wanted - set(found):
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        argv += ["--require-hashes", *platform_options(), "--dest", str(dest), "-r", str(lock)]
        done = subprocess.run(argv, env=pip_environ(), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"pip download failed:\n{done.stdout}{done.stderr}")
        found = {sha256_of(path): path for path in sorted(dest.glob("*.whl"))}
    missing = wanted - set(found)
    if missing:
        raise RuntimeError(f"locked wheels missing after download: {sorted(missing)}")
    return {digest: found[digest] for digest in sorted(wanted)}


def sha256_of(path: Path) -> str:
    with path.open("rb") as content:
        return hashlib.file_digest(content, "sha256").hexdigest()


def install_wheels(wheels: Sequence[Path], root: Path) -> None:
    """Install each wheel under ``root`` + PREFIX, in name order, running none of its code."""
    scheme = {
        "purelib": SITE_PACKAGES,
        "platlib": SITE_PACKAGES,
        "headers": f"{PREFIX}/include/site/{PYTHON}",
        "scripts": f"{PREFIX}/bin",
        "data": PREFIX,
    }
    destination = SchemeDictionaryDestination(
        scheme, interpreter=f"{PREFIX}/bin/python", script_kind="posix", destdir=str(root)
    )
    for wheel in sorted(wheels, key=lambda path: path.name.lower()):
        with WheelFile.open(wheel) as source:
            install(source, destination, additional_metadata={})


def write_venv(root: Path, python_version: str) -> None:
    """What ``python -m venv --without-pip`` makes, pointing at Debian's interpreter."""
    prefix = root / PREFIX.lstrip("/")
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    (prefix / "pyvenv.cfg").write_text(
        f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {python_version}\n"
    )
    (prefix / "bin/python").symlink_to(f"/usr/bin/{PYTHON}")
    (prefix / "bin/python3").symlink_to("python")
    (prefix / f"bin/{PYTHON}").symlink_to("python")
    (prefix / "lib64").symlink_to("lib")
