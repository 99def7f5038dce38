"""docs/cli.md is the argument parser's reference: every command and option, as they are."""

from __future__ import annotations

from pathlib import Path

from broker.cli.docs import render
from broker.cli.main import _parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_the_reference_is_the_parser() -> None:
    """Regenerate with ``python -m broker.cli.docs > docs/cli.md`` when this fails."""
    assert DOC.read_text(encoding="utf-8") == render(_parser())


def test_every_command_is_in_the_reference() -> None:
    text = DOC.read_text(encoding="utf-8")
    for command in (
        "broker policy check", "broker policy fmt", "broker policy eval", "broker policy replay",
        "broker policy build", "broker audit key", "broker audit query", "broker audit prove",
        "broker audit check-proof", "broker audit export", "broker audit monitor",
        "broker dev init", "broker dev token", "broker weights inspect",
    ):  # fmt: skip
        assert f"## `{command}`" in text
    assert "| `--who WHO` |" in text
