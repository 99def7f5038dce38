"""Reading a policy directory once: Rego modules, data documents, and the digest of both.

Layout follows OPA bundle conventions: every ``*.rego`` file is a module; every ``data.json`` is
mounted at the data path named by its directory (``policies/broker/data.json`` ->
``data.broker``); ``*_test.rego`` files are Rego unit tests, run before a policy goes live and
left out of evaluation. The files read here are the only bytes the broker and OPA see: they are
staged from memory for ``opa check``/``opa test``/``opa build``, never re-read from the
directory.

What OPA would load from a bundle directory and the broker cannot vouch for is refused, not
skipped: YAML data (OPA reads even a ``data.json`` that is not JSON as YAML), a ``.manifest``
(the broker writes its own), ``.signatures.json`` and compiled modules.

Kubernetes ConfigMap and Secret volumes hold ``..<timestamp>/`` (the files), ``..data`` (a link
to it, swapped atomically on update) and one link per item into ``..data``. The loader resolves
``..data`` once per load and reads that one directory, so one load never mixes two versions, and
skips every ``..*`` entry.

The source digest (``sha256:…``) covers every file's relative path and bytes, in sorted order
(``opa_bundle.files_digest``); it changes when anything OPA would load changes.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.core.errors import ConfigError
from broker.policy.opa_bundle import files_digest

MAX_POLICY_FILES = 512
MAX_POLICY_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 16
DATA_FILE = "data.json"
KUBELET_DATA = "..data"
# Files OPA loads from a bundle directory that a policy directory may not hold.
REFUSED_NAMES = {
    "data.yaml": "YAML data is not supported: write data.json",
    "data.yml": "YAML data is not supported: write data.json",
    ".manifest": "the broker writes the bundle manifest (broker policy build --revision)",
    ".signatures.json": "a policy directory is not signed; sign the bundle built from it",
    "policy.wasm": "a policy directory holds Rego, not compiled modules",
    "plan.json": "a policy directory holds Rego, not compiled plans",
}


@dataclass(frozen=True)
class PolicySource:
    """A policy directory as read once: every file OPA would load, by relative path."""

    root: Path  # the directory as configured (for messages)
    files: Mapping[str, bytes]  # relative path -> bytes (modules, tests, data)
    digest: str

    @property
    def modules(self) -> dict[str, str]:
        """Rego modules that decide (tests excluded)."""
        return {
            name: content.decode("utf-8")
            for name, content in self.files.items()
            if name.endswith(".rego") and not name.endswith("_test.rego")
        }

    @property
    def test_modules(self) -> dict[str, str]:
        return {
            name: content.decode("utf-8")
            for name, content in self.files.items()
            if name.endswith("_test.rego")
        }

    @property
    def data_files(self) -> dict[str, dict[str, Any]]:
        """Each ``data.json`` by path, parsed (checked to be a JSON object when read)."""
        return {
            name: json.loads(content)
            for name, content in self.files.items()
            if name.rsplit("/", 1)[-1] == DATA_FILE
        }

    @property
    def data(self) -> dict[str, Any]:
        """Every data file mounted at its directory's path."""
        merged: dict[str, Any] = {}
        for name, value in sorted(self.data_files.items()):
            _mount(merged, name, value)
        return merged


def load_policy_dir(root: Path) -> PolicySource:
    """Read a policy directory (or a kubelet ConfigMap volume holding one) once.

    Raises:
        ConfigError: ``policy.dir`` when the directory is missing, too large, has no modules,
            holds a file the broker refuses, or a data file is not a JSON object.
    """
    try:
        return _read(root)
    except OSError as exc:
        raise ConfigError("policy.dir", f"cannot read {root}: {exc.strerror or exc}") from exc


def _read(root: Path) -> PolicySource:
    base = _resolved_base(root)
    files: dict[str, bytes] = {}
    total = 0
    for relative, path in _walk(base, ""):
        name = relative.rsplit("/", 1)[-1]
        if name in REFUSED_NAMES:
            raise ConfigError("policy.dir", f"{relative}: {REFUSED_NAMES[name]}")
        if not (name.endswith(".rego") or name == DATA_FILE):
            continue  # OPA does not load it either (README.md, examples, …)
        if len(files) >= MAX_POLICY_FILES:
            raise ConfigError("policy.dir", "too many policy files")
        content = path.read_bytes()
        total += len(content)
        if total > MAX_POLICY_BYTES:
            raise ConfigError("policy.dir", "policy files exceed the size limit")
        if name == DATA_FILE:
            _json_object(relative, content)
        else:
            _utf8(relative, content)
        files[relative] = content
    if not any(n.endswith(".rego") and not n.endswith("_test.rego") for n in files):
        raise ConfigError("policy.dir", f"no Rego modules in {root}")
    source = PolicySource(root=root, files=files, digest=files_digest(files))
    source.data  # noqa: B018 - mount every data file now: a conflict refuses the load
    return source


def _resolved_base(root: Path) -> Path:
    """The directory to read: ``root``, or the one its kubelet ``..data`` link names now."""
    if not root.is_dir():
        raise ConfigError("policy.dir", f"not a directory: {root}")
    link = root / KUBELET_DATA
    if link.is_symlink() or link.is_dir():
        target = Path(os.path.realpath(link))
        if not target.is_dir():
            raise ConfigError("policy.dir", f"{link} does not name a directory")
        return target
    return root


def _walk(directory: Path, prefix: str, depth: int = 0) -> list[tuple[str, Path]]:
    """Regular files below ``directory`` by relative path, sorted; ``..*`` entries skipped."""
    if depth > MAX_DEPTH:
        raise ConfigError("policy.dir", f"directories nest deeper than {MAX_DEPTH}")
    found: list[tuple[str, Path]] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".."):
            continue  # kubelet bookkeeping (..data, ..<timestamp>) or not a file name at all
        relative = f"{prefix}{entry.name}"
        mode = os.stat(entry.path).st_mode  # follows links: a plain directory may hold them
        if stat.S_ISDIR(mode):
            found += _walk(Path(entry.path), relative + "/", depth + 1)
        elif stat.S_ISREG(mode):
            found.append((relative, Path(entry.path)))
    return found


def _utf8(relative: str, content: bytes) -> None:
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("policy.dir", f"{relative} is not UTF-8") from exc


def _json_object(relative: str, content: bytes) -> dict[str, Any]:
    try:
        value = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("policy.dir", f"{relative} is not JSON") from exc
    if not isinstance(value, dict):
        raise ConfigError("policy.dir", f"{relative} must hold a JSON object")
    return value


def _mount(data: dict[str, Any], name: str, value: dict[str, Any]) -> None:
    """Mount one data file at its directory's path; a key another file set refuses the load."""
    parts = name.split("/")[:-1]
    node = data
    for part in parts:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError("policy.dir", f"{name}: data path conflict at {'/'.join(parts)}")
        node = child
    for key, item in value.items():
        if key in node:
            raise ConfigError("policy.dir", f"{name}: data key {key!r} is defined by another file")
        node[key] = item
