"""An owed revocation record as an owed-record pass writes it (``decisions/results.py``),
rebuilt from checked fields: never appended as the store holds it.

The store entry keeps the ``attestation_revoked`` record its revoker made (``stored.py``,
``pending_record``) until it is written. Whoever can write the shared store (the operator, whom
the sealed broker trusts for a result's status only) could put anything there: another record
type (a forged ``key_admin`` or ``policy_change``), or a value no log line can hold. So the
record written is built here, field by field, from what a revoker writes: ``type``
``attestation_revoked``, the entry's own ``jti``, ``time`` (an ISO 8601 instant), ``who`` and
``reason`` (bounded strings), and the facts a re-decision or the OCSP sweep adds; anything else
and the record says only that the store held it in an unexpected form (logged at error). Its
``who``, ``time``, ``reason`` and facts are the store's word, marked ``written_late``
(docs/audit.md).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from broker.attestation.stored import MAX_REASON_CHARS, AttestationEntry
from broker.core.encoding import canonical
from broker.core.records import RecordType

log = logging.getLogger(__name__)
MAX_WHO_CHARS = 256  # an admin's ``token:<12 hex>``, a CLI's ``user@host``, ``ocsp``, ``broker``
MAX_FACT_CHARS = 1024  # one fact string: a trigger, a policy digest, a policy reason, gpu:<ueid>
MAX_FACT_ITEMS = 64  # one list fact: a policy's reasons, the devices and RIMs OCSP revoked
MAX_RECORD_BYTES = 16 * 1024  # the whole record, encoded
# The facts a revoker adds (``results.py``): a re-decision's ``trigger``, ``policy_digest`` and
# ``reasons``; the OCSP sweep's ``revoked``. Each a string (str) or a list of strings (list).
FACTS: dict[str, type] = {"trigger": str, "policy_digest": str, "reasons": list, "revoked": list}
UNEXPECTED = "a revocation whose record the store held in an unexpected form"


def late_record(entry: AttestationEntry, now: datetime) -> dict[str, Any]:
    """The owed record as a pass writes it at ``now``: its revoker's record (who, when, why)
    rebuilt from checked fields, marked ``written_late`` with ``written_at``. An entry owed by a
    broker that did not keep the record says only its reason: ``who`` is then ``broker`` and
    ``trigger`` ``record``. A record held in an unexpected form is written as the minimal one:
    the entry's ``jti``, ``time`` now, ``who`` ``broker`` and ``reason`` ``UNEXPECTED``."""
    late = {"written_late": True, "written_at": now.isoformat()}
    if entry.pending_record is None:
        return {
            "type": RecordType.ATTESTATION_REVOKED,
            "jti": entry.jti,
            "time": now.isoformat(),
            "who": "broker",
            "reason": entry.reason,  # checked when the entry was parsed (``from_json``)
            "trigger": "record",
            **late,
        }
    try:
        return {**_rebuilt(entry.pending_record, entry.jti), **late}
    except (TypeError, ValueError) as exc:
        log.error(  # noqa: TRY400 - the store's content, not a bug: no traceback
            "the revocation record owed for %s is in an unexpected form (%s); a minimal "
            "record is written instead",
            entry.jti,
            exc,
        )
    return {
        "type": RecordType.ATTESTATION_REVOKED,
        "jti": entry.jti,
        "time": now.isoformat(),
        "who": "broker",
        "reason": UNEXPECTED,
        **late,
    }


def _rebuilt(held: Any, jti: str) -> dict[str, Any]:
    """The record ``held`` (the store's ``pending_record``) says, made of checked fields only.

    Raises:
        TypeError, ValueError: naming the first member in an unexpected form.
    """
    if not isinstance(held, dict):
        raise TypeError("not an object")
    unknown = set(held) - {"type", "jti", "time", "who", "reason", *FACTS}
    if unknown:
        raise ValueError(f"unexpected members {sorted(map(str, unknown))[:8]}")
    if held.get("type") != RecordType.ATTESTATION_REVOKED:
        raise ValueError("type is not attestation_revoked")
    if held.get("jti") != jti:
        raise ValueError("jti is not the entry's")
    record: dict[str, Any] = {
        "type": RecordType.ATTESTATION_REVOKED,
        "jti": jti,
        "time": _instant(held.get("time")),
        "who": _text(held.get("who"), "who", MAX_WHO_CHARS, printable=True),
        "reason": _text(held.get("reason"), "reason", MAX_REASON_CHARS),
    }
    for name, kind in FACTS.items():
        if name not in held:
            continue
        value = held[name]
        if kind is str:
            record[name] = _text(value, name, MAX_FACT_CHARS)
        elif not isinstance(value, list) or len(value) > MAX_FACT_ITEMS:
            raise ValueError(f"{name} is not a list of at most {MAX_FACT_ITEMS} strings")
        else:
            record[name] = [_text(item, name, MAX_FACT_CHARS) for item in value]
    if len(canonical(record)) > MAX_RECORD_BYTES:
        raise ValueError(f"longer than {MAX_RECORD_BYTES} bytes")
    return record


def _text(value: Any, name: str, limit: int, *, printable: bool = False) -> str:
    if not isinstance(value, str) or len(value) > limit or (printable and not value.isprintable()):
        quality = "printable " if printable else ""
        raise ValueError(f"{name} is not a {quality}string of at most {limit} characters")
    if printable and not value:
        raise ValueError(f"{name} is empty")
    return value


def _instant(value: Any) -> str:
    """An ISO 8601 instant (with its offset), written as ``datetime.isoformat`` writes it."""
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError("time is not an ISO 8601 instant")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise ValueError("time is not an ISO 8601 instant") from exc
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError("time has no offset")
    return moment.isoformat()
