"""OPA's messages about a staged copy, told with the user's own file names.

The broker compiles a policy from a private temporary copy (``/tmp/broker-policy-…/policy``,
or ``policy/…`` relative to it); a message naming that copy sends the user to a file that no
longer exists. ``naming_user_files`` rewrites such messages to the directory or bundle given.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from broker.policy.wasm import PolicyLoadError

PREFIX = "config policy: "  # how ConfigError("policy", …) renders


def user_text(text: str, staged: Path, shown: str) -> str:
    """``text`` with the staged copy (absolute, or ``policy/`` relative to its parent) replaced
    by ``shown`` (``DIR`` for a directory, ``BUNDLE:`` for a file inside a bundle)."""
    joiner = "" if shown.endswith(":") else "/"
    text = text.replace(f"{staged}/", shown + joiner).replace(str(staged), shown.rstrip(":"))
    return re.sub(rf"(?<![\w/.-]){re.escape(staged.name)}/", lambda _: shown + joiner, text)


@contextlib.contextmanager
def naming_user_files(staged: Path, shown: str) -> Iterator[None]:
    """Around work on ``staged``: a ``PolicyLoadError`` names ``shown`` instead.

    Raises:
        PolicyLoadError: the same problem, in the user's file names.
    """
    try:
        yield
    except PolicyLoadError as exc:
        problem = str(exc).removeprefix(PREFIX)
        raise PolicyLoadError(user_text(problem, staged, shown)) from exc
