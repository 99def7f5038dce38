"""The policy engine port and the decision value it returns.

A decision is built deny-by-default: ``allowed`` is true only when the policy's
``data.broker.release.allow`` is the JSON boolean ``true``. Anything else (undefined, a string,
an error) is a deny, or, when the engine cannot answer, an ``UpstreamError`` (503). There is no
``__bool__``: callers must read ``allowed`` on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

MAX_REASONS = 32
MAX_REASON_CHARS = 512


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reasons: tuple[str, ...]
    policy_digest: str
    mask: tuple[str, ...] = ()  # JSON pointers the policy's ``mask`` rule names
    # the identity policy's SPIFFE ID path (data.broker.identity.spiffe_path), when a string
    spiffe_path: str | None = None

    def __bool__(self) -> bool:
        raise TypeError("read Decision.allowed explicitly")

    @classmethod
    def from_result(cls, result: Any, policy_digest: str) -> Decision:
        """Interpret ``data.broker.release`` as evaluated; deny unless ``allow is True``."""
        if not isinstance(result, Mapping):
            return cls(False, ("policy produced no decision for this request",), policy_digest)
        allowed = result.get("allow") is True
        reasons = _reasons(result.get("reasons"))
        if not allowed and not reasons:
            reasons = ("policy did not allow this request",)
        mask = result.get("mask")
        pointers = (
            tuple(sorted(p for p in mask if isinstance(p, str))) if isinstance(mask, list) else ()
        )
        path = result.get("spiffe_path")
        spiffe_path = path if isinstance(path, str) else None
        return cls(allowed, reasons, policy_digest, pointers[:MAX_REASONS], spiffe_path)


def _reasons(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple | set | frozenset):
        return ()
    texts = {item if isinstance(item, str) else json.dumps(item) for item in value}
    return tuple(text[:MAX_REASON_CHARS] for text in sorted(texts)[:MAX_REASONS])


class PolicyEngine(Protocol):
    """Evaluates ``data.broker.release`` for an input document."""

    @property
    def digest(self) -> str:
        """Digest of the policy text and data in force."""
        ...

    async def evaluate(
        self, policy_input: Mapping[str, Any], *, encoded: bytes | None = None
    ) -> Decision:
        """Evaluate; raise ``UpstreamError`` (``policy_unavailable``) if no answer is possible.

        ``encoded``: ``policy_input`` already written as UTF-8 JSON (the release path's
        canonical bytes); an engine may evaluate those bytes instead of writing them again."""
        ...
