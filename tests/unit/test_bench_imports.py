"""``make bench`` is not part of ``make test``: its scripts must at least import, or a move in
``broker/`` breaks them unseen (it did: ``broker.client.sdk.new_ephemeral_key`` moved)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_imports(script: str) -> None:
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", BENCH / script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    sys.path.insert(0, str(BENCH))  # the scripts import each other (floor_server)
    try:
        spec.loader.exec_module(module)  # top level only: each runs under __main__
    finally:
        sys.path.remove(str(BENCH))
        del sys.modules[spec.name]
