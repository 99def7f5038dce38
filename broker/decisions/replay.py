"""Logged decisions re-decided with a candidate policy, compared with what was decided: the
comparison ``broker policy replay`` prints and the console's policy page shows.

Each decision a record holds is decided again, on the masked input stored with it, by the
candidate's compiled policy in the broker's own engine (OPA's Wasm, in process), and compared
with what the record says was decided:

* ``release`` and each key of an ``attested_release``: the release policy;
* ``attestation``: the attestation policy (its input names it: ``request.kind``);
* ``identity`` (a workload certificate): the identity policy, read as ``POST /v1/identity``
  reads it (``policy/identity.py``): a SPIFFE ID in the record's trust domain, or none. Its
  decision is the policy's: the record's ``spiffe_id`` is the ID the policy gave (also when the
  CSR then asked for another and was refused, a refusal that is not the policy's); a changed ID
  is a changed decision.

Decisions made before the policy ran (no input) or that ended in an error are skipped. Pure
but for the engine: records in, changes and counts out; the callers read the records (files,
or the console's window of the log) and show the result. Blocking (the engine): a thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker.audit.envelope import Envelope, KeyDecision
from broker.core.records import DECISION_TYPES, RecordType
from broker.policy.engine import Decision
from broker.policy.identity import assignment
from broker.policy.wasm import CompiledPolicy, WasmPolicyInstance

# the summary's counters, in the order printed: each re-decided decision counts in ``decisions``
# and in exactly one of the next five; ``skipped`` counts those that could not be re-decided
SUMMARY = (
    "decisions",
    "unchanged",
    "allow_to_deny",
    "deny_to_allow",
    "spiffe_id_changed",
    "reasons_changed",
    "skipped",
)


@dataclass(frozen=True)
class Decided:
    """One side of a comparison: allowed or not, why, and (identity) the SPIFFE ID given."""

    allow: bool
    reasons: tuple[str, ...]
    spiffe_id: str | None = None
    identity: bool = False  # an identity decision: ``spiffe_id`` is part of it

    def shown(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"allow": self.allow, "reasons": list(self.reasons)}
        if self.identity:
            shown["spiffe_id"] = self.spiffe_id
        return shown

    def change(self, new: Decided) -> str:
        """The summary counter ``new`` falls under, compared with this (the logged) decision."""
        if new.allow != self.allow:
            return "allow_to_deny" if self.allow else "deny_to_allow"
        if new.spiffe_id != self.spiffe_id:
            return "spiffe_id_changed"
        return "unchanged" if new.reasons == self.reasons else "reasons_changed"


@dataclass(frozen=True)
class Changed:
    """A logged decision the candidate decides otherwise."""

    record: Envelope
    decision: KeyDecision
    old: Decided
    new: Decided
    change: str  # its summary counter

    def as_json(self) -> dict[str, Any]:
        return {
            "type": self.record.type,
            "decision_id": self.record.decision_id,
            "time": self.record.time,
            "key": self.decision.key,
            "old": self.old.shown(),
            "new": self.new.shown(),
        }


class Replay:
    """One candidate policy, re-deciding the records it is given; ``summary`` counts them."""

    def __init__(self, compiled: CompiledPolicy, *, failures: int = logging.ERROR) -> None:
        """``failures``: the level the candidate's evaluation failures are logged at
        (``WasmPolicyInstance``)."""
        self.digest = compiled.digest
        self._instance = WasmPolicyInstance(compiled, failures=failures)
        self.summary = dict.fromkeys(SUMMARY, 0)

    def changes(
        self, record: Envelope, *, since: datetime | None = None, key: str | None = None
    ) -> Iterator[Changed]:
        """Each decision of ``record`` (at or after ``since``, about ``key``, when given) that
        the candidate decides otherwise; every decision looked at is counted."""
        if record.kind not in DECISION_TYPES:
            return
        if since is not None and (record.at is None or record.at < since):
            return
        for decision in record.decisions:  # a release on a result: one decision per key
            if key and decision.key != key:
                continue
            old = _logged(record, decision)
            if old is None or decision.input is None:
                self.summary["skipped"] += 1  # decided before the policy ran, or no input
                continue
            new = self._redecided(record, decision.input)
            self.summary["decisions"] += 1
            change = old.change(new)
            self.summary[change] += 1
            if change != "unchanged":
                yield Changed(record, decision, old, new, change)

    def _redecided(self, record: Envelope, policy_input: Mapping[str, Any]) -> Decided:
        decision = Decision.from_result(self._instance.evaluate(policy_input), self.digest)
        if record.kind is not RecordType.IDENTITY:
            return Decided(decision.allowed, decision.reasons)
        given = assignment(decision, _trust_domain(record, policy_input))
        return Decided(given.allowed, given.reasons, given.spiffe_id, identity=True)


def _logged(record: Envelope, decision: KeyDecision) -> Decided | None:
    """What the record says was decided; None when the policy's answer is not in it."""
    if decision.result not in ("allow", "deny"):
        return None
    reasons = tuple(sorted(decision.reasons))
    if record.kind is RecordType.IDENTITY:
        given = record.body.get("spiffe_id")  # set once the policy gave a valid SPIFFE ID
        named = given if isinstance(given, str) else None
        return Decided(named is not None, reasons, named, identity=True)
    return Decided(decision.result == "allow", reasons)


def _trust_domain(record: Envelope, policy_input: Mapping[str, Any]) -> str:
    """The trust domain the record's certificate was asked in (as written, else its input's)."""
    written = record.body.get("trust_domain")
    if isinstance(written, str):
        return written
    request = policy_input.get("request")
    named = request.get("trust_domain") if isinstance(request, Mapping) else None
    return named if isinstance(named, str) else ""
