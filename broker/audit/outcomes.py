"""What a decision record says happened, read the same way by every feed (issue 27).

A release on an attestation result decides each key on its own; its record's top-level
``result`` is ``allow`` when every key was released, ``partial`` when some were and some were
not, else the worst refusal (``error`` before ``deny``). The feeds (OCSF export, syslog) and
the readers (``broker audit query``) take the outcome from the keys when a record lists them,
so a record written before ``partial`` existed is reported by what it released too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

ALLOW, PARTIAL, DENY, ERROR = "allow", "partial", "deny", "error"
RESULTS = (ALLOW, PARTIAL, DENY, ERROR)


def overall(results: Iterable[str]) -> str:
    """The request's result from its keys' results (at least one)."""
    results = list(results)
    if all(result == ALLOW for result in results):
        return ALLOW
    if ALLOW in results:
        return PARTIAL
    return ERROR if ERROR in results else DENY


def outcome(record: Mapping[str, Any]) -> str | None:
    """A record's result as the feeds report it: from its keys when it lists any (an attested
    release), else its own ``result`` (``None`` for records that decide nothing: changes)."""
    keys = record.get("keys")
    if isinstance(keys, list) and keys and all(isinstance(k, Mapping) for k in keys):
        return overall(str(k.get("result")) for k in keys)
    result = record.get("result")
    return result if isinstance(result, str) else None
