"""Key administration requests, parsed and checked once for the admin API and the CLI.

Both front ends hand the raw values they received (JSON members, command-line strings) to these
functions and then call the same ``KeyService`` method, which makes the checks that need state
(the key exists, query keys can be published). A refusal therefore reads the same, with the same
stable code, whichever front end it came through; ``tests/integration/test_key_admin_paths.py``
runs every invalid case through both.
"""

from __future__ import annotations

import getpass
import platform
from enum import StrEnum
from typing import TypeVar

from broker.core.errors import InputError
from broker.core.fields import MAX_VERSION
from broker.core.protocol import Algorithm
from broker.keys.service import MAX_KEY_NAME, validate_key_name
from broker.keys.store.base import Purpose

E = TypeVar("E", bound=StrEnum)


def key_name(value: object) -> str:
    """A key name (``models/llama-70b``).

    Raises:
        InputError: ``bad_request`` naming the rule.
    """
    if not isinstance(value, str) or len(value) > MAX_KEY_NAME:
        raise InputError(f"name must be a string of at most {MAX_KEY_NAME} characters")
    return validate_key_name(value)


def purpose(value: object) -> Purpose:
    return _member(Purpose, value, "purpose")


def algorithm(value: object | None) -> Algorithm | None:
    return None if value is None else _member(Algorithm, value, "algorithm")


def version(value: object) -> int:
    """A key version: an integer 1..2^31 (a JSON number; a JSON string is refused).

    Raises:
        InputError: ``bad_request``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_VERSION:
        raise InputError("version must be a positive integer")
    return value


def version_text(text: str) -> int:
    """``version`` from a command-line argument (ASCII decimal digits).

    Raises:
        InputError: ``bad_request``, with ``version``'s message.
    """
    digits = text.isascii() and text.isdigit() and len(text) <= len(str(MAX_VERSION))
    return version(int(text) if digits else None)


def _member(kind: type[E], value: object, field: str) -> E:
    try:
        return kind(str(value))
    except ValueError as exc:
        allowed = ", ".join(member.value for member in kind)
        raise InputError(f"{field} must be one of {allowed}") from exc


def cli_actor() -> str:
    """Who runs a CLI command, for ``who`` in records: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (containers)
        import os  # noqa: PLC0415

        user = f"uid{os.getuid()}"
    return f"{user}@{platform.node()}"
