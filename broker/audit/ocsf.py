"""Decision records as OCSF 1.1 events ("API Activity", class 6003) for a SIEM (issue 27).

Every record type the broker writes has a mapping here (``MAPPINGS``); a test lists the types
the writers write and checks each one's events field by field (docs/audit.md has the table).
A release on an attestation result becomes one event per key asked (its key, version, kid,
status and reasons), each naming the attestation (``actor.session.uid``) and the workload it
attested (``actor.user``); a request refused before any key was decided is one event per key
it asked for, with the request's code.

Pure: a record (a dict read from the log) in, a list of events out; nothing is fetched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from broker.audit.outcomes import ALLOW, DENY, ERROR, PARTIAL, outcome

CLASS_UID = 6003  # API Activity (Application Activity category)
CATEGORY_UID = 6
PRODUCT = {"name": "sealed-runner key broker", "vendor_name": "sealed-runner"}
OCSF_VERSION = "1.1.0"
# activity_id: 1 Create, 2 Read, 3 Update, 4 Delete, 99 Other
CREATE, READ, UPDATE, DELETE, OTHER = 1, 2, 3, 4, 99
# status_id: 0 Unknown, 1 Success, 2 Failure, 99 Other (a partial release, when not per key)
STATUS = {ALLOW: 1, DENY: 2, ERROR: 2, PARTIAL: 99}
STATUS_NAMES = {0: "Unknown", 1: "Success", 2: "Failure", 99: "Other"}
# severity_id: 1 Informational, 2 Low, 3 Medium, 4 High
SEVERITY = {ALLOW: 1, PARTIAL: 2, DENY: 3, ERROR: 4}
KEY_ACTIVITIES = {
    "create": CREATE,
    "rotate": CREATE,  # a new version
    "import": CREATE,
    "restore": CREATE,
    "enable": UPDATE,
    "disable": UPDATE,
    "rewrap": UPDATE,
    "migrate-store": UPDATE,
    "destroy": DELETE,
    "backup": READ,
    "weights-encrypt": READ,
    "weights-decrypt": READ,
}

Event = dict[str, Any]


def ocsf_events(record: Mapping[str, Any]) -> list[Event]:
    """The OCSF events of one record (one, or one per key for a release on a result)."""
    kind = str(record.get("type", "release"))
    mapping = MAPPINGS.get(kind, _other)
    return mapping(record)


def _event(
    record: Mapping[str, Any],
    *,
    activity: int,
    result: str | None,
    resources: list[dict[str, Any]],
    actor: dict[str, Any],
    code: Any = None,
    message: Any = None,
    uid_suffix: str = "",
    unmapped: Mapping[str, Any] | None = None,
) -> Event:
    """The fields every event has, from the record's envelope (time, index, replica, hash)."""
    status_id = STATUS.get(str(result), 0) if result is not None else 1
    decision = record.get("decision_id") or record.get("jti")
    return {
        "class_uid": CLASS_UID,
        "category_uid": CATEGORY_UID,
        "activity_id": activity,
        "type_uid": CLASS_UID * 100 + activity,
        "time": _epoch_ms(record.get("time")),
        "severity_id": SEVERITY.get(str(result), 1) if result is not None else 1,
        "status_id": status_id,
        "status": STATUS_NAMES[status_id],
        "status_code": code,
        "message": message,
        "api": {
            "operation": str(record.get("type", "release")),
            "request": {"uid": record.get("request_id")},
        },
        "actor": actor,
        "resources": resources,
        "metadata": {
            "product": PRODUCT,
            "version": OCSF_VERSION,
            "uid": None if decision is None else f"{decision}{uid_suffix}",
            "correlation_uid": decision,
            "sequence": record.get("index", record.get("seq")),
            "log_name": record.get("replica"),
        },
        "unmapped": {
            "result": record.get("result"),
            "policy_digest": record.get("policy_digest"),
            "hash": record.get("hash"),
            **(unmapped or {}),
        },
    }


def _epoch_ms(when: Any) -> int:
    try:
        return int(datetime.fromisoformat(str(when)).timestamp() * 1000)
    except (ValueError, OverflowError):
        return 0


def _message(reasons: Any, *others: Any) -> str | None:
    text = "; ".join(str(r) for r in reasons) if isinstance(reasons, list) else ""
    return text or next((str(o) for o in others if o), None)


def _runner(identity: Any, session: Any = None) -> dict[str, Any]:
    identity = identity if isinstance(identity, Mapping) else {}
    actor: dict[str, Any] = {
        "user": {"uid": identity.get("sub"), "name": identity.get("image_digest")},
    }
    if identity.get("project_id") is not None or identity.get("instance_id") is not None:
        actor["user"]["account"] = {"uid": identity.get("project_id")}
        actor["device"] = {"uid": identity.get("instance_id")}
    if session is not None:
        actor["session"] = {"uid": session}
    return actor


def _who(record: Mapping[str, Any]) -> dict[str, Any]:
    who = record.get("who")  # changes say who made them (admin token id, user@host, broker)
    return {"user": {"uid": who, "name": who}}


def _keys(name: Any, version: Any, kid: Any = None) -> list[dict[str, Any]]:
    """The key a record names as a resource; none when it names none (a request refused
    before its key could be read)."""
    if name is None:
        return []
    return [
        {
            "type": "key",
            "name": name,
            "version": None if version is None else str(version),
            "uid": kid,
        }
    ]


def _release(record: Mapping[str, Any]) -> list[Event]:
    result = outcome(record)
    return [
        _event(
            record,
            activity=READ,
            result=result,
            resources=_keys(record.get("key"), record.get("version"), record.get("kid")),
            actor=_runner(record.get("identity")),
            code=record.get("code"),
            message=_message(record.get("reasons"), record.get("message")),
            unmapped={"input_digest": record.get("input_digest")},
        )
    ]


def _attested_release(record: Mapping[str, Any]) -> list[Event]:
    """One event per key: decided keys with their own result, else the keys asked with the
    request's; a request that named no key is one event without resources."""
    attestation = record.get("attestation")
    attestation = attestation if isinstance(attestation, Mapping) else {}
    actor = _runner(record.get("identity"), attestation.get("jti"))
    common = {
        "attestation_log_index": attestation.get("log_index"),
        "dpop_jti": record.get("dpop_jti"),
        "pop_key_thumbprint": record.get("pop_key_thumbprint"),
    }
    keys = [k for k in record.get("keys") or [] if isinstance(k, Mapping)]
    if not keys:
        asked = [a for a in record.get("asked") or [] if isinstance(a, Mapping)]
        return [
            _event(
                record,
                activity=READ,
                result=record.get("result"),
                resources=_keys(a.get("key"), a.get("version")),
                actor=actor,
                code=record.get("code"),
                message=record.get("message"),
                uid_suffix=f"#{n}",
                unmapped=common,
            )
            for n, a in enumerate(asked)
        ] or [
            _event(
                record,
                activity=READ,
                result=record.get("result"),
                resources=[],
                actor=actor,
                code=record.get("code"),
                message=record.get("message"),
                unmapped=common,
            )
        ]
    return [
        _event(
            record,
            activity=READ,
            result=key.get("result"),
            resources=_keys(key.get("key"), key.get("version"), key.get("kid")),
            actor=actor,
            code=key.get("code"),
            message=_message(key.get("reasons"), key.get("message")),
            uid_suffix=f"#{n}",
            unmapped={
                **common,
                "policy_digest": key.get("policy_digest"),
                "input_digest": key.get("input_digest"),
            },
        )
        for n, key in enumerate(keys)
    ]


def _attestation(record: Mapping[str, Any]) -> list[Event]:
    return [
        _event(
            record,
            activity=CREATE,
            result=record.get("result"),
            resources=[{"type": "attestation", "uid": record.get("jti")}],
            actor=_runner(record.get("identity"), record.get("jti")),
            code=record.get("code"),
            message=_message(record.get("reasons"), record.get("message")),
            unmapped={"expires_at": record.get("expires_at")},
        )
    ]


def _attestation_revoked(record: Mapping[str, Any]) -> list[Event]:
    return [
        _event(
            record,
            activity=UPDATE,
            result=None,
            resources=[{"type": "attestation", "uid": record.get("jti")}],
            actor=_who(record),
            message=record.get("reason"),
        )
        | {"severity_id": 2}
    ]


def _policy_change(record: Mapping[str, Any]) -> list[Event]:
    return [
        _event(
            record,
            activity=UPDATE,
            result=None,
            resources=[
                {"type": "policy", "uid": record.get("new_digest"), "name": record.get("source")}
            ],
            actor=_who(record),
            message=f"policy {record.get('old_digest')} -> {record.get('new_digest')} "
            f"({record.get('trigger')})",
            unmapped={"old_digest": record.get("old_digest"), "revision": record.get("revision")},
        )
    ]


def _policy_reload_failed(record: Mapping[str, Any]) -> list[Event]:
    return [
        _event(
            record,
            activity=UPDATE,
            result=DENY,
            resources=[
                {"type": "policy", "uid": record.get("active_digest"), "name": record.get("source")}
            ],
            actor=_who(record),
            code="policy_invalid",
            message=record.get("problem"),
            unmapped={"trigger": record.get("trigger")},
        )
    ]


def _key_admin(record: Mapping[str, Any]) -> list[Event]:
    action = str(record.get("action"))
    return [
        _event(
            record,
            activity=KEY_ACTIVITIES.get(action, OTHER),
            result=None,
            resources=_keys(record.get("key"), record.get("version")),
            actor=_who(record),
            message=action,
            unmapped={"action": action, "state": record.get("state")},
        )
    ]


def _log_repair(record: Mapping[str, Any]) -> list[Event]:
    return [
        _event(
            record,
            activity=UPDATE,
            result=None,
            resources=[{"type": "log", "name": record.get("replica")}],
            actor={"user": {"uid": "broker", "name": "broker"}},
            message=f"removed a torn final record ({record.get('removed_bytes')} bytes)",
            unmapped={"removed_sha256": record.get("removed_sha256")},
        )
        | {"severity_id": 3}
    ]


def _log_key_rotation(record: Mapping[str, Any]) -> list[Event]:
    """The checkpoint-signing key handed over (both keys signed the hand-over note)."""
    return [
        _event(
            record,
            activity=UPDATE,
            result=None,
            resources=[{"type": "log", "name": record.get("origin")}],
            actor={"user": {"uid": "broker", "name": "broker"}},
            message=f"checkpoint key {record.get('old_key')} -> {record.get('new_key')}",
            unmapped={
                "old_key": record.get("old_key"),
                "new_key": record.get("new_key"),
                "tree_size": record.get("tree_size"),
            },
        )
        | {"severity_id": 2}
    ]


def _other(record: Mapping[str, Any]) -> list[Event]:
    """A type this version does not know (a newer broker's log): its envelope, Unknown."""
    event = _event(record, activity=OTHER, result=None, resources=[], actor=_who(record), code=None)
    return [event | {"status_id": 0, "status": STATUS_NAMES[0]}]


MAPPINGS: dict[str, Callable[[Mapping[str, Any]], list[Event]]] = {
    "release": _release,
    "attested_release": _attested_release,
    "attestation": _attestation,
    "attestation_revoked": _attestation_revoked,
    "policy_change": _policy_change,
    "policy_reload_failed": _policy_reload_failed,
    "key_admin": _key_admin,
    "log_repair": _log_repair,
    "log_key_rotation": _log_key_rotation,
}
