"""docs/examples/input.json is a real decision's policy input (taken from a release's record), and
it stays one: the broker's input today has exactly its shape, and ``broker policy eval`` decides
it as documented in docs/policy.md."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from tests.integration.conftest import RunningBroker
from tests.support.cli import run
from tests.support.constants import ALLOWED, KEY

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "input.json"


def shape(value: Any, at: str = "") -> set[str]:
    """Every JSON pointer of objects' members (array items share one shape)."""
    if isinstance(value, dict):
        found = {at}
        for name, item in value.items():
            found |= shape(item, f"{at}/{name}")
        return found
    if isinstance(value, list):
        return set().union(*(shape(item, f"{at}/*") for item in value)) | {at}
    return {at}


async def test_the_example_is_a_live_decisions_input(broker: RunningBroker) -> None:
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    live = next(r for r in reversed(broker.records()) if r.get("type") == "release")["input"]
    if os.environ.get("REGENERATE_EXAMPLE"):  # after a deliberate change of the input schema
        await asyncio.to_thread(EXAMPLE.write_text, json.dumps(live, indent=2) + "\n")
    example = json.loads(await asyncio.to_thread(EXAMPLE.read_text))
    assert shape(example) == shape(live)
    assert example["schema"] == live["schema"]


def test_policy_eval_decides_the_example_as_documented() -> None:
    done = run("policy", "eval", "--policy", "policies", "--input", str(EXAMPLE))
    decision = json.loads(done.stdout)
    assert (done.returncode, decision["allow"]) == (0, False)  # the shipped data allows no image
    assert decision["reasons"] == [f"image {ALLOWED} is not allowed for key {KEY}"]
