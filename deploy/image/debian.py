"""The image's Debian base: pinned packages fetched with apt, checked, unpacked without dpkg.

Packages come from Debian's archive as this host's apt reaches it (the sources signed by
Debian's archive key), through a private apt state under the build cache, so neither the host's
installed packages nor its other repositories take part. The lock (``debian.lock``) names each
package's exact version and the SHA-256 of its ``.deb``; apt checks the file against Debian's
signed index, and this module checks it against the lock.

Unpacking runs no maintainer script: each package's data archive is written under the root with
the merged-/usr layout (``bin``, ``sbin``, ``lib``, ``lib64`` are links into ``usr``), its modes
kept, and a dpkg status database written from the control files, so scanners and ``dpkg -l``
see what is installed.
"""
# ruff: noqa: S603, S607 - build tooling: runs fixed host tools (git, go, apt-get, dpkg-deb, chroot,
# pip) with arguments it builds itself.

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
MERGED_USR = ("bin", "sbin", "lib", "lib64")
_INST = re.compile(r"^Inst (\S+) (?:\[\S+\] )?\((\S+) (.+) \[(\S+)\]\)")
_URI = re.compile(r"^'[^']+' (\S+) (\d+) SHA256:([0-9a-f]{64})$")


@dataclass(frozen=True)
class LockedDeb:
    name: str
    version: str
    arch: str
    sha256: str
    size: int
    filename: str

    def line(self) -> str:
        return f"{self.name}={self.version} {self.arch} {self.sha256} {self.size} {self.filename}"


def read_lock(path: Path) -> list[LockedDeb]:
    locked = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            spec, arch, sha256, size, filename = line.split()
            name, version = spec.split("=", 1)
            locked.append(LockedDeb(name, version, arch, sha256, int(size), filename))
    return locked


def read_inputs(path: Path) -> tuple[list[str], list[str]]:
    """``debian.in``: package names to install, and ``-name`` for packages left out."""
    roots, excluded = [], []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-"):
            excluded.append(line[1:])
        elif line:
            roots.append(line)
    return roots, excluded


class Apt:
    """apt with a private state directory: an empty dpkg status and its own package lists."""

    def __init__(self, cache: Path, sources: Path | None = None) -> None:
        self.root = cache / "apt"
        for sub in ("lists/partial", "archives/partial", "parts"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "status").touch()
        sources_list = self.root / "sources.list"
        sources_list.write_text(
            sources.read_text() if sources else "".join(debian_sources(Path("/etc/apt")))
        )
        config = {
            "Dir::State": self.root,
            "Dir::State::lists": self.root / "lists",
            "Dir::State::status": self.root / "status",
            "Dir::Cache": self.root,
            "Dir::Cache::archives": self.root / "archives",
            "Dir::Etc::SourceList": sources_list,
            "Dir::Etc::SourceParts": self.root / "parts",
            "Dir::Etc::PreferencesParts": self.root / "parts",
            "Dir::Etc::Preferences": self.root / "parts/none",
            "APT::Architecture": "amd64",
            "APT::Install-Recommends": "false",
            "Acquire::Languages": "none",
        }
        conf = "".join(f'{key} "{value}";\n' for key, value in config.items())
        (self.root / "apt.conf").write_text(conf + 'APT::Architectures { "amd64"; };\n')

    def run(self, *argv: str, cwd: Path | None = None) -> str:
        environ = os.environ | {"APT_CONFIG": str(self.root / "apt.conf"), "LC_ALL": "C"}
        done = subprocess.run(
            argv, cwd=cwd, env=environ, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def update(self) -> None:
        self.run("apt-get", "update", "-qq")

    def resolve(self, roots: Sequence[str], excluded: Sequence[str]) -> list[LockedDeb]:
        """The closure of ``roots`` on an empty system, less ``excluded``, with hashes."""
        plan = self.run("apt-get", "-s", "install", "--no-install-recommends", *roots)
        chosen: dict[str, str] = {}
        for line in plan.splitlines():
            match = _INST.match(line)
            if match:
                name, version, origin, _ = match.groups()
                if not all(
                    o.split(":")[0] in {"Debian", "Debian-Security"} for o in origin.split(", ")
                ):
                    raise RuntimeError(f"{name} {version} comes from {origin}, not Debian")
                chosen[name] = version
        missing = set(excluded) - set(chosen)
        if missing:
            raise RuntimeError(f"excluded but not in the closure: {sorted(missing)}")
        wanted = [
            f"{name}={version}" for name, version in sorted(chosen.items()) if name not in excluded
        ]
        uris = self.run("apt-get", "download", "--print-uris", *wanted)
        by_file = {m.group(1): m for m in map(_URI.match, uris.splitlines()) if m}
        locked = []
        for spec in wanted:
            name, version = spec.split("=", 1)
            match = next(m for f, m in by_file.items() if f.startswith(f"{name}_"))
            arch = match.group(1).rsplit("_", 1)[1].removesuffix(".deb")
            locked.append(
                LockedDeb(name, version, arch, match.group(3), int(match.group(2)), match.group(1))
            )
        return locked

    def fetch(self, locked: Sequence[LockedDeb], debs: Path) -> list[Path]:
        """The locked ``.deb`` files in ``debs``: kept when their hash matches, else downloaded."""
        debs.mkdir(parents=True, exist_ok=True)
        missing = [deb for deb in locked if not _has(debs / deb.filename, deb.sha256)]
        if missing:
            self.update()
            self.run("apt-get", "download", *(f"{d.name}={d.version}" for d in missing), cwd=debs)
        for deb in locked:
            if not _has(debs / deb.filename, deb.sha256):
                raise RuntimeError(f"{deb.filename}: SHA-256 differs from debian.lock")
        return [debs / deb.filename for deb in locked]


def debian_sources(etc_apt: Path) -> Iterator[str]:
    """One-line apt sources for the host's entries signed by Debian's archive key."""
    for path in sorted((etc_apt / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = {
                key.strip(): value.strip()
                for key, _, value in (line.partition(":") for line in stanza.splitlines())
                if not key.startswith("#") and value
            }
            if (
                fields.get("Signed-By") == DEBIAN_KEYRING
                and "deb" in fields.get("Types", "").split()
            ):
                for uri in fields["URIs"].split():
                    for suite in fields["Suites"].split():
                        yield f"deb [signed-by={DEBIAN_KEYRING}] {uri} {suite} main\n"
    lists = [etc_apt / "sources.list", *sorted((etc_apt / "sources.list.d").glob("*.list"))]
    for path in lists:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("deb ") and f"signed-by={DEBIAN_KEYRING}" in line:
                yield line + "\n"


def _has(path: Path, sha256: str) -> bool:
    return path.exists() and _sha256(path) == sha256


def _sha256(path: Path) -> str:
    with path.open("rb") as content:
        return hashlib.file_digest(content, "sha256").hexdigest()


def merged_usr(root: Path) -> None:
    """``bin``, ``sbin``, ``lib``, ``lib64`` as relative links into ``usr`` (Debian 12's layout)."""
    for top in MERGED_USR:
        (root / "usr" / top).mkdir(parents=True, exist_ok=True)
        (root / top).symlink_to(f"usr/{top}")


def unpack(deb: Path, root: Path) -> tuple[bytes, bytes, list[str]]:
    """Write ``deb``'s files under ``root``; return (control, md5sums, the package's paths)."""
    paths: list[str] = []
    with _DpkgDeb("--fsys-tarfile", deb) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            packaged = "/" + member.name.removeprefix("./").rstrip("/")
            if packaged != "/":
                paths.append(packaged)
                _write_member(tar, member, root, _usr_path(packaged))
    control = md5sums = b""
    with _DpkgDeb("--ctrl-tarfile", deb) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            content = tar.extractfile(member) if member.isfile() else None
            if content and member.name.removeprefix("./") == "control":
                control = content.read()
            elif content and member.name.removeprefix("./") == "md5sums":
                md5sums = content.read()
    return control, md5sums, paths


class _DpkgDeb:
    """``dpkg-deb OPTION DEB``'s output as a stream; the exit status is checked on leaving."""

    def __init__(self, option: str, deb: Path) -> None:
        self.option = option
        self.process = subprocess.Popen(["dpkg-deb", option, str(deb)], stdout=subprocess.PIPE)

    def __enter__(self) -> IO[bytes]:
        assert self.process.stdout is not None  # noqa: S101 - stdout=PIPE
        return self.process.stdout

    def __exit__(self, *_: object) -> None:
        assert self.process.stdout is not None  # noqa: S101 - stdout=PIPE
        self.process.stdout.read()
        self.process.stdout.close()
        if self.process.wait() != 0:
            raise RuntimeError(f"dpkg-deb {self.option} failed")


def _usr_path(packaged: str) -> str:
    top, _, rest = packaged.lstrip("/").partition("/")
    return f"usr/{top}/{rest}".rstrip("/") if top in MERGED_USR else packaged.lstrip("/")


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path, rel: str) -> None:
    target = root / rel
    _check_parents(root, rel)
    if member.isdir():
        if not target.is_symlink():
            target.mkdir(exist_ok=True)
            os.chmod(target, member.mode)
        return
    if target.is_symlink() or target.exists():
        raise RuntimeError(f"/{rel} is shipped by two packages")
    if member.issym():
        target.symlink_to(member.linkname)
    elif member.isfile() or member.islnk():
        if member.islnk():  # a hard link to a file already written: store a copy
            shutil.copyfile(root / _usr_path("/" + member.linkname.removeprefix("./")), target)
        else:
            content = tar.extractfile(member)
            assert content is not None  # noqa: S101 - a regular member has content
            with target.open("wb") as out:
                shutil.copyfileobj(content, out)
        os.chmod(target, member.mode)
    else:
        raise RuntimeError(f"/{rel}: unexpected member type in a Debian package")


def _check_parents(root: Path, rel: str) -> None:
    """Refuse to write through a link: an absolute link would point out of the root."""
    current = root
    for part in rel.split("/")[:-1]:
        current = current / part
        if current.is_symlink():
            raise RuntimeError(f"/{rel}: a parent is a symbolic link")


def write_status(root: Path, packages: Sequence[tuple[bytes, bytes, list[str]]]) -> None:
    """``/var/lib/dpkg/status`` and ``info/*.list``/``*.md5sums``, sorted by package name."""
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    stanzas = []
    for control, md5sums, paths in sorted(
        packages, key=lambda package: _field(package[0], "Package")
    ):
        name = _field(control, "Package")
        lines = control.decode().rstrip("\n").split("\n")
        stanzas.append("\n".join([lines[0], "Status: install ok installed", *lines[1:]]) + "\n")
        key = (
            f"{name}:{_field(control, 'Architecture')}"
            if _field(control, "Multi-Arch") == "same"
            else name
        )
        (info / f"{key}.list").write_text("".join(f"{path}\n" for path in ["/.", *paths]))
        if md5sums:
            (info / f"{key}.md5sums").write_bytes(md5sums)
    (root / "var/lib/dpkg/status").write_text("\n".join(stanzas))


def _field(control: bytes, name: str) -> str:
    for line in control.decode().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    return ""


def ca_bundle(root: Path) -> None:
    """``/etc/ssl/certs/ca-certificates.crt`` as ``update-ca-certificates`` makes it.

    The package's postinst (which does not run here) lists every certificate under
    ``/usr/share/ca-certificates`` in ``/etc/ca-certificates.conf``, sorted, and the bundle is
    their concatenation in that order.
    """
    shipped = root / "usr/share/ca-certificates"
    names = sorted(path.relative_to(shipped).as_posix() for path in shipped.rglob("*.crt"))
    (root / "etc/ca-certificates.conf").write_text("".join(f"{name}\n" for name in names))
    bundle = b""
    for name in names:
        pem = (shipped / name).read_bytes()
        bundle += pem if pem.endswith(b"\n") else pem + b"\n"
    certs = root / "etc/ssl/certs"
    certs.mkdir(parents=True, exist_ok=True)
    (certs / "ca-certificates.crt").write_bytes(bundle)
