"""Every command given a wrong file answers with one line naming the file and what to do, exit 2,
never a Python traceback.

The findings: a torn last record at start-up printed a traceback ending in "record 0";
``broker audit query`` / ``export`` on a file that is not a log printed tracebacks (or, for JSON
that is not a log, nothing at all with exit 0); ``keys restore`` of a file that is not a backup,
``weights inspect`` of a file that is not BRKW1 and ``serve --config`` of a binary file were exit 1
or tracebacks; ``policy check`` of a missing directory printed OPA's two-line loader error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker.cli import weights as cli_weights
from tests.integration.conftest import write_config
from tests.support.cli import run
from tests.support.issuers import dev_issuer

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")


@dataclass(frozen=True)
class Files:
    workspace: Path
    junk: Path  # random bytes
    json_not_log: Path  # JSON lines, but not records
    garbled_toml: Path
    torn_log: Path  # a copy of a real log whose last record was cut by a crash
    torn_workspace: Path  # a workspace whose own log is torn
    empty_dir: Path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    base = tmp_path_factory.mktemp("wrong-files")
    workspace = write_config(base / "ws", dev_issuer()).parent
    torn_workspace = write_config(base / "torn", dev_issuer()).parent
    for name in ("models/a", "models/b", "models/c"):
        created = run(
            "keys", "create", name, "--purpose", "generic", "--config",
            str(torn_workspace / "broker.toml"),
        )  # fmt: skip
        assert created.returncode == 0, created.stderr
    log = torn_workspace / "decisions.log"
    assert log.read_bytes().count(b"\n") == 6  # each change: its intent, then its outcome
    log.write_bytes(log.read_bytes()[:-30])  # a crash in the middle of the sixth record
    torn = base / "torn.log"
    torn.write_bytes(log.read_bytes())
    junk = base / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 8)
    json_not_log = base / "data.json"
    json_not_log.write_text('{"images": {}}\n{"a": 1}\n')
    garbled = base / "garbled.toml"
    garbled.write_text("[server\nlisten = \n")
    empty = base / "empty"
    empty.mkdir()
    return Files(workspace, junk, json_not_log, garbled, torn, torn_workspace, empty)


def config(directory: Path) -> str:
    return str(directory / "broker.toml")


# (command, the path its one line must name, a word of the fix)
Case = tuple[Callable[[Files], list[str]], Callable[[Files], Path], str]
CASES: dict[str, Case] = {
    "serve-missing-config": (lambda f: ["serve", "--config", str(f.empty_dir / "broker.toml")],
                             lambda f: f.empty_dir / "broker.toml", "broker dev init"),
    "serve-garbled-config": (lambda f: ["serve", "--config", str(f.garbled_toml)],
                             lambda f: f.garbled_toml, "docs/configuration.md"),
    "serve-binary-config": (lambda f: ["serve", "--config", str(f.junk)],
                            lambda f: f.junk, "docs/configuration.md"),
    "serve-torn-log": (lambda f: ["serve", "--config", config(f.torn_workspace)],
                       lambda f: f.torn_workspace / "decisions.log", "broker audit repair"),
    "keys-list-garbled-config": (lambda f: ["keys", "list", "--config", str(f.garbled_toml)],
                                 lambda f: f.garbled_toml, "docs/configuration.md"),
    "audit-query-binary": (lambda f: ["audit", "query", str(f.junk)],
                           lambda f: f.junk, "[audit] log"),
    "audit-query-json-not-log": (lambda f: ["audit", "query", str(f.json_not_log)],
                                 lambda f: f.json_not_log, "[audit] log"),
    "audit-query-torn": (lambda f: ["audit", "query", str(f.torn_log)],
                         lambda f: f.torn_log, "broker audit repair"),
    "audit-export-binary": (lambda f: ["audit", "export", str(f.junk)],
                            lambda f: f.junk, "[audit] log"),
    "audit-export-json-not-log": (lambda f: ["audit", "export", str(f.json_not_log)],
                                  lambda f: f.json_not_log, "[audit] log"),
    "audit-verify-json-not-log": (lambda f: ["audit", "verify", str(f.json_not_log)],
                                  lambda f: f.json_not_log, "[audit] log"),
    "keys-restore-binary": (lambda f: ["keys", "restore", "--config", config(f.workspace),
                                       str(f.junk)], lambda f: f.junk, "broker keys backup"),
    "keys-restore-json-not-backup": (lambda f: ["keys", "restore", "--config", config(f.workspace),
                                                str(f.json_not_log)],
                                     lambda f: f.json_not_log, "broker keys backup"),
    "weights-inspect-binary": (lambda f: ["weights", "inspect", str(f.junk)],
                               lambda f: f.junk, "broker weights encrypt"),
    "weights-inspect-dir-without-manifest": (lambda f: ["weights", "inspect", str(f.empty_dir)],
                                             lambda f: f.empty_dir / "manifest.json",
                                             "broker weights encrypt"),
    "policy-check-missing-dir": (lambda f: ["policy", "check", str(f.empty_dir / "policies")],
                                 lambda f: f.empty_dir / "policies", "policy directory"),
    "policy-eval-missing-dir": (lambda f: ["policy", "eval", "--policy",
                                           str(f.empty_dir / "policies"), "--input",
                                           str(f.json_not_log)],
                                lambda f: f.empty_dir / "policies", "policy directory"),
    "weights-encrypt-dir-without-weights": (lambda f: ["weights", "encrypt", str(f.empty_dir),
                                                    str(f.empty_dir / "out"), "--key", "models/a",
                                                    "--config", config(f.workspace)],
                                            lambda f: f.empty_dir, "model directory"),
    "keys-import-not-32-bytes": (lambda f: ["keys", "import", "models/mine", "--purpose",
                                            "generic", "--material-file", str(f.junk), "--config",
                                            config(f.workspace)],
                                 lambda f: f.junk, "32 raw bytes"),
    "audit-prove-binary-log": (lambda f: ["audit", "prove", "--log", str(f.junk), "0"],
                               lambda f: f.junk, "[audit] log"),
    "audit-verify-binary-checkpoint": (lambda f: ["audit", "verify", str(f.torn_log),
                                                  "--checkpoint", str(f.junk), "--key", "k"],
                                       lambda f: f.junk, ".checkpoint"),
    "verify-missing-evidence": (lambda f: ["verify", "nras", str(f.empty_dir / "result.json")],
                                lambda f: f.empty_dir / "result.json", "cannot read"),
    "dev-token-not-a-workspace": (lambda f: ["dev", "token", str(f.empty_dir), "--image",
                                             "sha256:" + "a" * 64, "--nonce", "n"],
                                  lambda f: f.empty_dir / "broker.toml", "broker dev init"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_file_is_one_line_naming_it_with_the_fix_and_exit_2(
    case: str, files: Files
) -> None:
    command, named, fix = CASES[case]
    done = run(*command(files))
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    assert str(named(files)) in lines[0]
    assert fix in lines[0]
    assert done.returncode == 2, done.stderr


def test_a_torn_last_record_names_its_record_number_not_record_0(files: Files) -> None:
    """Six records, the sixth cut: "record 6", at start-up and in ``audit query``."""
    for command in (
        ["serve", "--config", config(files.torn_workspace)],
        ["audit", "query", str(files.torn_log)],
    ):
        done = run(*command)
        assert done.returncode == 2
        assert ": record 6: " in done.stderr, done.stderr
        assert "record 0" not in done.stderr


def test_a_bug_is_one_line_and_its_traceback_only_with_v(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What no user can cause (a bug) is still one line, saying how to get the traceback."""

    def broken(args: object) -> int:
        raise RuntimeError("an internal invariant broke\nsecond line")

    monkeypatch.setattr(cli_weights, "_inspect", broken)
    done = run("weights", "inspect", str(files.junk))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "error: unexpected RuntimeError: an internal invariant broke (a bug; run `broker -v …` "
        "for the traceback and report it)"
    ]
    with pytest.raises(RuntimeError):
        run("-v", "weights", "inspect", str(files.junk))
