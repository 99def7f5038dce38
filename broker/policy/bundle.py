"""Loading a policy directory: Rego modules, data documents, and one digest over both.

Layout follows OPA bundle conventions so the same directory can later be served to an OPA
server: every ``*.rego`` file is a module; every ``data.json`` is mounted at the data path named
by its directory (``policies/broker/data.json`` -> ``data.broker``); ``*_test.rego`` files are
Rego unit tests, loaded for ``broker policy test`` and left out of evaluation.

The digest (``sha256:…``) covers every file's relative path and bytes, in sorted order, so the
decision log names exactly the policy text and data that decided.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.errors import ConfigError

MAX_POLICY_FILES = 512
MAX_POLICY_BYTES = 8 * 1024 * 1024
DATA_FILE = "data.json"


@dataclass(frozen=True)
class PolicyBundle:
    root: Path
    modules: Mapping[str, str]  # relative path -> Rego text (tests excluded)
    test_modules: Mapping[str, str]
    data: Mapping[str, Any]
    digest: str


def load_policy_dir(root: Path) -> PolicyBundle:
    """Read a policy directory.

    Raises:
        ConfigError: ``policy.dir`` when the directory is missing, too large, has no modules,
            or a data file is not a JSON object.
    """
    if not root.is_dir():
        raise ConfigError("policy.dir", f"not a directory: {root}")
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and (p.suffix == ".rego" or p.name == DATA_FILE)
    )
    if len(files) > MAX_POLICY_FILES:
        raise ConfigError("policy.dir", "too many policy files")
    digest = hashlib.sha256()
    total = 0
    modules: dict[str, str] = {}
    tests: dict[str, str] = {}
    data: dict[str, Any] = {}
    for path in files:
        relative = path.relative_to(root).as_posix()
        content = path.read_bytes()
        total += len(content)
        if total > MAX_POLICY_BYTES:
            raise ConfigError("policy.dir", "policy files exceed the size limit")
        digest.update(f"{relative}\0{len(content)}\0".encode())
        digest.update(content)
        if path.name == DATA_FILE:
            _mount(data, path.parent.relative_to(root).parts, _json_object(relative, content))
        elif path.name.endswith("_test.rego"):
            tests[relative] = content.decode("utf-8")
        else:
            modules[relative] = content.decode("utf-8")
    if not modules:
        raise ConfigError("policy.dir", f"no Rego modules in {root}")
    return PolicyBundle(
        root=root,
        modules=modules,
        test_modules=tests,
        data=data,
        digest="sha256:" + digest.hexdigest(),
    )


def _json_object(relative: str, content: bytes) -> dict[str, Any]:
    try:
        value = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("policy.dir", f"{relative} is not JSON") from exc
    if not isinstance(value, dict):
        raise ConfigError("policy.dir", f"{relative} must hold a JSON object")
    return value


def _mount(data: dict[str, Any], parts: tuple[str, ...], value: dict[str, Any]) -> None:
    node = data
    for part in parts:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError("policy.dir", f"data path conflict at {'/'.join(parts)}")
        node = child
    for key, item in value.items():
        if key in node:
            raise ConfigError("policy.dir", f"data key {key!r} defined twice")
        node[key] = item
