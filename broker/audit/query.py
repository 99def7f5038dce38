"""Selecting records as ``broker audit query`` does: rows (a release on an attestation result is
one row per key it decided or was asked) and the filters on them. Shared by the CLI
(``cli/audit_query.py``) and the auditor console (``console/``), so both select alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from broker.audit.envelope import Envelope, KeyDecision
from broker.core.records import RecordType


def within(envelope: Envelope, since: datetime | None, until: datetime | None) -> bool:
    """Whether the record's time lies in ``[since, until]``; a record without a readable time
    is in no interval (but in the whole log)."""
    if since is None and until is None:
        return True
    when = envelope.at
    if when is None:
        return False
    return not ((since is not None and when < since) or (until is not None and when > until))


@dataclass(frozen=True)
class Row:
    """One row of ``audit query``: a record, and the key the row is about (a release's key, one
    key of a release on a result; None for a record that names none per key)."""

    record: Envelope
    key: KeyDecision | None

    @property
    def result(self) -> str | None:
        return self.record.result if self.key is None else self.key.result

    def as_json(self) -> dict[str, Any]:
        """A release on a result: the request's members and this key's; every other record as
        written. Without the (masked) policy input either way."""
        record = self.record
        if record.kind is not RecordType.ATTESTED_RELEASE or self.key is None:
            return {k: v for k, v in record.body.items() if k != "input"}
        attestation = record.attestation
        key = self.key
        own = (
            {"reasons": list(key.reasons), "policy_digest": key.policy_digest}
            if key.decided
            else {"message": key.message}  # refused before it was decided: the request's
        )
        return {
            **{k: record.body.get(k) for k in ("type", "index", "seq", "time", "decision_id")},
            "replica": record.replica,
            "attestation": None if attestation is None else attestation.jti,
            "attestation_log_index": None if attestation is None else attestation.log_index,
            "dpop_jti": record.body.get("dpop_jti"),
            "identity": record.body.get("identity"),
            "release_result": record.result,  # the request's: partial when some keys were
            "key": key.key,
            "version": key.version,
            "result": key.result,
            "code": key.code,
            **own,
        }


def rows(envelope: Envelope) -> Iterator[Row]:
    """A record as query rows: a release is one row per key it decided or was asked (a release
    on an attestation result refused before any key named: one row, without a key); every other
    record is one row."""
    decisions = envelope.decisions if envelope.kind is RecordType.ATTESTED_RELEASE else ()
    for key in decisions or (envelope.keys[0] if envelope.keys else None,):
        yield Row(envelope, key)


@dataclass(frozen=True)
class Filters:
    """What ``audit query`` selects rows by (``None``: any); the console filters with it too."""

    key: str | None = None
    code: str | None = None
    image: str | None = None
    project: str | None = None
    decision: str | None = None
    replica: str | None = None
    who: str | None = None
    result: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    @classmethod
    def from_args(cls, args: Any) -> Filters:
        """From parsed arguments (``argparse.Namespace``) that name every field."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def matches(self, row: Row) -> bool:
        """Whether the row passes every filter (a key's row: its own key and code; a key's row
        of a partial release passes ``result`` by its own result or the request's)."""
        record, key = row.record, row.key
        if self.result is not None and self.result not in (row.result, record.result):
            return False
        checks = [
            (self.key, record.key if key is None else key.key),
            (self.code, record.code if key is None else key.code),
            (self.image, record.identity.get("image_digest")),
            (self.project, record.identity.get("project_id")),
            (self.decision, record.decision_id),
            (self.replica, record.replica),
            (self.who, record.who),
        ]
        if any(wanted is not None and wanted != found for wanted, found in checks):
            return False
        return within(record, self.since, self.until)
