"""``broker …`` commands run in this process: ``cli.main(argv)`` with its own stdout, stderr and
environment, answering like the subprocess did (exit code, output text).

Starting ``python -m broker.cli`` costs about a second of imports per command; in process the
same parser, the same handlers and the same exit codes run. Tests that exercise the executable
itself (``serve``, signals, the console script) still start real subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

from blockbuster import BlockBuster

from broker.cli import main as cli

# The blocking-call detectors of running tests (tests/integration/conftest.py registers its own).
# A command is a synchronous program whose event loop is its own (``asyncio.run`` in ``main``):
# in its own process nothing else shares that loop, so in process the detector is paused for it.
DETECTORS: list[BlockBuster] = []


@dataclass(frozen=True)
class Ran:
    """What a finished command left: like ``subprocess.CompletedProcess``."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _logs_to(stream: io.StringIO) -> Iterator[None]:
    """The command's log records go to its stderr, as in its own process (where
    ``logging.basicConfig`` writes them to stderr); pytest's capture handlers stay as they are."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


@contextlib.contextmanager
def _detectors_paused() -> Iterator[None]:
    paused = list(DETECTORS)
    for detector in paused:
        detector.deactivate()
    try:
        yield
    finally:
        for detector in paused:
            detector.activate()


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Ran:
    """``broker ARGS`` in process. ``timeout`` is accepted for the subprocess form's callers;
    the test's own timeout (pytest-timeout) bounds the run."""
    del timeout
    out, err = io.StringIO(), io.StringIO()
    level = logging.getLogger().level
    with (
        _detectors_paused(),
        mock.patch.dict(os.environ, env or {}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _logs_to(err),
    ):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            logging.getLogger().setLevel(level)
    return Ran(args=args, returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
