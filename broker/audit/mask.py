"""Masking the policy input before it enters the decision log (as OPA's decision logs do).

Each mask is an RFC 6901 JSON pointer into the input (``/claims/gca/sub``); the value there is
replaced by ``"sha256:<hex>"`` of its canonical JSON, so a reviewer can still match equal values
without reading them, and ``broker policy replay`` sees a value of the same kind (a string).
Masks come from ``[audit] mask`` and from the policy's own ``mask`` rule in package
``broker.release`` (a set of pointers, evaluated with the decision). A pointer that names
nothing is ignored. Tokens, keys and secrets are never in the input to begin with.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from broker.audit.log import canonical


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def masked(document: Mapping[str, Any], pointers: Iterable[str]) -> dict[str, Any]:
    """A deep copy of ``document`` with the values at ``pointers`` replaced by their digest."""
    result = copy.deepcopy(dict(document))
    for pointer in sorted(set(pointers)):
        if not isinstance(pointer, str) or not pointer.startswith("/"):
            continue
        tokens = [_unescape(t) for t in pointer[1:].split("/")]
        parent: Any = result
        for token in tokens[:-1]:
            parent = _child(parent, token)
            if parent is None:
                break
        else:
            last = tokens[-1]
            if isinstance(parent, dict) and last in parent:
                parent[last] = _digest(parent[last])
            elif isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
                parent[int(last)] = _digest(parent[int(last)])
    return result


def _child(value: Any, token: str) -> Any:
    if isinstance(value, dict):
        return value.get(token)
    if isinstance(value, list) and token.isdigit() and int(token) < len(value):
        return value[int(token)]
    return None


def _digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical(value)).hexdigest()
