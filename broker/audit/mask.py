"""Masking the policy input before it enters the decision log (as OPA's decision logs do).

Each mask is an RFC 6901 JSON pointer into the input (``/claims/gca/sub``); the value there is
replaced by ``"hmac-sha256:<hex>"``, an HMAC-SHA-256 of its canonical JSON under the log's mask
key (``[audit] mask_key``), so a reviewer can still match equal values without reading them and
``broker policy replay`` sees a value of the same kind (a string). A plain hash would not do: a
low-entropy value (an e-mail ``sub``, a project id) is confirmed by hashing guesses. Only who
holds the key can check a guess (``broker audit mask VALUE``), as with Vault's audit devices.

Masks come from ``[audit] mask`` and from the policy's own ``mask`` rule in package
``broker.release`` (a set of pointers, evaluated with the decision). A pointer that names
nothing is ignored. Tokens, keys and secrets are never in the input to begin with.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from broker.core.encoding import canonical
from broker.core.secrets_files import load_or_create_secret

PREFIX = "hmac-sha256:"


def load_or_create_mask_key(path: Path) -> bytes:
    """The mask key in ``path``; created (32 random bytes, mode 0600) if absent.

    Raises:
        ConfigError: ``audit.mask_key`` when the file cannot be read or is not 32 bytes.
    """
    return load_or_create_secret(path, "audit.mask_key")


def mask_value(value: Any, key: bytes) -> str:
    """What a masked value reads as in a record: ``hmac-sha256:`` + HMAC of its canonical JSON."""
    return PREFIX + hmac.new(key, canonical(value), hashlib.sha256).hexdigest()


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def masked(document: Mapping[str, Any], pointers: Iterable[str], key: bytes) -> dict[str, Any]:
    """``document`` with the values at ``pointers`` replaced by their keyed digest.

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
                _set(parent, last, mask_value(_child(parent, last), key))
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
