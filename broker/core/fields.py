"""Typed fields of our own request bodies and query strings. Pure; every failure is ``bad_request``.

Shared by the HTTP handlers and the release service, which validates a release body inside its
logged path (so a malformed release is still a decision record).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.core.errors import InputError

MAX_VERSION = 2**31


def string_field(body: Mapping[str, Any], name: str, *, max_chars: int) -> str:
    """A non-empty string of at most ``max_chars`` characters.

    Raises:
        InputError: ``bad_request`` naming the field.
    """
    value = body.get(name)
    if not isinstance(value, str) or not value or len(value) > max_chars:
        raise InputError(f"{name} must be a non-empty string of at most {max_chars} characters")
    return value


def optional_version(body: Mapping[str, Any]) -> int | None:
    """``version``: absent/null, or an integer 1..2^31 (not a bool, not a float).

    Raises:
        InputError: ``bad_request``.
    """
    value = body.get("version")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_VERSION:
        raise InputError("version must be a positive integer")
    return value


def version_query(text: str | None) -> int | None:
    """``?version=N`` from a query string: ASCII digits only, 1..2^31.

    Raises:
        InputError: ``bad_request``.
    """
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 10) or not (
        1 <= int(text) <= MAX_VERSION
    ):
        raise InputError("version must be a positive integer")
    return int(text)
