"""Every error code the broker can produce is in docs/api.md's error tables.

The codes come from two places: every member of ``ErrorCode`` (the one enum every ``BrokerError``,
the error middleware and aiohttp's protocol errors draw from), and any code written as a string
literal anywhere in ``broker/`` — a ``code=`` argument, a ``"code"`` member of a dict, an
assignment to ``code``, or the ``code`` parameter of a function or class defined in ``broker/``
called with a literal. A literal that is not an HTTP error code must be named in ``ELSEWHERE``
with the page that documents it, so a new code cannot go undocumented either way.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from broker.core.errors import ErrorCode

REPO = Path(__file__).resolve().parents[2]
BROKER = REPO / "broker"
API_DOC = REPO / "docs" / "api.md"
# The runner SDK's own codes (``broker_unreachable``, ``tls_error``, ``bad_response``…: status 0
# or a broker answer it cannot read) are the SDK's, not the broker's: docs/runner.md's.
SDK = BROKER / "client"
# Literals that are not HTTP error codes: the page that documents each, and the words it does.
ELSEWHERE = {
    # the `code` of a release that released: metrics label, a key's row in a record
    "ok": ("docs/api.md", "`code` is `ok`"),
    # `broker audit monitor`'s refusal (CLI, exit 1)
    "broker_not_attested": ("docs/audit.md", '"code": "broker_not_attested"'),
}
BACKTICKED = re.compile(r"`([a-z0-9_]+)`")
CODE = re.compile(r"[a-z][a-z0-9_]*")  # what a code looks like (not a help text)


def _strings(node: ast.AST | None) -> Iterator[str]:
    """The string constants an expression can evaluate to (through ``a if c else b``, ``or``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if CODE.fullmatch(node.value):
            yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _strings(value)


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def code_positions(trees: list[ast.Module]) -> dict[str, int]:
    """Functions and classes (by ``__init__``) with a ``code`` parameter: its positional index."""
    found: dict[str, int] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        names = [a.arg for a in item.args.args]
                        if "code" in names:
                            found[node.name] = names.index("code") - 1  # less self
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.args]
                if "code" in names and node.name != "__init__":
                    found[node.name] = names.index("code") - (names[0] in {"self", "cls"})
    return found


def literal_codes(trees: list[ast.Module]) -> set[str]:
    """Every code written as a string literal in ``trees`` (see the module docstring)."""
    positions = code_positions(trees)
    found: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                found.update(s for k in node.keywords if k.arg == "code" for s in _strings(k.value))
                index = positions.get(_callee(node))
                if index is not None and index < len(node.args):
                    found.update(_strings(node.args[index]))
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "code":
                        found.update(_strings(value))
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(t, "id", getattr(t, "attr", None)) == "code" for t in targets):
                    found.update(_strings(node.value))
    return found


def broker_trees() -> list[ast.Module]:
    return [
        ast.parse(path.read_text(encoding="utf-8"), str(path))
        for path in sorted(BROKER.rglob("*.py"))
        if not path.is_relative_to(SDK)
    ]


def produced_codes() -> set[str]:
    return {c.value for c in ErrorCode} | literal_codes(broker_trees())


def tabled(text: str) -> set[str]:
    """The codes named, in backticks, in the rows of the page's tables."""
    rows = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    return set(BACKTICKED.findall(rows))


def undocumented(codes: set[str], api_text: str) -> set[str]:
    missing = {c for c in codes if c not in ELSEWHERE and c not in tabled(api_text)}
    for code, (page, words) in ELSEWHERE.items():
        if code in codes and words not in (REPO / page).read_text(encoding="utf-8"):
            missing.add(code)
    return missing


def test_every_error_code_is_in_the_api_reference() -> None:
    missing = undocumented(produced_codes(), API_DOC.read_text(encoding="utf-8"))
    assert missing == set(), f"add a row to docs/api.md's error tables for {sorted(missing)}"


def test_every_literal_code_is_known() -> None:
    """A literal that is neither an ``ErrorCode`` nor named in ``ELSEWHERE`` is a code spelled
    outside the enum: add it to the enum, or say where it is documented."""
    strays = literal_codes(broker_trees()) - {c.value for c in ErrorCode} - set(ELSEWHERE)
    assert strays == set()


def test_the_check_finds_a_missing_row_and_a_new_literal() -> None:
    """The checks can fail: a removed row is reported, and each way of writing a code is seen."""
    text = API_DOC.read_text(encoding="utf-8")
    without = "\n".join(line for line in text.splitlines() if "`rim_invalid`" not in line)
    assert undocumented(produced_codes(), without) == {"rim_invalid"}
    source = """
def refuse(status, code, message): ...
class Refusal:
    def __init__(self, status, code): ...
raise InputError("no", code="new_keyword")
body = {"error": {"code": "new_member" if bad else "new_other"}}
help = {"code": "an error code (e.g. policy_denied)"}
code = "new_assigned"
refuse(400, "new_positional", "no")
Refusal(400, "new_class_positional")
if code == "compared_only": ...
"""
    assert literal_codes([ast.parse(source)]) == {
        "new_keyword",
        "new_member",
        "new_other",
        "new_assigned",
        "new_positional",
        "new_class_positional",
    }
    assert {"new_keyword", "new_member"} <= undocumented(
        {"new_keyword", "new_member", "bad_request"}, text
    )
