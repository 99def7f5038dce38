"""Builtins OPA's Wasm target leaves to the host, besides ``sprintf`` (``sprintf.py``).

``json.patch`` (RFC 6902: add, remove, replace, move, copy, test), as OPA's topdown applies it:
a patch that cannot apply (a missing path for remove/replace, a failed test) makes the call
undefined, which the Wasm engine turns into a failed evaluation (fail closed). Used by Rego unit
tests (``broker policy test`` runs them through this engine) and available to policies.
"""

from __future__ import annotations

import copy
from typing import Any

from broker.policy.rego_values import RegoNumber, RegoObject, RegoSet


class PatchFailed(ValueError):
    """The patch cannot apply: the builtin is undefined for these operands."""


def to_json(value: Any) -> Any:
    """A parsed Rego value as plain JSON (numbers keep their exactness; sets become arrays)."""
    if isinstance(value, RegoNumber):
        text = value.text
        return int(text) if text.lstrip("-").isdigit() else float(text)
    if isinstance(value, RegoObject):
        return {str(to_json(k)): to_json(v) for k, v in value.pairs}
    if isinstance(value, RegoSet):
        return [to_json(v) for v in value.items]
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def json_patch(args: list[Any]) -> Any:
    document, patches = (to_json(a) for a in args)
    if not isinstance(patches, list):
        raise PatchFailed("patches must be an array")
    result = copy.deepcopy(document)
    for patch in patches:
        if not isinstance(patch, dict) or not isinstance(patch.get("path"), str):
            raise PatchFailed("each patch needs op and path")
        result = _apply(result, patch)
    return result


def _tokens(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchFailed(f"not a JSON pointer: {pointer!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _apply(document: Any, patch: dict[str, Any]) -> Any:
    op, path = patch.get("op"), _tokens(patch["path"])
    if op == "add":
        return _add(document, path, copy.deepcopy(patch.get("value")))
    if op == "remove":
        return _remove(document, path)[0]
    if op == "replace":
        return _add(_remove(document, path)[0], path, copy.deepcopy(patch.get("value")))
    if op in ("move", "copy"):
        source = _tokens(str(patch.get("from", "")))
        value = _get(document, source)
        if op == "move":
            document = _remove(document, source)[0]
        return _add(document, path, copy.deepcopy(value))
    if op == "test":
        if _get(document, path) != patch.get("value"):
            raise PatchFailed("test failed")
        return document
    raise PatchFailed(f"unknown op {op!r}")


def _get(document: Any, path: list[str]) -> Any:
    node = document
    for token in path:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise PatchFailed(f"no value at /{'/'.join(path)}")
    return node


def _add(document: Any, path: list[str], value: Any) -> Any:
    if not path:
        return value
    parent = _get(document, path[:-1])
    last = path[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise PatchFailed(f"bad array index {last!r}")
    else:
        raise PatchFailed("cannot add below a scalar")
    return document


def _remove(document: Any, path: list[str]) -> tuple[Any, Any]:
    if not path:
        raise PatchFailed("cannot remove the whole document")
    parent = _get(document, path[:-1])
    last = path[-1]
    if isinstance(parent, dict) and last in parent:
        return document, parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return document, parent.pop(int(last))
    raise PatchFailed(f"no value at /{'/'.join(path)}")
