"""docs/cli.md, generated from the argument parser: every command, its usage and its options.

Regenerate with ``python -m broker.cli.docs > docs/cli.md``; ``tests/unit/test_cli_docs.py``
fails when the file and the parser differ, so the reference cannot fall behind the commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

HEADER = """# Command line

Back to the [README](../README.md). Generated from the argument parser
(`python -m broker.cli.docs > docs/cli.md`; a test fails when they differ).

Exit codes, for every command: **0** success; **1** the command ran and the answer is "no" (a
log that does not verify, a refused key change, failing policy tests, a proof that does not
check, an inconsistent log for `audit monitor`); **2** bad usage, arguments or configuration
(the message names the argument or the configuration key); **3** `audit monitor` could not
reach the log (nothing was checked). Add `-v` before the command for INFO logs.
"""


# What an argument without its own help means, by its name (the same everywhere).
DEFAULT_HELP = {
    "config": "the broker's configuration file (broker.toml)",
    "name": "a key name, e.g. models/llama",
    "version": "a key version (1, 2, …)",
    "dir": "a policy directory",
    "workspace": "a `broker dev` workspace directory",
    "log": "a decision log file",
    "logs": "decision log files (one per replica)",
    "path": "a decision log file",
    "file": "an encrypted weights file (.brkw), or an encrypted model directory",
    "bundle": "a proof bundle written by `broker audit prove`",
    "source": "input: a file or a directory",
    "target": "output: a file or a directory",
    "output": "the file to write",
    "record": "a decision id, or a log index",
    "uri": "a PKCS#11 URI naming the KEK to create",
    "workers": "parallel encryption workers",
    "segment_size": "plaintext bytes per authenticated segment",
    "table": "a table instead of JSON lines",
    "check": "only check; change nothing",
    "code": "an error code (e.g. policy_denied)",
    "key": "a key name",
    "image": "an image digest (sha256:…)",
    "project": "a Google Cloud project id",
    "replica": "a replica id ([server] replica_id)",
    "rim_root": "the CA that signs NVIDIA's RIMs (PEM)",
    "to": "the KEK URI to wrap every DEK with",
}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...], help_text: str
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    children = _subcommands(parser)
    if not children:
        yield path, help_text, parser
        return
    helps = _helps(parser)
    for name, child in children.items():
        yield from _walk(child, (*path, name), helps.get(name, ""))


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        metavar = action.metavar if isinstance(action.metavar, str) else None
        names = ", ".join(action.option_strings) or metavar or action.dest
        if action.option_strings and action.nargs != 0:
            names += f" {metavar or action.dest.upper()}"
        details = action.help or DEFAULT_HELP.get(action.dest, "")
        if action.required and action.option_strings:
            details = f"required. {details}".strip()
        if action.choices is not None and not isinstance(action.choices, dict):
            details = f"{details} (one of: {', '.join(map(str, action.choices))})".strip()
        rows.append(f"| `{names}` | {details.replace('|', '/')} |")
    return rows


def render(parser: argparse.ArgumentParser) -> str:
    out = [HEADER]
    for path, help_text, command in _walk(parser, ("broker",), ""):
        usage = " ".join(command.format_usage().split())
        out.append(f"## `{' '.join(path)}`\n")
        if help_text:
            out.append(f"{help_text[0].upper()}{help_text[1:]}.\n")
        out.append(f"```\n{usage.removeprefix('usage: ')}\n```\n")
        rows = _option_rows(command)
        if rows:
            out.append("| argument | meaning |\n| --- | --- |\n" + "\n".join(rows) + "\n")
    return "\n".join(out)


def main() -> int:
    from broker.cli.main import _parser  # noqa: PLC0415 - the CLI imports this module's siblings

    print(render(_parser()), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
