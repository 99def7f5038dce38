"""The decision log's record vocabulary, for every writer: the record types and the head a
decision record starts with (``audit/envelope.py`` reads records back into the same members).

In ``core`` because writers sit in several layers and packages (the decision kernel, the key
service, the policy manager, the log itself), and a domain package may not import another.
``RecordType`` members are strings, so a record written with them is byte for byte the record
written with their values.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any


class RecordType(StrEnum):
    """Every record type the broker writes (``tests/integration/test_audit_feeds.py`` lists the
    writers' types from the source and checks this set covers them)."""

    RELEASE = "release"
    ATTESTED_RELEASE = "attested_release"
    ATTESTATION = "attestation"
    ATTESTATION_REVOKED = "attestation_revoked"
    IDENTITY = "identity"  # a workload certificate (X.509-SVID) on an attestation result
    IDENTITY_CA = "identity_ca"  # the workload-certificate CA in force changed (a rotation)
    # the KBS protocol facade (docs/kbs.md): a guest's handshake, its attestation (a result
    # bound to its tee-pubkey), and a resource released to it
    KBS_AUTH = "kbs_auth"
    KBS_ATTEST = "kbs_attest"
    KBS_RESOURCE = "kbs_resource"
    POLICY_CHANGE = "policy_change"
    POLICY_RELOAD_FAILED = "policy_reload_failed"
    KEY_ADMIN = "key_admin"
    LOG_REPAIR = "log_repair"
    LOG_KEY_ROTATION = "log_key_rotation"
    UNKNOWN = "unknown"  # a type this version does not know (a newer broker's log)


class ChangeResult(StrEnum):
    """``result`` of a key change's outcome record (``keys/changes.py``): the change was made,
    was not made, or may have been (the store could not be read back). A change's intent record
    has no ``result``; an intent without an outcome is unknown too (the store says)."""

    OK = "ok"
    ERROR = "error"
    UNKNOWN = "unknown"


# ``phase`` of a key change's intent record (written before the store is touched); intents in
# logs older than the marker carry no ``phase``
CHANGE_INTENT = "intent"


KNOWN_TYPES = frozenset(t.value for t in RecordType if t is not RecordType.UNKNOWN)
# records of a policy decision (``broker policy replay`` re-decides them)
DECISION_TYPES = frozenset(
    {
        RecordType.RELEASE,
        RecordType.ATTESTED_RELEASE,
        RecordType.ATTESTATION,
        RecordType.IDENTITY,
        RecordType.KBS_ATTEST,
        RecordType.KBS_RESOURCE,
    }
)


def record_head(
    kind: str,
    *,
    decision_id: str,
    request_id: str,
    time: datetime,
    result: str,
    code: str | None,
    message: str | None,
) -> dict[str, Any]:
    """The envelope members a decision record starts with, as the writers write them (the
    decision kernel adds the plan's body; its minimal record drops ``message``).
    ``parse_record`` reads each back into the member of the same name."""
    return {
        "type": kind,
        "decision_id": decision_id,
        "request_id": request_id,
        "time": time.isoformat(),
        "result": result,
        "code": code,
        "message": message,
    }
