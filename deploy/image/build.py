"""``make image``: the broker's OCI image, reproducibly, without a container daemon.

Steps (each timed on stderr), all inputs pinned by hash or by the commit:

1. Debian: the packages of ``debian.lock`` (apt, SHA-256 checked) unpacked without maintainer
   scripts; merged /usr; dpkg status; the CA bundle; passwd/group with the broker's user 10001.
2. Python: a venv at /opt/broker on Debian's python3.11, with the wheels of ``python.lock`` and
   the broker's own wheel built from the source at ``SOURCE_DATE_EPOCH``.
3. OPA at the Makefile's version, ``go install -trimpath -ldflags=-buildid=`` with CGO off and the
   Go toolchain pinned (``GOTOOLCHAIN``).
4. certs/ and policies/ (/opt/broker), and the files image.json's ``config_files`` names from
   deploy/confidential-space/broker/ (broker.toml, …) in /etc/broker, each when it exists.
5. Bytecode compiled by the image's own interpreter (chroot) with unchecked-hash pycs and a
   fixed hash seed, so no pyc holds a time.
6. Four gzip layers (debian, python, opa, broker), compressed by the image's own Python and
   zlib (pinned by debian.lock, so the host's zlib does not matter), the config from
   ``deploy/confidential-space/broker/image.json`` plus the revision, the OCI layout and an
   SPDX 2.3 SBOM. The manifest digest is printed last, alone on its line.

The source date is the commit's time (``git log -1 --format=%ct``), never the environment's
SOURCE_DATE_EPOCH, so the same commit gives the same digest wherever it is built.
"""
# ruff: noqa: S603, S607 - build tooling: runs fixed host tools (git, go, apt-get, dpkg-deb, chroot,
# pip) with arguments it builds itself.

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.image import debian, oci, python_env, sbom

HERE = Path(__file__).parent
CONFIG_DIR = Path("deploy/confidential-space/broker")
IMAGE_JSON = CONFIG_DIR / "image.json"
OPA_MODULE = "github.com/open-policy-agent/opa"
SITE = python_env.SITE_PACKAGES.lstrip("/")
# Image order; a path goes to the layer whose longest pattern matches it (the rest: debian).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("debian", ()),
    ("python", ("opt/broker",)),
    ("opa", ("usr/local/bin/opa",)),
    (
        "broker",
        (
            f"{SITE}/broker",
            f"{SITE}/sealed_runner_broker-*.dist-info",
            "opt/broker/bin/broker",
            "opt/broker/certs",
            "opt/broker/policies",
            "etc/broker",
            "var/lib/broker",
        ),
    ),
)
OWNERS = {"tmp": (0, 0, 0o1777), "var/lib/broker": (10001, 10001, 0o700), "root": (0, 0, 0o700)}
USERS = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    "broker:x:10001:10001:broker:/var/lib/broker:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nnogroup:x:65534:\nbroker:x:10001:\n"
NSSWITCH = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nservices: files\n"
# What the server imports that loads native code or needs the system's files (CA bundle).
SMOKE_PYTHON = """
import ssl, broker.cli.main, broker.app, uvloop, grpc, lxml.etree, wasmtime, pkcs11, asyncpg, redis
import google.cloud.kms, google.cloud.secretmanager, google.cloud.storage, google_crc32c, signxml
import prometheus_client, opa_client, tqdm, cryptography.hazmat.bindings._rust, sqlite3
wasmtime.Engine()
assert ssl.create_default_context().cert_store_stats()["x509_ca"] > 100, "no CA bundle"
print("ok")
"""
# Test and demo files of the stdlib that are not Python 3 source (py2 grammar samples).
NOT_COMPILED = r"/(lib2to3/tests|test/)"


@contextmanager
def step(name: str) -> Iterator[None]:
    started = time.monotonic()
    print(f"[image] {name} …", file=sys.stderr, flush=True)
    yield
    print(f"[image] {name}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def git(repo: Path, *argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *argv], capture_output=True, text=True, check=True
    ).stdout.strip()


def commit_of(repo: Path) -> tuple[str, int]:
    """(revision, source date). A tree that differs from its commit is marked ``+dirty``."""
    revision = git(repo, "rev-parse", "HEAD")
    epoch = int(git(repo, "log", "-1", "--format=%ct"))
    if git(repo, "status", "--porcelain", "--untracked-files=normal", "--", ".", ":!build"):
        print(f"[image] the tree differs from {revision}: not that commit's image", file=sys.stderr)
        revision += "+dirty"
    return revision, epoch


def stage_debian(root: Path, cache: Path, sources: Path | None) -> list[debian.LockedDeb]:
    locked = debian.read_lock(HERE / "debian.lock")
    debs = debian.Apt(cache, sources).fetch(locked, cache / "debs")
    debian.merged_usr(root)
    debian.write_status(root, [debian.unpack(deb, root) for deb in debs])
    debian.ca_bundle(root)
    for rel, content in (
        ("etc/passwd", USERS),
        ("etc/group", GROUP),
        ("etc/nsswitch.conf", NSSWITCH),
    ):
        if (root / rel).exists():
            raise RuntimeError(f"/{rel} is shipped by a package; this build writes it")
        (root / rel).write_text(content)
    return locked


def stage_python(root: Path, repo: Path, work: Path, epoch: int, python_version: str) -> Path:
    """Install the locked wheels and the broker's wheel; return the broker's wheel."""
    python_env.source_tree(repo, work / "src", epoch)
    wheel = python_env.build_wheel(work / "src", work / "dist", epoch)
    wheels = python_env.download(HERE / "python.lock", work.parent / "wheels")
    python_env.write_venv(root, python_version)
    python_env.install_wheels([*wheels.values(), wheel], root)
    return wheel


def build_opa(version: str, toolchain: str, cache: Path) -> tuple[Path, str]:
    """A static, reproducible OPA; returns (binary, ``go version -m`` of it)."""
    gobin = cache / f"opa-{version}-{toolchain}"
    environ = os.environ | {
        "CGO_ENABLED": "0", "GOOS": "linux", "GOARCH": "amd64", "GOAMD64": "v1",
        "GOFLAGS": "-mod=mod", "GOEXPERIMENT": "", "GOTOOLCHAIN": toolchain, "GOBIN": str(gobin),
    }  # fmt: skip
    argv = ["go", "install", "-trimpath", "-ldflags=-buildid=", f"{OPA_MODULE}@{version}"]
    subprocess.run(argv, env=environ, check=True)
    binary = gobin / "opa"
    info = subprocess.run(
        ["go", "version", "-m", str(binary)],
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "-trimpath=true" not in info or "CGO_ENABLED=0" not in info:
        raise RuntimeError(f"OPA was not built as asked:\n{info}")
    return binary, info


def stage_broker_files(root: Path, repo: Path, opa: Path, config_files: list[str]) -> None:
    (root / "usr/local/bin").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(opa, root / "usr/local/bin/opa")
    os.chmod(root / "usr/local/bin/opa", 0o755)  # noqa: S103 - a program
    for name in ("certs", "policies"):
        shutil.copytree(repo / name, root / "opt/broker" / name)
    (root / "etc/broker").mkdir(parents=True, exist_ok=True)
    for name in config_files:
        if (repo / CONFIG_DIR / name).is_file():
            shutil.copyfile(repo / CONFIG_DIR / name, root / "etc/broker" / name)
        else:
            print(f"[image] {CONFIG_DIR / name} does not exist: not in the image", file=sys.stderr)
    (root / "var/lib/broker").mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)


def in_image(
    root: Path, *argv: str, as_broker: bool = False, **environ: str
) -> subprocess.CompletedProcess[str]:
    """Run a program of the image in it (chroot; in a user namespace when not root)."""
    command = in_image_argv(root, *argv, as_broker=as_broker)
    base = {"PATH": "/opt/broker/bin:/usr/local/bin:/usr/bin", "LC_ALL": "C.UTF-8"}
    return subprocess.run(command, env=base | environ, capture_output=True, text=True, check=False)


def in_image_argv(root: Path, *argv: str, as_broker: bool = False) -> list[str]:
    user = ["--userspec=10001:10001"] if as_broker and os.geteuid() == 0 else []
    command = [_host_tool("chroot"), *user, str(root), *argv]
    if os.geteuid() != 0:
        command = [_host_tool("unshare"), "--map-root-user", *command]
    return command


def _host_tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if not found:
        raise RuntimeError(f"{name} is not installed (util-linux / coreutils)")
    return found


def compile_bytecode(root: Path) -> None:
    python = f"/usr/bin/{python_env.PYTHON}"
    done = in_image(
        root, python, "-m", "compileall", "-q", "-f", "--invalidation-mode", "unchecked-hash",
        "-x", NOT_COMPILED, f"/usr/lib/{python_env.PYTHON}", python_env.SITE_PACKAGES,
        PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1",
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"compileall failed:\n{done.stdout}{done.stderr}")


def smoke(root: Path) -> None:
    """``broker --help``, every native library the server loads, the CA bundle, ``opa version``."""
    checks = [
        ("/opt/broker/bin/broker", "--help"),
        ("/opt/broker/bin/python", "-c", SMOKE_PYTHON),
        ("/usr/local/bin/opa", "version"),
    ]
    for argv in checks:
        done = in_image(
            root, *argv, as_broker=True, PYTHONDONTWRITEBYTECODE="1", HOME="/var/lib/broker"
        )
        if done.returncode != 0 or not done.stdout:
            raise RuntimeError(f"{argv[0]} failed in the image:\n{done.stdout}{done.stderr}")


def components(
    locked: list[debian.LockedDeb], wheel: Path, revision: str, opa: Path, opa_info: str
) -> list[sbom.Component]:
    found = [sbom.Component("deb", d.name, d.version, d.sha256, arch=d.arch) for d in locked]
    found += [
        sbom.Component("pypi", w.name, w.version, w.sha256)
        for w in python_env.read_lock(HERE / "python.lock")
    ]
    name, version = wheel.name.split("-")[:2]
    found.append(
        sbom.Component(
            "pypi", name.replace("_", "-"), version, python_env.sha256_of(wheel),
            comment=f"this project's wheel, built from {revision}",
        )
    )  # fmt: skip
    opa_version = next(
        line.split()[2] for line in opa_info.splitlines() if line.split()[:1] == ["mod"]
    )
    flags = "go install -trimpath -ldflags=-buildid=, CGO_ENABLED=0"
    found.append(
        sbom.Component("golang", OPA_MODULE, opa_version, python_env.sha256_of(opa), comment=flags)
    )
    return found + sbom.go_modules(opa_info, OPA_MODULE)


def write_image(
    root: Path, out: Path, epoch: int, revision: str, compression: oci.Compression
) -> tuple[oci.Blob, list[oci.Layer]]:
    settings = json.loads(IMAGE_JSON.read_text())
    labels = settings["labels"] | {
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": oci.rfc3339(epoch),
    }
    if out.exists():
        shutil.rmtree(out)
    blobs = out / "blobs" / "sha256"
    entries = oci.scan_tree(root, OWNERS)
    compressor = in_image_argv(root, f"/usr/bin/{python_env.PYTHON}", "-c", oci.GZIP_FILTER)
    layers = [
        oci.write_layer(
            name, members, blobs, mtime=epoch, compression=compression, compressor=compressor
        )
        for name, members in oci.split_layers(entries, LAYERS)
    ]
    history = [f"deploy/image: {layer.name} ({layer.entries} entries)" for layer in layers]
    config = oci.image_config(
        created=oci.rfc3339(epoch), layers=layers, history=history, settings=settings,
        labels=labels,
    )  # fmt: skip
    return oci.write_layout(out, layers, config, settings["ref_name"]), layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.image.build", description=__doc__)
    parser.add_argument("--opa-version", required=True)
    parser.add_argument("--go-toolchain", required=True, help="e.g. go1.26.8 (GOTOOLCHAIN)")
    parser.add_argument("--out", type=Path, default=Path("build/image"))
    parser.add_argument("--cache", type=Path, default=Path("build/image-cache"))
    parser.add_argument("--compression", choices=["gzip", "none"], default="gzip")
    parser.add_argument("--apt-sources", type=Path, help="apt sources for Debian (one-line form)")
    parser.add_argument("--no-smoke", action="store_true", help="run nothing in the image")
    args = parser.parse_args(argv)
    repo = Path.cwd()
    cache = args.cache.resolve()
    revision, epoch = commit_of(repo)
    work = cache / "stage"
    if work.exists():
        shutil.rmtree(work)
    root = work / "rootfs"
    root.mkdir(parents=True)
    started = time.monotonic()
    with step("debian packages"):
        locked = stage_debian(root, cache, args.apt_sources)
    python_version = next(d.version for d in locked if d.name == python_env.PYTHON).split("-")[0]
    with step("python environment"):
        wheel = stage_python(root, repo, work, epoch, python_version)
    with step("opa"):
        opa, opa_info = build_opa(args.opa_version, args.go_toolchain, cache)
    stage_broker_files(root, repo, opa, json.loads(IMAGE_JSON.read_text())["config_files"])
    with step("bytecode"):
        compile_bytecode(root)
    with step("layers and layout"):
        manifest, layers = write_image(root, args.out, epoch, revision, args.compression)
    found = components(locked, wheel, revision, opa, opa_info)
    document = sbom.document(
        image_name="sealed-runner-broker", manifest_digest=manifest.digest, epoch=epoch,
        components=found,
    )  # fmt: skip
    sbom_path = args.out.parent / "image.spdx.json"
    sbom_path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    (args.out / "digest").write_text(manifest.digest + "\n")  # beside the layout's own files
    if not args.no_smoke:
        with step("smoke: the broker, its libraries and OPA run in the image"):
            smoke(root)
    size = sum(layer.blob.size for layer in layers)
    print(
        f"[image] {args.out}: {len(layers)} layers, {size / 1e6:.1f} MB; SBOM {sbom_path}; "
        f"revision {revision}; {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    print(manifest.digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
