"""Runs the Rego unit tests of a policy directory (``broker policy test``) with ``opa test``.

Why OPA and not the embedded engine: regopy (1.3-1.5.2) crashes the process (SIGSEGV) when a
query uses ``with input as …`` on a rule that depends on another rule — exactly what Rego unit
tests do. Evaluation in the broker never uses ``with``, so the embedded engine stays the default
for decisions; tests run under the reference implementation, which is what security teams
use anyway. ``make test`` installs a pinned OPA into the virtual environment
(see ``Makefile``; docs/policy.md).

A directory without tests fails: an untested policy is not a shippable policy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from broker.core.errors import ConfigError

OPA_ENV = "BROKER_OPA"
OPA_TEST_TIMEOUT_SECONDS = 300


@dataclass(frozen=True)
class PolicyTestRun:
    passed: bool
    output: str


def find_opa(explicit: str | None = None) -> Path:
    """The OPA binary: ``explicit``, then ``$BROKER_OPA``, then next to this Python, then PATH.

    Raises:
        ConfigError: ``opa`` when none is found.
    """
    candidates = [explicit, os.environ.get(OPA_ENV)]
    beside_python = Path(sys.executable).parent / "opa"
    candidates.append(str(beside_python) if beside_python.exists() else None)
    candidates.append(shutil.which("opa"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise ConfigError("opa", "no OPA binary found (set BROKER_OPA or run `make test` once)")


def run_policy_tests(policy_dir: Path, *, opa: Path) -> PolicyTestRun:
    """Run ``opa test -v`` over the directory; passed only when OPA ran at least one test.

    Raises:
        ConfigError: ``policy.dir`` when the directory holds no ``*_test.rego``.
    """
    if not any(policy_dir.rglob("*_test.rego")):
        raise ConfigError("policy.dir", f"no *_test.rego files in {policy_dir}")
    completed = subprocess.run(  # noqa: S603 - fixed argv, no shell
        [str(opa), "test", "-v", str(policy_dir)],
        capture_output=True,
        text=True,
        timeout=OPA_TEST_TIMEOUT_SECONDS,
        check=False,
    )
    output = completed.stdout + completed.stderr
    return PolicyTestRun(passed=completed.returncode == 0 and "PASS:" in output, output=output)
