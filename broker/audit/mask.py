"""Masking the policy input before it enters the decision log (as OPA's decision logs do).

Each mask is an RFC 6901 JSON pointer into the input (``/claims/gca/sub``); the value there is
replaced by ``"sha256:<hex>"`` of its canonical JSON, so a reviewer can still match equal values
without reading them, and ``broker policy replay`` sees a value of the same kind (a string).
Masks come from ``[audit] mask`` and from the policy's own ``mask`` rule in package
``broker.release`` (a set of pointers, evaluated with the decision). A pointer that names
nothing is ignored. Tokens, keys and secrets are never in the input to begin with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from broker.audit.log import canonical


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def masked(document: Mapping[str, Any], pointers: Iterable[str]) -> dict[str, Any]:
    """``document`` with the values at ``pointers`` replaced by their digest.

    ``document`` is never changed: the containers on the way to a masked value are copied
    (copy on write), the rest is shared with it — records are serialised, never mutated, so
    sharing is safe and a release without masks copies nothing deep.
    """
    result = dict(document)
    for pointer in sorted(set(pointers)):
        if not isinstance(pointer, str) or not pointer.startswith("/"):
            continue
        tokens = [_unescape(t) for t in pointer[1:].split("/")]
        parent: Any = result
        for token in tokens[:-1]:
            child = _child(parent, token)
            if not isinstance(child, dict | list):
                break
            child = dict(child) if isinstance(child, dict) else list(child)
            _set(parent, token, child)
            parent = child
        else:
            last = tokens[-1]
            if _has(parent, last):
                _set(parent, last, _digest(_child(parent, last)))
    return result


def _has(container: Any, token: str) -> bool:
    if isinstance(container, dict):
        return token in container
    return isinstance(container, list) and token.isdigit() and int(token) < len(container)


def _set(container: Any, token: str, value: Any) -> None:
    if isinstance(container, dict):
        container[token] = value
    else:
        container[int(token)] = value


def _child(value: Any, token: str) -> Any:
    if isinstance(value, dict):
        return value.get(token)
    if isinstance(value, list) and token.isdigit() and int(token) < len(value):
        return value[int(token)]
    return None


def _digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical(value)).hexdigest()
