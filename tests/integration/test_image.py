"""Issue 29 item 5: the image digest means something (``make image``, deploy/image/).

Cheap, always: the layer writer and the OCI layout give the same digest for the same files
whatever their times, owners, umask or creation order, and a different one when a byte changes;
Debian packages (made here with ``dpkg-deb --build``) unpack into merged /usr with their modes
and a dpkg status; the SBOM is deterministic; the locks cover what pyproject.toml asks for; the
image runs the baked config as uid 10001 (its launch policy labels: test_deploy_sealed_broker.py).

Expensive, with ``BROKER_TEST_IMAGE=1``: two full builds of this tree give one digest, the
image unpacks from its layout and ``broker --help`` runs in it, and skopeo/umoci (when
installed) read the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from deploy.image import debian, oci, sbom

ROOT = Path(__file__).parents[2]
IMAGE_JSON = ROOT / "deploy/confidential-space/broker/image.json"
EPOCH = 1_765_000_000
RULES: list[tuple[str, tuple[str, ...]]] = [("base", ()), ("app", ("opt/app", "etc/app"))]


def make_tree(root: Path, *, reverse: bool, mode: int, mtime: int, owner: int) -> None:
    files = [("opt/app/bin/run", b"#!/bin/sh\n", 0o755), ("etc/app/conf", b"a = 1\n", mode)]
    files += [("usr/lib/libx.so.1", b"\x7fELF", 0o644), ("var/lib/state/.keep", b"", mode)]
    for rel, content, file_mode in reversed(files) if reverse else files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.chmod(path, file_mode)
    (root / "usr/lib/libx.so").symlink_to("libx.so.1")
    for path in [*root.rglob("*"), root]:
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, 0o755 | (mode & 0o020))  # as a umask of 002 leaves them
        os.chown(path, owner, owner, follow_symlinks=False)
        os.utime(path, (mtime, mtime), follow_symlinks=False)


def layout_of(root: Path, out: Path, compression: oci.Compression = "none") -> str:
    entries = oci.scan_tree(root, {"var/lib/state": (10001, 10001, 0o700)})
    blobs = out / "blobs/sha256"
    layers = [
        oci.write_layer(name, members, blobs, mtime=EPOCH, compression=compression)
        for name, members in oci.split_layers(entries, RULES)
    ]
    settings = json.loads(IMAGE_JSON.read_text())
    config = oci.image_config(
        created=oci.rfc3339(EPOCH),
        layers=layers,
        history=[layer.name for layer in layers],
        settings=settings,
        labels=settings["labels"],
    )
    return oci.write_layout(out, layers, config, "test").digest


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_same_files_give_the_same_digest_whatever_times_owners_umask_and_order(
    tmp_path: Path, compression: oci.Compression
) -> None:
    make_tree(tmp_path / "a", reverse=False, mode=0o644, mtime=1_000_000_000, owner=0)
    make_tree(tmp_path / "b", reverse=True, mode=0o664, mtime=1_700_000_000, owner=1234)
    first = layout_of(tmp_path / "a", tmp_path / "out-a", compression)
    second = layout_of(tmp_path / "b", tmp_path / "out-b", compression)
    assert first == second
    assert sorted(p.name for p in (tmp_path / "out-a/blobs/sha256").iterdir()) == sorted(
        p.name for p in (tmp_path / "out-b/blobs/sha256").iterdir()
    )


def test_the_gzip_filter_command_compresses_as_the_writer_does(tmp_path: Path) -> None:
    make_tree(tmp_path / "a", reverse=False, mode=0o644, mtime=EPOCH, owner=0)
    entries = oci.scan_tree(tmp_path / "a")
    here = oci.write_layer("l", entries, tmp_path / "one", mtime=EPOCH, compression="gzip")
    filtered = oci.write_layer(
        "l", entries, tmp_path / "two", mtime=EPOCH, compression="gzip",
        compressor=[sys.executable, "-c", oci.GZIP_FILTER],
    )  # fmt: skip
    assert here == filtered
    plain = oci.write_layer("l", entries, tmp_path / "three", mtime=EPOCH)
    assert plain.diff_id == here.diff_id
    assert plain.blob.digest == plain.diff_id != here.blob.digest


def test_one_changed_byte_or_mode_changes_the_digest(tmp_path: Path) -> None:
    make_tree(tmp_path / "a", reverse=False, mode=0o644, mtime=EPOCH, owner=0)
    digest = layout_of(tmp_path / "a", tmp_path / "out-a")
    (tmp_path / "a/etc/app/conf").write_bytes(b"a = 2\n")
    changed = layout_of(tmp_path / "a", tmp_path / "out-b")
    os.chmod(tmp_path / "a/etc/app/conf", 0o600)
    rechmoded = layout_of(tmp_path / "a", tmp_path / "out-c")
    assert len({digest, changed, rechmoded}) == 3


def test_layers_hold_normalised_members_and_their_parents(tmp_path: Path) -> None:
    make_tree(tmp_path / "a", reverse=False, mode=0o664, mtime=1_700_000_000, owner=1234)
    out = tmp_path / "out"
    layout_of(tmp_path / "a", out, "gzip")
    digest, manifest, config = oci.read_manifest(out)
    assert config["config"]["User"] == "10001:10001"
    members: list[list[tarfile.TarInfo]] = []
    for descriptor in manifest["layers"]:
        blob = out / "blobs/sha256" / descriptor["digest"].removeprefix("sha256:")
        header = blob.read_bytes()[:10]
        assert header[3] == 0
        assert header[4:8] == b"\0\0\0\0"
        with tarfile.open(blob) as tar:
            members.append(tar.getmembers())
    base, app = ([m.name for m in layer] for layer in members)
    assert app == [
        "etc",
        "etc/app",
        "etc/app/conf",
        "opt",
        "opt/app",
        "opt/app/bin",
        "opt/app/bin/run",
    ]
    assert "etc/app/conf" not in base
    assert "usr/lib/libx.so" in base
    everything = {m.name: m for layer in members for m in layer}
    assert {m.mtime for m in everything.values()} == {EPOCH}
    assert everything["etc/app/conf"].mode == 0o644  # group write cleared
    assert (everything["etc/app/conf"].uid, everything["etc/app/conf"].uname) == (0, "")
    assert (everything["var/lib/state"].uid, everything["var/lib/state"].mode) == (10001, 0o700)
    assert everything["usr/lib/libx.so"].linkname == "libx.so.1"
    assert digest.startswith("sha256:")


def test_unpack_checks_every_blob_against_its_digest(tmp_path: Path) -> None:
    make_tree(tmp_path / "a", reverse=False, mode=0o644, mtime=EPOCH, owner=0)
    out = tmp_path / "out"
    layout_of(tmp_path / "a", out)
    oci.unpack(out, tmp_path / "rootfs")
    assert (tmp_path / "rootfs/opt/app/bin/run").read_bytes() == b"#!/bin/sh\n"
    _, manifest, _ = oci.read_manifest(out)
    layer = out / "blobs/sha256" / manifest["layers"][1]["digest"].removeprefix("sha256:")
    layer.write_bytes(layer.read_bytes().replace(b"a = 1", b"a = 9"))
    with pytest.raises(ValueError, match="does not match its digest"):
        oci.unpack(out, tmp_path / "again")


def test_a_device_or_fifo_never_enters_a_layer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match="pipe: not a directory"):
        oci.scan_tree(tmp_path)


def make_deb(where: Path, name: str, files: dict[str, tuple[bytes, int]]) -> Path:
    tree = where / f"{name}-tree"
    (tree / "DEBIAN").mkdir(parents=True)
    control = f"Package: {name}\nVersion: 1.0-1\nArchitecture: amd64\nMulti-Arch: same\n"
    control += "Maintainer: t <t@example.com>\nDescription: test\n"
    (tree / "DEBIAN/control").write_text(control)
    for rel, (content, mode) in files.items():
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.chmod(path, mode)
    deb = where / f"{name}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)],
        check=True,
        capture_output=True,
    )
    return deb


@pytest.mark.skipif(not shutil.which("dpkg-deb"), reason="dpkg-deb (Debian's dpkg) not installed")
def test_debian_packages_unpack_into_merged_usr_with_their_modes_and_a_status(
    tmp_path: Path,
) -> None:
    libfoo = make_deb(
        tmp_path,
        "libfoo1",
        {"lib/x86_64-linux-gnu/libfoo.so.1": (b"lib", 0o644), "bin/foo": (b"run", 0o4755)},
    )
    clash = make_deb(tmp_path, "clash", {"usr/bin/foo": (b"other", 0o755)})
    root = tmp_path / "rootfs"
    root.mkdir()
    debian.merged_usr(root)
    unpacked = debian.unpack(libfoo, root)
    assert (root / "usr/lib/x86_64-linux-gnu/libfoo.so.1").read_bytes() == b"lib"
    assert oct((root / "usr/bin/foo").stat().st_mode & 0o7777) == oct(0o4755)
    assert (root / "bin").readlink() == Path("usr/bin")
    debian.write_status(root, [unpacked])
    status = (root / "var/lib/dpkg/status").read_text()
    assert status.startswith("Package: libfoo1\nStatus: install ok installed\n")
    listed = (root / "var/lib/dpkg/info/libfoo1:amd64.list").read_text().splitlines()
    assert "/bin/foo" in listed
    assert "/lib/x86_64-linux-gnu/libfoo.so.1" in listed
    with pytest.raises(RuntimeError, match="shipped by two packages"):
        debian.unpack(clash, root)


def test_a_package_cannot_write_through_a_link_out_of_the_root(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc/ssl").symlink_to(tmp_path / "outside")
    with pytest.raises(RuntimeError, match="a parent is a symbolic link"):
        debian._check_parents(root, "etc/ssl/certs/evil.pem")


GO_VERSION_M = (
    "/x/opa: go1.26.8\n\tpath\tgithub.com/open-policy-agent/opa\n"
    "\tmod\tgithub.com/open-policy-agent/opa\tv1.22.4\th1:abc=\n"
    "\tdep\tgithub.com/a/b\tv1.0.0\th1:def=\n\tdep\tgithub.com/c/d\tv0.1.0\th1:ghi=\n"
    "\t=>\tgithub.com/c/e\tv0.2.0\th1:jkl=\n\tbuild\t-trimpath=true\n"
)


def test_sbom_is_deterministic_and_names_each_component_by_purl_and_hash() -> None:
    components = [
        sbom.Component("deb", "libc6", "2.36-9+deb12u14", "aa" * 32, arch="amd64"),
        sbom.Component("pypi", "PyJWT", "2.15.1", "bb" * 32),
        sbom.Component("golang", "github.com/open-policy-agent/opa", "v1.22.4", "cc" * 32),
        *sbom.go_modules(GO_VERSION_M, "github.com/open-policy-agent/opa"),
    ]
    first = sbom.document(image_name="b", manifest_digest="sha256:" + "d" * 64, epoch=EPOCH,
                          components=components)  # fmt: skip
    again = sbom.document(image_name="b", manifest_digest="sha256:" + "d" * 64, epoch=EPOCH,
                          components=components)  # fmt: skip
    assert first == again
    assert first["spdxVersion"] == "SPDX-2.3"
    purls = {p["externalRefs"][0]["referenceLocator"] for p in first["packages"]}
    assert "pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=amd64&distro=debian-12" in purls
    assert {"pkg:pypi/pyjwt@2.15.1", "pkg:golang/github.com/c/e@v0.2.0"} <= purls
    assert "pkg:golang/github.com/c/d@v0.1.0" not in purls  # replaced by c/e
    assert "pkg:golang/stdlib@go1.26.8" in purls
    ids = {p["SPDXID"] for p in first["packages"]}
    assert len(ids) == len(first["packages"])
    assert all(r["relatedSpdxElement"] in ids for r in first["relationships"])


def test_python_lock_covers_every_server_requirement() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = {}
    for line in (ROOT / "deploy/image/python.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split()[0].split("==")
            assert "--hash=sha256:" in line
            locked[name.lower().replace("_", "-")] = version
    for spec in [*project["dependencies"], *project["optional-dependencies"]["server"]]:
        requirement = Requirement(spec)
        name = requirement.name.lower().replace("_", "-")
        assert name in locked, f"{name}: not in python.lock (run `make image-lock`)"
        assert requirement.specifier.contains(locked[name]), f"{name}=={locked[name]}: {spec}"


def test_debian_lock_pins_python_and_leaves_out_install_time_tools() -> None:
    locked = {deb.name: deb for deb in debian.read_lock(ROOT / "deploy/image/debian.lock")}
    roots, excluded = debian.read_inputs(ROOT / "deploy/image/debian.in")
    assert set(roots) <= set(locked)
    assert not set(excluded) & set(locked)
    assert locked["python3.11"].version.startswith("3.11.")
    assert all(len(deb.sha256) == 64 for deb in locked.values())


def test_the_image_runs_the_baked_config_as_the_broker_user() -> None:
    """The config the build reads (the labels: test_deploy_sealed_broker.py)."""
    settings = json.loads(IMAGE_JSON.read_text())
    assert settings["user"] == "10001:10001"
    assert settings["entrypoint"] == ["broker"]
    assert settings["cmd"] == ["serve", "--config", "/etc/broker/broker.toml"]
    assert "broker.toml" in settings["config_files"]
    assert all("/" not in name for name in settings["config_files"])  # only that directory's


def full_build(out: Path) -> str:
    tools = ROOT / "build/image-tools"
    subprocess.run(["make", "-s", "build/image-tools/.installed"], cwd=ROOT, check=True)
    done = subprocess.run(
        [str(tools / "bin/python"), "-m", "deploy.image.build", "--out", str(out),
         "--opa-version", make_variable("OPA_VERSION"),
         "--go-toolchain", make_variable("IMAGE_GO_TOOLCHAIN")],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def make_variable(name: str) -> str:
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith(f"{name} :="):
            return line.split(":=", 1)[1].strip()
    raise AssertionError(f"{name} is not set in the Makefile")


@pytest.mark.skipif(os.environ.get("BROKER_TEST_IMAGE") != "1", reason="BROKER_TEST_IMAGE=1")
@pytest.mark.timeout(1800)
def test_full_build_twice_gives_one_digest_and_the_image_runs(tmp_path: Path) -> None:
    first = full_build(tmp_path / "one/image")
    second = full_build(tmp_path / "two/image")
    assert first == second
    assert first.startswith("sha256:")
    rootfs = tmp_path / "rootfs"
    config = oci.unpack(tmp_path / "one/image", rootfs)
    assert config["config"]["Labels"]["tee.launch_policy.allow_cmd_override"] == "false"
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    done = subprocess.run(
        [chroot, str(rootfs), "/opt/broker/bin/broker", "--help"],
        env={"PATH": "/opt/broker/bin:/usr/bin", "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout
    assert (rootfs / "var/lib/broker").stat().st_uid == 10001
    if shutil.which("skopeo"):
        raw = subprocess.run(
            ["skopeo", "inspect", "--raw", f"oci:{tmp_path / 'one/image'}"],
            capture_output=True, check=True,
        ).stdout  # fmt: skip
        assert "sha256:" + hashlib.sha256(raw).hexdigest() == first
    sbom_doc = json.loads((tmp_path / "one/image.spdx.json").read_text())
    names = {p["name"] for p in sbom_doc["packages"]}
    assert {"libc6", "python3.11", "cryptography", "github.com/open-policy-agent/opa"} <= names
