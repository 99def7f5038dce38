"""Deterministic OCI image layers and image layout, written without a container daemon.

Every byte written is a function of the staged files' paths, kinds, permission bits and contents
and of the values passed in (the source date, the image config). Whatever else varies between
two builds is normalised here:

1. order: entries sorted by path, parents before children;
2. owners: 0:0 unless the caller names an owner for a path; user and group names empty;
3. times: every mtime is the source date (``SOURCE_DATE_EPOCH``, the commit's time);
4. permissions: group and other write cleared (umask differences), unless the caller names a mode;
5. kinds: directories, regular files and symbolic links only (a hard link is stored as a file; a
   device, socket or FIFO in the tree is an error);
6. format: PAX, which adds an extended header only when a name needs one;
7. compression: gzip with mtime 0 and no file name in the header, at a fixed level; the build
   compresses with the image's own pinned zlib (``GZIP_FILTER``), not the host's. Or none: the
   digest then depends on no compressor at all.

The layout is OCI image-layout 1.0.0 (``oci-layout``, ``index.json``, ``blobs/sha256/``); JSON
documents are written canonically (sorted keys, no spaces).
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import os
import stat
import subprocess
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

MEDIA_TYPE_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPE_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
GZIP_LEVEL = 6
# stdin → gzip → stdout, as write_layer compresses in process: no name, mtime 0, GZIP_LEVEL.
GZIP_FILTER = (
    "import gzip, shutil, sys\n"
    "with gzip.GzipFile(filename='', mode='wb', fileobj=sys.stdout.buffer,"
    f" compresslevel={GZIP_LEVEL}, mtime=0) as z:\n"
    "    shutil.copyfileobj(sys.stdin.buffer, z, 1 << 20)\n"
)
_CHUNK = 1 << 20

Compression = Literal["none", "gzip"]
Kind = Literal["dir", "file", "symlink"]


@dataclass(frozen=True)
class Entry:
    """One path of a layer: ``path`` is relative ("usr/bin/python3.11"), without "./"."""

    path: str
    kind: Kind
    mode: int
    uid: int = 0
    gid: int = 0
    source: Path | None = None  # a regular file's content
    size: int = 0
    target: str = ""  # a symbolic link's target, as stored


@dataclass(frozen=True)
class Blob:
    """A content-addressed blob: ``digest`` is "sha256:…" of the bytes stored."""

    media_type: str
    digest: str
    size: int

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Layer:
    blob: Blob
    diff_id: str  # sha256 of the uncompressed tar (the image config's rootfs.diff_ids)
    name: str
    entries: int


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def canonical_json(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def scan_tree(
    root: Path, overrides: Mapping[str, tuple[int, int, int]] | None = None
) -> list[Entry]:
    """Every path under ``root`` as a normalised entry, sorted by path.

    Args:
        root: the staged root filesystem (not included itself).
        overrides: path → (uid, gid, mode) for the few paths that are not root's, or need a
            mode the normalisation would change (``tmp``: 0o1777).

    Raises:
        ValueError: a device, socket or FIFO is in the tree.
    """
    overrides = overrides or {}
    entries: list[Entry] = []
    for directory, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = Path(directory, name)
            rel = full.relative_to(root).as_posix()
            entries.append(_entry(full, rel, overrides.get(rel)))
    entries.sort(key=lambda entry: entry.path)
    return entries


def _entry(full: Path, rel: str, override: tuple[int, int, int] | None) -> Entry:
    st = full.lstat()
    uid, gid, mode = override or (0, 0, stat.S_IMODE(st.st_mode) & ~0o022)
    if stat.S_ISLNK(st.st_mode):
        return Entry(rel, "symlink", 0o777, uid, gid, target=os.readlink(full))
    if stat.S_ISDIR(st.st_mode):
        return Entry(rel, "dir", mode, uid, gid)
    if stat.S_ISREG(st.st_mode):
        return Entry(rel, "file", mode, uid, gid, source=full, size=st.st_size)
    raise ValueError(f"{rel}: not a directory, regular file or symbolic link")


def split_layers(
    entries: Sequence[Entry], rules: Sequence[tuple[str, Sequence[str]]]
) -> list[tuple[str, list[Entry]]]:
    """Assign each entry to the layer with the longest pattern matching it or an ancestor.

    ``rules`` is [(layer name, fnmatch patterns)] in image order; the rule with no patterns takes
    what no pattern matches. Each layer also carries the directories above its entries, with
    the same metadata, so that every layer unpacks on its own with the right modes.
    """
    by_path = {entry.path: entry for entry in entries}
    default = next(name for name, patterns in rules if not patterns)
    chosen: dict[str, list[Entry]] = {name: [] for name, _ in rules}
    for entry in entries:
        chosen[_layer_of(entry.path, rules, default)].append(entry)
    layers: list[tuple[str, list[Entry]]] = []
    for name, _ in rules:
        paths = {entry.path for entry in chosen[name]}
        parents = {parent for path in paths for parent in _parents(path)} - paths
        members = chosen[name] + [by_path[parent] for parent in parents]
        layers.append((name, sorted(members, key=lambda entry: entry.path)))
    return layers


def _layer_of(path: str, rules: Sequence[tuple[str, Sequence[str]]], default: str) -> str:
    matching = [
        (len(pattern), name)
        for name, patterns in rules
        for pattern in patterns
        if fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + "/*")
    ]
    return max(matching)[1] if matching else default


def _parents(path: str) -> Iterable[str]:
    parts = path.split("/")[:-1]
    return ("/".join(parts[: i + 1]) for i in range(len(parts)))


class _Writable(Protocol):
    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...


class _Sink:
    """Writes to one stream and feeds the bytes to a hash (what tarfile's stream mode needs)."""

    def __init__(self, stream: _Writable) -> None:
        self.stream = stream
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()


def write_layer(
    name: str,
    entries: Sequence[Entry],
    blobs: Path,
    *,
    mtime: int,
    compression: Compression = "none",
    compressor: Sequence[str] = (),
) -> Layer:
    """Write one layer blob into ``blobs`` (``blobs/sha256``) and describe it.

    With gzip, ``compressor`` is a command that runs ``GZIP_FILTER`` (the build runs it with the
    image's own Python and zlib, pinned by debian.lock, so the host's zlib makes no difference);
    without one, this interpreter compresses with the same settings.
    """
    blobs.mkdir(parents=True, exist_ok=True)
    partial = blobs / f".{name}.partial"
    with partial.open("wb") as out:
        if compression == "none":
            diff = _Sink(out)
            _write_tar(entries, diff, mtime)
        elif compressor:
            # the caller's own command (the image's Python), never input from elsewhere
            with subprocess.Popen(compressor, stdin=subprocess.PIPE, stdout=out) as process:  # noqa: S603
                assert process.stdin is not None  # noqa: S101 - stdin=PIPE
                diff = _Sink(process.stdin)
                _write_tar(entries, diff, mtime)
                process.stdin.close()
            if process.returncode != 0:
                raise RuntimeError(f"the compressor failed ({process.returncode})")
        else:
            with gzip.GzipFile(
                filename="", mode="wb", fileobj=out, compresslevel=GZIP_LEVEL, mtime=0
            ) as zipped:
                diff = _Sink(zipped)
                _write_tar(entries, diff, mtime)
    digest = _file_digest(partial)
    partial.replace(blobs / digest.removeprefix("sha256:"))
    media_type = MEDIA_TYPE_LAYER_GZIP if compression == "gzip" else MEDIA_TYPE_LAYER
    blob = Blob(media_type, digest, partial.parent.joinpath(digest[7:]).stat().st_size)
    return Layer(blob, "sha256:" + diff.hash.hexdigest(), name, len(entries))


def _write_tar(entries: Sequence[Entry], sink: _Sink, mtime: int) -> None:
    # Stream mode ("w|"): no seeking, fixed 10 KiB records, the same bytes for the same entries.
    # (typeshed's file protocol asks for read/seek/tell, which stream mode never calls.)
    with tarfile.open(  # type: ignore[call-overload]
        fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8"
    ) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.path)
            info.mtime = mtime
            info.mode = entry.mode
            info.uid, info.gid = entry.uid, entry.gid
            # uname and gname stay "" (TarInfo's default): owners are numbers only
            if entry.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif entry.kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = entry.target
                tar.addfile(info)
            else:
                assert entry.source is not None  # noqa: S101 - a file entry always has a source
                info.size = entry.size
                with entry.source.open("rb") as content:
                    tar.addfile(info, content)


def write_blob(blobs: Path, media_type: str, content: bytes) -> Blob:
    digest = hashlib.sha256(content).hexdigest()
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / digest).write_bytes(content)
    return Blob(media_type, "sha256:" + digest, len(content))


def image_config(
    *,
    created: str,
    layers: Sequence[Layer],
    history: Sequence[str],
    settings: Mapping[str, Any],
    labels: Mapping[str, str],
) -> dict[str, Any]:
    """The OCI image config: runtime settings, labels, the layers' diff_ids and their history.

    ``settings`` holds the image.json keys ``user``, ``env``, ``entrypoint``, ``cmd``,
    ``working_dir`` and ``exposed_ports``.
    """
    config: dict[str, Any] = {
        "User": settings["user"],
        "Env": [f"{key}={value}" for key, value in settings["env"].items()],
        "Entrypoint": list(settings["entrypoint"]),
        "Cmd": list(settings["cmd"]),
        "WorkingDir": settings["working_dir"],
        "ExposedPorts": {port: {} for port in settings["exposed_ports"]},
        "Labels": dict(labels),
    }
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": line} for line in history],
    }


def write_layout(
    out: Path, layers: Sequence[Layer], config: Mapping[str, Any], ref_name: str
) -> Blob:
    """Write the config, manifest, ``index.json`` and ``oci-layout``; return the manifest blob.

    The layer blobs are already in ``out/blobs/sha256`` (``write_layer``).
    """
    blobs = out / "blobs" / "sha256"
    config_blob = write_blob(blobs, MEDIA_TYPE_CONFIG, canonical_json(config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": config_blob.descriptor(),
        "layers": [layer.blob.descriptor() for layer in layers],
    }
    manifest_blob = write_blob(blobs, MEDIA_TYPE_MANIFEST, canonical_json(manifest))
    descriptor = manifest_blob.descriptor() | {
        "annotations": {"org.opencontainers.image.ref.name": ref_name}
    }
    index = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_INDEX, "manifests": [descriptor]}
    (out / "index.json").write_bytes(canonical_json(index))
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    return manifest_blob


def read_manifest(layout: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The layout's only manifest: (digest, manifest, config), each blob checked against its digest.

    Raises:
        ValueError: not one manifest, or a blob does not match its digest.
    """
    index = json.loads((layout / "index.json").read_bytes())
    if len(index["manifests"]) != 1:
        raise ValueError("the layout must hold exactly one manifest")
    digest = index["manifests"][0]["digest"]
    manifest = json.loads(_checked_blob(layout, digest))
    config = json.loads(_checked_blob(layout, manifest["config"]["digest"]))
    return digest, manifest, config


def _checked_blob(layout: Path, digest: str) -> bytes:
    content = (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()
    if "sha256:" + hashlib.sha256(content).hexdigest() != digest:
        raise ValueError(f"blob {digest} does not match its digest")
    return content


def unpack(layout: Path, dest: Path) -> dict[str, Any]:
    """Apply the image's layers in order into ``dest`` (no whiteouts: this builder makes none).

    Returns the image config. Each layer is checked against its digest and its diff_id.
    """
    _, manifest, config = read_manifest(layout)
    for descriptor, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"], strict=True):
        path = layout / "blobs" / "sha256" / descriptor["digest"].removeprefix("sha256:")
        if _file_digest(path) != descriptor["digest"]:
            raise ValueError(f"layer {descriptor['digest']} does not match its digest")
        opener = gzip.open if descriptor["mediaType"] == MEDIA_TYPE_LAYER_GZIP else open
        with opener(path, "rb") as raw:
            if "sha256:" + hashlib.file_digest(raw, "sha256").hexdigest() != diff_id:
                raise ValueError(f"layer {descriptor['digest']} does not match its diff_id")
        with tarfile.open(path) as tar:
            tar.extractall(dest, numeric_owner=True, filter=_safe_keeping_modes)  # noqa: S202 - filtered
    return config


def _safe_keeping_modes(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """The "tar" filter's refusals (absolute names, escapes from ``dest``), with the modes kept.

    The layers hold modes such as /tmp's 1777 that the filter would strip.
    """
    return tarfile.tar_filter(member, dest).replace(mode=member.mode, deep=False)


def _file_digest(path: Path) -> str:
    with path.open("rb") as content:
        return "sha256:" + hashlib.file_digest(content, "sha256").hexdigest()
