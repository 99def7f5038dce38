"""JSON from untrusted bytes: strict RFC 8259, bounded in nesting depth.

``json.loads`` recurses per nesting level: a body of ``[[[[…`` reaches ``RecursionError`` (a
500 before this module existed) and, just below the limit, every later walk over the value
(canonical dumps, policy input) recurses too. Every parser of attacker-controlled JSON goes
through ``loads_bounded``, which turns both into ``ValueError``.

Two more departures of Python's parser from RFC 8259 are refused here: ``NaN``/``Infinity``
literals (not JSON; our canonical form cannot write them back, so a record could not be
logged), and duplicate member names (two parsers may pick different values: a classic
parser-differential; RFC 8259 §4 leaves it undefined, RFC 7493 I-JSON forbids it).
"""

from __future__ import annotations

import json
import math
from typing import Any

# Deepest legitimate document: NRAS results (list > object > object > list) and policy
# input (~6 levels). 64 leaves ample room and stays far from the interpreter's limit.
MAX_JSON_DEPTH = 64


def loads_bounded(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON and refuse documents nested deeper than ``max_depth``.

    Raises:
        ValueError: not JSON, not UTF-8, or nested too deeply.
    """
    try:
        # RFC 8259 §8.1: UTF-8 only. json.loads(bytes) would also guess UTF-16/32 from the
        # first bytes; decoding first refuses them (and a BOM then fails the parse).
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_members,
        )
    except RecursionError as exc:
        raise ValueError("JSON is nested too deeply") from exc
    except UnicodeDecodeError as exc:
        raise ValueError("JSON is not UTF-8") from exc
    # Each container opens with a bracket, so a text with at most max_depth of them (inside
    # strings or not) cannot nest deeper: the walk is needed only for bracket-rich documents.
    if _brackets(text) > max_depth and not depth_within(value, max_depth):
        raise ValueError(f"JSON is nested deeper than {max_depth} levels")
    return value


def _brackets(text: str) -> int:
    return text.count("{") + text.count("[")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    """A number too large for a float (``1e999``) would become ``inf``, which no JSON encoder
    writes back (the record of the request could not be encoded): refused as out of range."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("a JSON number is out of range")
    return value


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("JSON object has duplicate member names")
    return result


def depth_within(value: Any, max_depth: int) -> bool:
    """Whether ``value``'s containers nest at most ``max_depth`` deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True
