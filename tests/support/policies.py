"""Compiled policies shared by the tests of one test process.

Every test broker compiles its workspace's policy directory with OPA (check, parse, test, build:
about a second of OPA per broker). Most workspaces hold the same bytes, so the first compile of
each distinct directory content runs the real ``compile_policy_dir`` and later ones reuse its
result; a directory that differs by one byte (a reload test's edit), a failing compile (never
cached) or another OPA binary compiles afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

from broker.policy.wasm import CompiledPolicy

Compile = Callable[..., CompiledPolicy]


def directory_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cached(compile_policy_dir: Compile) -> Compile:
    """``compile_policy_dir``, memoised on the directory's exact content and the arguments."""
    results: dict[tuple[str, str, str, bool], CompiledPolicy] = {}

    def compile_once(
        policy_dir: Path, *, opa: Path, revision: str = "", run_tests: bool = False
    ) -> CompiledPolicy:
        key = (directory_digest(policy_dir), str(opa), revision, run_tests)
        if key not in results:
            results[key] = compile_policy_dir(
                policy_dir, opa=opa, revision=revision, run_tests=run_tests
            )
        return dataclasses.replace(results[key], source=str(policy_dir))

    return compile_once
