"""``broker policy check``'s input lint: ``input.a.b`` references the broker never sets.

A reference outside what the broker writes into the input (docs/policy.md, "Input") is a typo or
a field from another product; the lint warns (``--strict`` makes warnings fail the check).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# What the broker sets in the input (docs/policy.md). A reference outside these is a typo or a
# field from another product: `broker policy check` warns about it.
KNOWN_INPUT: dict[str, Any] = {
    "schema": None,
    "time": None,
    "claims": "*",
    "gpus": "*",
    "request": {
        "key": None, "version": None, "purpose": None, "runner_key_thumbprint": None, "kind": None,
    },
    "tee": {
        "verifier": None, "issuer": None, "technology": None, "hwmodel": None, "debug": None,
        "secure_boot": None, "tcb_status": None, "advisory_ids": None, "measurements": "*",
        # AMD SEV-SNP reports verified in process (attestation/raw/snp.py)
        "tcb": {"bootloader": None, "tee": None, "snp": None, "microcode": None, "fmc": None},
        "product": None, "signing_key": None, "vmpl": None, "guest_svn": None,
        "software": {"name": None, "version": None, "support": None},
        "workload": {
            "image_reference": None, "image_digest": None, "image_id": None,
            "restart_policy": None, "service_accounts": None, "args": None, "env": "*",
            "env_override": "*", "signatures": "*",
        },
        "platform": {
            "project_id": None, "project_number": None, "zone": None, "instance_id": None,
            "instance_name": None,
        },
    },
}  # fmt: skip
INPUT_REF = re.compile(r"\binput((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def lint_input_paths(policy_dir: Path) -> Iterator[str]:
    """``input.a.b`` references the broker never sets (warnings, not errors)."""
    for path in sorted(policy_dir.rglob("*.rego")):
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), start=1):
            code = line.split("#", 1)[0]
            for match in INPUT_REF.finditer(code):
                parts = match.group(1).lstrip(".").split(".")
                unknown = _unknown_prefix(parts)
                if unknown:
                    yield (
                        f"{path.relative_to(policy_dir)}:{number}: input.{unknown} is not set by "
                        "the broker (docs/policy.md lists the input)"
                    )


def _unknown_prefix(parts: list[str]) -> str | None:
    node: Any = KNOWN_INPUT
    for index, part in enumerate(parts):
        if node == "*":
            return None
        if not isinstance(node, dict):
            return None  # a leaf value: methods/indexing beyond it are the policy's business
        if part not in node:
            return ".".join(parts[: index + 1])
        node = node[part]
    return None
