"""``broker policy replay``: logged decisions re-decided with a candidate policy.

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

Decisions made before the policy ran (no input) or that ended in an error are skipped. One JSON
line per changed decision, then a summary; the exit code is 0 even when decisions change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from broker.audit.envelope import Envelope, KeyDecision, RecordError, instant, parse_record
from broker.cli.audit_query import with_segments
from broker.core.errors import ConfigError
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


def replay(
    logs: list[Path], compiled: CompiledPolicy, *, since: datetime | None, key: str | None
) -> int:
    """Print each decision of ``logs`` that ``compiled`` decides otherwise, then the summary.

    Raises:
        ConfigError: a log does not read, or holds a line that is not a record.
    """
    instance = WasmPolicyInstance(compiled)
    summary = dict.fromkeys(SUMMARY, 0)
    for record in _records(logs):
        if record.kind not in DECISION_TYPES:
            continue
        if since is not None and (record.at is None or record.at < since):
            continue
        for decision in record.decisions:  # a release on a result: one decision per key
            if key and decision.key != key:
                continue
            old = _logged(record, decision)
            if old is None or decision.input is None:
                summary["skipped"] += 1  # decided before the policy ran, or no input
                continue
            new = _redecided(record, decision.input, instance, compiled.digest)
            summary["decisions"] += 1
            change = old.change(new)
            summary[change] += 1
            if change != "unchanged":
                print(json.dumps(_changed(record, decision, old, new)))
    print(json.dumps({"summary": summary, "policy_digest": compiled.digest}))
    return 0


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


def _redecided(
    record: Envelope, policy_input: Mapping[str, Any], instance: WasmPolicyInstance, digest: str
) -> Decided:
    decision = Decision.from_result(instance.evaluate(policy_input), digest)
    if record.kind is not RecordType.IDENTITY:
        return Decided(decision.allowed, decision.reasons)
    given = assignment(decision, _trust_domain(record, policy_input))
    return Decided(given.allowed, given.reasons, given.spiffe_id, identity=True)


def _trust_domain(record: Envelope, policy_input: Mapping[str, Any]) -> str:
    """The trust domain the record's certificate was asked in (as written, else its input's)."""
    written = record.body.get("trust_domain")
    if isinstance(written, str):
        return written
    request = policy_input.get("request")
    named = request.get("trust_domain") if isinstance(request, Mapping) else None
    return named if isinstance(named, str) else ""


def _changed(record: Envelope, decision: KeyDecision, old: Decided, new: Decided) -> dict[str, Any]:
    return {
        "type": record.type,
        "decision_id": record.decision_id,
        "time": record.time,
        "key": decision.key,
        "old": old.shown(),
        "new": new.shown(),
    }


def _records(logs: list[Path]) -> Iterator[Envelope]:
    """The records of the logs (each with its closed segments, as ``audit query`` reads them),
    as envelopes; unlike ``audit query`` any JSON-lines file of records is read (a hand-made
    log of decisions to try a policy on)."""
    for log in logs:
        for path in with_segments([log]) or [log]:
            for number, line in enumerate(_read(path).splitlines(), start=1):
                try:
                    yield parse_record(line)
                except RecordError as exc:
                    raise ConfigError("--log", f"{path}:{number}: {exc}") from exc


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError("--log", f"cannot read {path}") from exc


def since_time(text: str) -> datetime:
    """``--since``: an RFC 3339 time with a zone, read as records' times are (an instant).

    Raises:
        ConfigError: not such a time.
    """
    parsed = instant(text)
    if parsed is None:
        raise ConfigError("--since", f"not an RFC 3339 time with a zone (Z or +HH:MM): {text!r}")
    return parsed
