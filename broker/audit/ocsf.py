"""Decision records as OCSF 1.1 events ("API Activity", class 6003) for a SIEM (issue 27).

Every record type the broker writes has a mapping here (``MAPPINGS``); a test lists the types
the writers write and checks each one's events field by field (docs/audit.md has the table).
A release on an attestation result becomes one event per key asked (its key, version, kid,
status and reasons), each naming the attestation (``actor.session.uid``) and the workload it
attested (``actor.user``); a request refused before any key was decided is one event per key
it asked for, with the request's code.

Every mapping reads the record through its envelope (``envelope.py``): a release, on evidence or
on a result, is one event per key of ``Envelope.decisions`` — the keys decided, then the keys asked
and never decided (refused before, or cut short by a bug), each with its name.

Pure: a record (its envelope, or the dict read from the log) in, a list of events out; nothing is
fetched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from broker.audit.envelope import Envelope, KeyDecision, parse_record
from broker.audit.outcomes import ALLOW, DENY, ERROR, PARTIAL
from broker.core.records import CHANGE_INTENT, ChangeResult, RecordType

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
# a key change's ``result`` (keys/changes.py) → (status_id, severity_id); its intent has none
# and says ``phase: intent`` (Unknown: the outcome says); a record with neither is a read
# (backup, weights-*) or an intent older than the marker (Success, as it was mapped then)
INTENT_STATUS = (0, 1)
CHANGE_STATUS: dict[str | None, tuple[int, int]] = {
    None: (1, 1),
    ChangeResult.OK: (1, 1),
    ChangeResult.ERROR: (2, 4),
    ChangeResult.UNKNOWN: (0, 3),
}
KEY_ACTIVITIES = {
    "create": CREATE,
    "rotate": CREATE,  # a new version
    "import": CREATE,
    "restore": CREATE,
    "enable": UPDATE,
    "disable": UPDATE,
    "rewrap-start": UPDATE,
    "rewrap": UPDATE,
    "migrate-store": UPDATE,
    "destroy": DELETE,
    "backup": READ,
    "weights-encrypt": READ,
    "weights-decrypt": READ,
}

Event = dict[str, Any]


def ocsf_events(record: Envelope | Mapping[str, Any]) -> list[Event]:
    """The OCSF events of one record (one, or one per key for a release on a result).

    Raises:
        RecordError: ``record`` is not a record (not an object).
    """
    envelope = record if isinstance(record, Envelope) else parse_record(record)
    return MAPPINGS.get(envelope.kind, _other)(envelope)


def _event(
    envelope: Envelope,
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
    status_id = STATUS.get(result, 0) if result is not None else 1
    decision = envelope.uid
    return {
        "class_uid": CLASS_UID,
        "category_uid": CATEGORY_UID,
        "activity_id": activity,
        "type_uid": CLASS_UID * 100 + activity,
        "time": 0 if envelope.at is None else int(envelope.at.timestamp() * 1000),
        "severity_id": SEVERITY.get(result, 1) if result is not None else 1,
        "status_id": status_id,
        "status": STATUS_NAMES[status_id],
        "status_code": code,
        "message": message,
        "api": {
            "operation": envelope.type or envelope.kind.value,
            "request": {"uid": envelope.request_id},
        },
        "actor": actor,
        # a resource the record does not name is left unnamed, never named null
        "resources": [
            {k: v for k, v in r.items() if v is not None or k != "name"} for r in resources
        ],
        "metadata": {
            "product": PRODUCT,
            "version": OCSF_VERSION,
            "uid": None if decision is None else f"{decision}{uid_suffix}",
            "correlation_uid": decision,
            "sequence": envelope.index,
            "log_name": envelope.replica,
        },
        "unmapped": {
            "result": envelope.result,
            "policy_digest": envelope.policy_digest,
            "hash": envelope.hash,
            **(unmapped or {}),
        },
    }


def _message(reasons: tuple[str, ...], other: str | None) -> str | None:
    return "; ".join(reasons) or other or None


def _runner(identity: Mapping[str, Any], session: str | None = None) -> dict[str, Any]:
    actor: dict[str, Any] = {
        "user": {"uid": identity.get("sub"), "name": identity.get("image_digest")},
    }
    if identity.get("project_id") is not None or identity.get("instance_id") is not None:
        actor["user"]["account"] = {"uid": identity.get("project_id")}
        actor["device"] = {"uid": identity.get("instance_id")}
    if session is not None:
        actor["session"] = {"uid": session}
    return actor


def _who(envelope: Envelope) -> dict[str, Any]:
    who = envelope.who  # changes say who made them (admin token id, user@host, broker)
    return {"user": {"uid": who, "name": who}}


def _keys(name: str | None, version: int | None, kid: str | None = None) -> list[dict[str, Any]]:
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


def _release(envelope: Envelope) -> list[Event]:
    """A release, on evidence (one key) or on an attestation result (one event per key: those
    decided with their own result, then those asked and not decided with the request's); a
    request that named no key is one event without resources."""
    attestation = envelope.attestation
    session = None if attestation is None else attestation.jti
    common: dict[str, Any] = {}
    if attestation is not None:  # a release on a result: which result, which proof
        common = {
            "attestation_log_index": attestation.log_index,
            "dpop_jti": envelope.body.get("dpop_jti"),
            "pop_key_thumbprint": envelope.body.get("pop_key_thumbprint"),
        }
    numbered = envelope.kind is RecordType.ATTESTED_RELEASE and bool(envelope.keys)
    return [
        _key_event(
            envelope,
            key,
            uid_suffix=f"#{n}" if numbered else "",
            session=session,
            common=common,
        )
        for n, key in enumerate(envelope.decisions)
    ]


def _key_event(
    envelope: Envelope,
    key: KeyDecision,
    *,
    uid_suffix: str,
    session: str | None,
    common: Mapping[str, Any],
) -> Event:
    return _event(
        envelope,
        activity=READ,
        result=key.result,
        resources=_keys(key.key, key.version, key.kid),
        actor=_runner(envelope.identity, session),
        code=key.code,
        message=_message(key.reasons, key.message),
        uid_suffix=uid_suffix,
        unmapped={**common, "policy_digest": key.policy_digest, "input_digest": key.input_digest},
    )


def _attestation(envelope: Envelope) -> list[Event]:
    jti = None if envelope.attestation is None else envelope.attestation.jti
    return [
        _event(
            envelope,
            activity=CREATE,
            result=envelope.result,
            resources=[{"type": "attestation", "uid": jti}],
            actor=_runner(envelope.identity, jti),
            code=envelope.code,
            message=_message(envelope.reasons, envelope.message),
            unmapped={"expires_at": envelope.body.get("expires_at")},
        )
    ]


def _identity(envelope: Envelope) -> list[Event]:
    """A workload certificate on an attestation result: Create of a ``certificate`` named by
    its SPIFFE ID and serial (none when refused), the attestation as the session."""
    attestation, body = envelope.attestation, envelope.body
    session = None if attestation is None else attestation.jti
    return [
        _event(
            envelope,
            activity=CREATE,
            result=envelope.result,
            resources=[
                {"type": "certificate", "uid": body.get("serial"), "name": body.get("spiffe_id")}
            ],
            actor=_runner(envelope.identity, session),
            code=envelope.code,
            message=_message(envelope.reasons, envelope.message),
            unmapped={
                "attestation_log_index": None if attestation is None else attestation.log_index,
                "dpop_jti": body.get("dpop_jti"),
                "not_after": body.get("not_after"),
                "policy_digest": envelope.policy_digest,
                "input_digest": envelope.input_digest,
            },
        )
    ]


def _kbs(envelope: Envelope) -> dict[str, Any]:
    kbs = envelope.body.get("kbs")
    return dict(kbs) if isinstance(kbs, Mapping) else {}


def _kbs_auth(envelope: Envelope) -> list[Event]:
    """A KBS guest's handshake: Create of a ``kbs_session`` named by its cookie's hash (none
    when refused), the guest's ``tee`` and protocol version unmapped."""
    kbs = _kbs(envelope)
    session = kbs.get("session")
    return [
        _event(
            envelope,
            activity=CREATE,
            result=envelope.result,
            resources=[{"type": "kbs_session", "uid": session}],
            actor={"user": {"uid": None, "name": kbs.get("tee")}, "session": {"uid": session}},
            code=envelope.code,
            message=envelope.message,
            unmapped={"kbs": kbs},
        )
    ]


def _kbs_attest(envelope: Envelope) -> list[Event]:
    """A KBS guest's attestation: as an attestation, with the protocol's facts unmapped."""
    return [
        event | {"unmapped": event["unmapped"] | {"kbs": _kbs(envelope)}}
        for event in _attestation(envelope)
    ]


def _kbs_resource(envelope: Envelope) -> list[Event]:
    """A resource released to a KBS guest: as a release on a result (its key, the token's
    attestation as the session), the path and credential unmapped."""
    return [
        event | {"unmapped": event["unmapped"] | {"kbs": _kbs(envelope)}}
        for event in _release(envelope)
    ]


def _attestation_revoked(envelope: Envelope) -> list[Event]:
    jti = None if envelope.attestation is None else envelope.attestation.jti
    # written by an owed-record pass after its revoker could not: ``time`` is the revocation's
    late = envelope.body.get("written_late") is True
    return [
        _event(
            envelope,
            activity=UPDATE,
            result=None,
            resources=[{"type": "attestation", "uid": jti}],
            actor=_who(envelope),
            message=envelope.body.get("reason"),
            unmapped=(
                {"written_late": True, "written_at": envelope.body.get("written_at")}
                if late
                else None
            ),
        )
        | {"severity_id": 2}
    ]


def _policy_change(envelope: Envelope) -> list[Event]:
    body = envelope.body
    return [
        _event(
            envelope,
            activity=UPDATE,
            result=None,
            resources=[
                {"type": "policy", "uid": body.get("new_digest"), "name": body.get("source")}
            ],
            actor=_who(envelope),
            message=f"policy {body.get('old_digest')} -> {body.get('new_digest')} "
            f"({body.get('trigger')})",
            unmapped={"old_digest": body.get("old_digest"), "revision": body.get("revision")},
        )
    ]


def _policy_reload_failed(envelope: Envelope) -> list[Event]:
    body = envelope.body
    return [
        _event(
            envelope,
            activity=UPDATE,
            result=DENY,
            resources=[
                {"type": "policy", "uid": body.get("active_digest"), "name": body.get("source")}
            ],
            actor=_who(envelope),
            code="policy_invalid",
            message=body.get("problem"),
            unmapped={"trigger": body.get("trigger")},
        )
    ]


def _key_admin(envelope: Envelope) -> list[Event]:
    """A key change is an intent (no ``result``, ``phase: intent``: Unknown, the change not made
    yet) then its outcome (``ok`` Success, ``error`` Failure, ``unknown`` Unknown;
    ``unmapped.intent`` the intent's index); reads, one record (Success)."""
    action = str(envelope.body.get("action"))
    phase = envelope.body.get("phase")
    if envelope.result is None and phase == CHANGE_INTENT:
        status, severity = INTENT_STATUS
    else:
        status, severity = CHANGE_STATUS.get(envelope.result, (0, 3))
    event = _event(
        envelope,
        activity=KEY_ACTIVITIES.get(action, OTHER),
        result=None,
        resources=_keys(envelope.key, envelope.body.get("version")),
        actor=_who(envelope),
        code=envelope.code,
        message=action if envelope.message is None else f"{action}: {envelope.message}",
        unmapped={
            "action": action,
            "state": envelope.body.get("state"),
            "intent": envelope.body.get("intent"),
            "phase": phase,
        },
    )
    return [event | {"status_id": status, "status": STATUS_NAMES[status], "severity_id": severity}]


def _log_repair(envelope: Envelope) -> list[Event]:
    """The repair writer names no replica (the log is then unnamed)."""
    return [
        _event(
            envelope,
            activity=UPDATE,
            result=None,
            resources=[{"type": "log", "name": envelope.replica}],
            actor={"user": {"uid": "broker", "name": "broker"}},
            message=f"removed a torn final record ({envelope.body.get('removed_bytes')} bytes)",
            unmapped={"removed_sha256": envelope.body.get("removed_sha256")},
        )
        | {"severity_id": 3}
    ]


def _log_key_rotation(envelope: Envelope) -> list[Event]:
    """The checkpoint-signing key handed over (both keys signed the hand-over note)."""
    body = envelope.body
    return [
        _event(
            envelope,
            activity=UPDATE,
            result=None,
            resources=[{"type": "log", "name": body.get("origin")}],
            actor={"user": {"uid": "broker", "name": "broker"}},
            message=f"checkpoint key {body.get('old_key')} -> {body.get('new_key')}",
            unmapped={
                "old_key": body.get("old_key"),
                "new_key": body.get("new_key"),
                "tree_size": body.get("tree_size"),
            },
        )
        | {"severity_id": 2}
    ]


def _identity_ca(envelope: Envelope) -> list[Event]:
    """The workload-certificate CA in force changed (a rotation, or the first start with it)."""
    body = envelope.body
    chain = body.get("chain")
    issuer = chain[0] if isinstance(chain, list) and chain and isinstance(chain[0], dict) else {}
    return [
        _event(
            envelope,
            activity=UPDATE,
            result=None,
            resources=[
                {
                    "type": "certificate_authority",
                    "uid": issuer.get("sha256"),
                    "name": body.get("trust_domain"),
                }
            ],
            actor={"user": {"uid": "broker", "name": "broker"}},
            message=f"identity CA {body.get('old_ca_digest')} -> {body.get('ca_digest')} "
            f"({body.get('trigger')})",
            unmapped={"old_ca_digest": body.get("old_ca_digest"), "subject": issuer.get("subject")},
        )
        | {"severity_id": 2}
    ]


def _other(envelope: Envelope) -> list[Event]:
    """A type this version does not know (a newer broker's log): its envelope, Unknown."""
    event = _event(envelope, activity=OTHER, result=None, resources=[], actor=_who(envelope))
    return [event | {"status_id": 0, "status": STATUS_NAMES[0]}]


MAPPINGS: dict[str, Callable[[Envelope], list[Event]]] = {
    RecordType.RELEASE: _release,
    RecordType.ATTESTED_RELEASE: _release,
    RecordType.ATTESTATION: _attestation,
    RecordType.ATTESTATION_REVOKED: _attestation_revoked,
    RecordType.IDENTITY: _identity,
    RecordType.KBS_AUTH: _kbs_auth,
    RecordType.KBS_ATTEST: _kbs_attest,
    RecordType.KBS_RESOURCE: _kbs_resource,
    RecordType.IDENTITY_CA: _identity_ca,
    RecordType.POLICY_CHANGE: _policy_change,
    RecordType.POLICY_RELOAD_FAILED: _policy_reload_failed,
    RecordType.KEY_ADMIN: _key_admin,
    RecordType.LOG_REPAIR: _log_repair,
    RecordType.LOG_KEY_ROTATION: _log_key_rotation,
}
