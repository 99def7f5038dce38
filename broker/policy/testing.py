"""Where the OPA binary is: the pinned ``opa`` that compiles policies to Wasm and runs their Rego
unit tests (``broker policy test``, in ``cli/policy.py``: the tests run under OPA, then the same
cases are replayed through the broker's own engine and any difference fails). ``make test``
installs the pinned OPA into the virtual environment (see ``Makefile``; docs/policy.md).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from broker.core.errors import ConfigError

OPA_ENV = "BROKER_OPA"


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
    raise ConfigError(
        "opa",
        f"no OPA binary found (--opa, ${OPA_ENV}, next to {sys.executable}, PATH): install OPA "
        "(https://www.openpolicyagent.org/docs/#running-opa) or set BROKER_OPA to its path",
    )
