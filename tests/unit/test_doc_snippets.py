"""Issue 28 item 12: every Python snippet in the README and docs/ is a complete program — its
imports present, every name it uses defined, every ``broker`` import real — so a newcomer who
pastes one gets a program, not a ``NameError``. docs/runner.md's snippets are also *run*
(``tests/integration/test_runner_docs.py``); the others are checked statically here: compiled,
``ruff``'s undefined-name and unused-import rules, and each ``from broker… import`` resolved
against the installed package."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = ROOT / ".venv" / "bin" / "ruff"
BLOCK = re.compile(r"^```(?:python|py)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUN_ELSEWHERE = {"docs/runner.md"}  # tests/integration/test_runner_docs.py runs each block
# F821 undefined name, F822 undefined __all__ name, F704 await outside a function, F401 unused
# import, F811 redefinition (ruff reports syntax errors whatever is selected).
RULES = "F821,F822,F704,F401,F811"


def pages() -> list[str]:
    found = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("docs/**/*.md")))]
    found += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "deploy").rglob("*.md"))]
    return [page for page in found if page not in RUN_ELSEWHERE]


def snippets(page: str) -> list[tuple[int, str]]:
    """(line, code) of each python block of ``page``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def problems(where: str, code: str) -> list[str]:
    """What keeps ``code`` from being a complete program (empty: nothing)."""
    try:
        compile(code, where, "exec", dont_inherit=True)  # ``await``/``async with`` at top level
        tree = ast.parse(code)
    except SyntaxError as exc:
        return [f"{where}: {exc.msg} (line {exc.lineno})"]
    linted = subprocess.run(
        [str(RUFF), "check", "--isolated", "--select", RULES, "--output-format", "concise",
         "--stdin-filename", "snippet.py", "-"],
        input=code, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert linted.returncode in (0, 1), linted.stderr  # 2: ruff itself failed
    found = [f"{where}: {line}" for line in linted.stdout.splitlines() if "snippet.py:" in line]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "broker":
            module = importlib.import_module(str(node.module))
            found += [
                f"{where}: {node.module} has no {alias.name}"
                for alias in node.names
                if not hasattr(module, alias.name)
            ]
    return found


def test_the_checker_refuses_a_fragment() -> None:
    """The README's runner snippet as it was: names from nowhere, ``await`` at top level."""
    found = problems("fragment", "client = BrokerClient(url, ssl_context=ctx)\n")
    assert any("F821" in p and "BrokerClient" in p for p in found), found
    found = problems("await", "import asyncio\n\nawait asyncio.sleep(0)\n")
    assert found == ["await: 'await' outside function (line 3)"], found
    found = problems("async", "import asyncio\n\nasync with asyncio.Lock():\n    pass\n")
    assert found == ["async: 'async with' outside async function (line 3)"], found
    assert problems("import", "from broker.client import NoSuchThing\nNoSuchThing()\n") == [
        "import: broker.client has no NoSuchThing"
    ]
    assert problems("complete", "import os\n\nprint(os.sep)\n") == []


@pytest.mark.parametrize("page", pages())
def test_every_python_snippet_is_a_complete_program(page: str) -> None:
    found = [p for line, code in snippets(page) for p in problems(f"{page}:{line}", code)]
    assert found == []
