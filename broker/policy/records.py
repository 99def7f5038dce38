"""The records a policy reload leaves in the decision log, built in one place.

* ``policy_change``: before a policy goes live (and at start-up when the log names another one
  last): old and new digest, revision, source digest, signed, trigger, who, source; for a
  signed bundle its ``version``, ``expires`` and ``bundle_sha256``, and after a deliberate
  rollback through the admin API ``downgrade: {from_version, to_version, reason}``.
* ``policy_reload_failed``: a refused reload: trigger, who, problem, the digest that stays live,
  the worker; for a bundle the refused bytes' ``bundle_sha256`` and the ``active_version``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.core.records import RecordType
from broker.policy import opa_bundle
from broker.policy.freshness import Freshness
from broker.policy.wasm import CompiledPolicy

MAX_PROBLEM_CHARS = 4096


@dataclass
class ReloadOutcome:
    ok: bool
    trigger: str
    time: str
    digest: str
    previous: str | None = None
    changed: bool = False
    problem: str | None = None
    version: int | None = None  # policy_version of the signed bundle in force

    def describe(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "trigger": self.trigger,
            "time": self.time,
            "active_digest": self.digest,
            "previous_digest": self.previous,
            "changed": self.changed,
            "problem": self.problem,
            **({"version": self.version} if self.version is not None else {}),
        }


def change_record(
    old: str | None,
    compiled: CompiledPolicy,
    *,
    time: str,
    trigger: str,
    who: str,
    source: str,
    fresh: Freshness | None = None,
    bundle_sha256: str | None = None,
    downgrade_from: int | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """A ``policy_change`` record for ``compiled`` replacing ``old``."""
    entry: dict[str, Any] = {
        "type": RecordType.POLICY_CHANGE,
        "time": time,
        "old_digest": old,
        "new_digest": compiled.digest,
        "revision": compiled.revision,
        "source_digest": compiled.source_digest,
        "signed": opa_bundle.SIGNATURES in compiled.files,
        "trigger": trigger,
        "who": who,
        "source": source,
    }
    if fresh is not None:
        entry["version"] = fresh.version
        entry["expires"] = fresh.expires_at
        entry["bundle_sha256"] = bundle_sha256
        if downgrade_from is not None:  # through the admin API only
            entry["downgrade"] = {
                "from_version": downgrade_from,
                "to_version": fresh.version,
                "reason": reason or "",
            }
    return entry


def failure_record(
    outcome: ReloadOutcome,
    *,
    who: str,
    source: str,
    worker: int,
    refused: str | None = None,
    active_version: int | None = None,
) -> dict[str, Any]:
    """A ``policy_reload_failed`` record for ``outcome`` (``refused``: the bundle's SHA-256)."""
    return {
        "type": RecordType.POLICY_RELOAD_FAILED,
        "time": outcome.time,
        "trigger": outcome.trigger,
        "who": who,
        "problem": (outcome.problem or "")[:MAX_PROBLEM_CHARS],
        "active_digest": outcome.digest,
        "source": source,
        "worker": worker,
        **({"bundle_sha256": refused} if refused is not None else {}),
        **({"active_version": active_version} if active_version is not None else {}),
    }
