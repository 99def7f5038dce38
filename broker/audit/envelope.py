"""One typed reading of a decision-log record, shared by every reader (issue 30).

``parse_record`` turns a record (a stored line, or the dict read from it) into an ``Envelope``:
the members every record type shares — type, decision id, request id, time, result, code,
reasons, policy digest, input digest, masked input, identity, leaf index, replica, hash, who —
and the per-kind body, typed where the readers need it:

* ``keys``: what a release decided, key by key, as ``KeyDecision`` items: a full-evidence
  ``release`` and a KBS guest's ``kbs_resource`` are one item (its key, possibly unnamed); an
  ``attested_release`` is one item per
  key decided, then one per key asked but never decided (a request refused before its keys, or
  cut short by a bug) with the request's result and code;
* ``decisions``: ``keys``, or for a record that decided as a whole (an ``attestation`` or a
  ``kbs_attest``, an attested release that named no key) one item for the record itself (a
  KBS handshake, ``kbs_auth``, decides no policy: none);
* ``attestation``: the attestation result a record concerns (its jti and log index);
* ``body``: the whole record as written, for the members of one kind only.

The writers' half lives in ``core/records.py`` (every writer may import ``core``, the domain
packages included): ``RecordType`` names every record type, ``record_head`` the members a
decision record starts with; both are re-exported here for the readers.

``broker audit query`` and ``export`` (OCSF), ``broker policy replay`` and the syslog sink read
records only through this type. The record format is not changed by it: any record a broker
wrote, of any version, parses; a member of the wrong type reads as absent; a type this version
does not know is ``RecordType.UNKNOWN`` (its envelope still read); only a line that is not a
JSON object is refused (``RecordError``). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from broker.audit.outcomes import overall
from broker.core.jsonsafe import loads_bounded
from broker.core.records import KNOWN_TYPES, RecordType

# the records of one attestation result's story (``broker audit query --attestation``)
ATTESTATION_TYPES = frozenset(
    {
        RecordType.ATTESTATION,
        RecordType.ATTESTED_RELEASE,
        RecordType.ATTESTATION_REVOKED,
        RecordType.IDENTITY,
        RecordType.KBS_ATTEST,
        RecordType.KBS_RESOURCE,
    }
)
ATTESTING = (RecordType.ATTESTATION, RecordType.KBS_ATTEST)  # a result issued (its jti at top)
RELEASING_ONE = (RecordType.RELEASE, RecordType.KBS_RESOURCE)  # one key, named at the top
# a key released (or refused): to a runner, on an attestation result, to a KBS guest — what
# ``broker audit query`` lists as releases, the console's keys page and the watch rules read
RELEASING = frozenset({*RELEASING_ONE, RecordType.ATTESTED_RELEASE})


class RecordError(ValueError):
    """Not a record: a line that is not a JSON object."""


@dataclass(frozen=True)
class KeyDecision:
    """One key of a release (or, for ``decisions``, a record that decided as a whole)."""

    key: str | None  # None: the request named no readable key, or the record has no key
    version: int | None
    kid: str | None
    result: str | None
    code: str | None
    message: str | None
    reasons: tuple[str, ...]
    policy_digest: str | None
    input_digest: str | None
    input: Mapping[str, Any] | None  # the policy input (masked) it was decided on
    decided: bool  # False: asked, but refused (or cut short) before it was decided


@dataclass(frozen=True)
class AttestationRef:
    """The attestation result a record concerns: its jti and its record's leaf index."""

    jti: str | None
    log_index: int | None


@dataclass(frozen=True)
class Envelope:
    kind: RecordType
    type: str  # as written ("" when absent); differs from ``kind`` only for UNKNOWN
    decision_id: str | None
    request_id: str | None
    time: str | None
    at: datetime | None  # ``time`` as an instant; None when absent or without a zone
    result: str | None  # as written (``outcome`` is what the record released)
    code: str | None
    message: str | None
    reasons: tuple[str, ...]
    policy_digest: str | None
    input_digest: str | None
    input: Mapping[str, Any] | None
    identity: Mapping[str, Any]  # the runner or attestation named ({} when none)
    key: str | None  # the key a record names at its top (release, key_admin)
    index: int | None  # the leaf index (``index``, or ``seq`` of older logs)
    replica: str | None
    hash: str | None
    who: str | None  # who made a change (admin token id, user@host, broker)
    attestation: AttestationRef | None
    keys: tuple[KeyDecision, ...]
    body: Mapping[str, Any]  # the record as written, read-only

    @property
    def outcome(self) -> str | None:
        """What the record released: from its decided keys when it lists any (so a release on
        a result that released one key of two is ``partial``, even in a log written before
        ``partial`` existed), else its own ``result`` (None for changes)."""
        decided = [k.result for k in self.keys if k.decided]
        if self.kind is RecordType.ATTESTED_RELEASE and decided:
            return overall(str(result) for result in decided)
        return self.result

    @property
    def uid(self) -> str | None:
        """The record's id: its decision id, or the jti it is written under (a revocation)."""
        return self.decision_id or _text(self.body.get("jti"))

    @property
    def decisions(self) -> tuple[KeyDecision, ...]:
        """What the record decided, one item per key; a decision made as a whole (an
        attestation, a release on a result refused before it named a key) is one keyless item;
        a workload certificate is one keyless item, decided once its policy input was made; a
        change decided nothing."""
        if self.keys:
            return self.keys
        if self.kind is RecordType.IDENTITY:
            return (self._as_decision(key=None, version=None, decided=self.input is not None),)
        if self.kind in (*ATTESTING, RecordType.ATTESTED_RELEASE):
            return (self._as_decision(key=None, version=None, decided=self.kind in ATTESTING),)
        return ()

    def _as_decision(self, *, key: str | None, version: int | None, decided: bool) -> KeyDecision:
        return KeyDecision(
            key=key,
            version=version,
            kid=_text(self.body.get("kid")),
            result=self.result,
            code=self.code,
            message=self.message,
            reasons=self.reasons,
            policy_digest=self.policy_digest,
            input_digest=self.input_digest,
            input=self.input,
            decided=decided,
        )


def parse_record(record: bytes | str | Mapping[str, Any]) -> Envelope:
    """The envelope of one record: a stored line (bytes or text) or the object read from it.

    Raises:
        RecordError: not a JSON object.
    """
    if isinstance(record, bytes | str):
        try:
            record = loads_bounded(record)
        except ValueError as exc:
            raise RecordError(f"not a JSON record: {exc}") from exc
    if not isinstance(record, Mapping):
        raise RecordError("not a record (a JSON object)")
    body = MappingProxyType(dict(record))
    written = _text(body.get("type")) or ""
    kind = RecordType(written) if written in KNOWN_TYPES else RecordType.UNKNOWN
    index = _integer(body.get("index"))
    envelope = Envelope(
        kind=kind,
        type=written,
        decision_id=_text(body.get("decision_id")),
        request_id=_text(body.get("request_id")),
        time=_text(body.get("time")),
        at=instant(body.get("time")),
        result=_text(body.get("result")),
        code=_text(body.get("code")),
        message=_text(body.get("message")),
        reasons=_reasons(body.get("reasons")),
        policy_digest=_text(body.get("policy_digest")),
        input_digest=_text(body.get("input_digest")),
        input=_mapping_or_none(body.get("input")),
        identity=_mapping(body.get("identity")),
        key=_text(body.get("key")),
        index=_integer(body.get("seq")) if index is None else index,
        replica=_text(body.get("replica")),
        hash=_text(body.get("hash")),
        who=_text(body.get("who")),
        attestation=_attestation(kind, body, index),
        keys=(),
        body=body,
    )
    if kind in RELEASING_ONE:
        own = envelope._as_decision(
            key=envelope.key, version=_integer(body.get("version")), decided=True
        )
        return replace(envelope, keys=(own,))
    if kind is RecordType.ATTESTED_RELEASE:
        return replace(envelope, keys=_released_keys(envelope))
    return envelope


def _released_keys(envelope: Envelope) -> tuple[KeyDecision, ...]:
    """An attested release's keys: those decided (each its own result), then those asked and not
    decided — the writer decides the asked keys in order, so they follow the decided ones — with
    the request's result and code."""
    decided = [_key_decision(k) for k in _objects(envelope.body.get("keys"))]
    asked = _objects(envelope.body.get("asked"))[len(decided) :]
    undecided = [
        KeyDecision(
            key=_text(a.get("key")),
            version=_integer(a.get("version")),
            kid=None,
            result=envelope.result,
            code=envelope.code,
            message=envelope.message,
            reasons=(),
            policy_digest=None,
            input_digest=None,
            input=None,
            decided=False,
        )
        for a in asked
    ]
    return (*decided, *undecided)


def _key_decision(key: Mapping[str, Any]) -> KeyDecision:
    return KeyDecision(
        key=_text(key.get("key")),
        version=_integer(key.get("version")),
        kid=_text(key.get("kid")),
        result=_text(key.get("result")),
        code=_text(key.get("code")),
        message=_text(key.get("message")),
        reasons=_reasons(key.get("reasons")),
        policy_digest=_text(key.get("policy_digest")),
        input_digest=_text(key.get("input_digest")),
        input=_mapping_or_none(key.get("input")),
        decided=True,
    )


def _attestation(
    kind: RecordType, body: Mapping[str, Any], index: int | None
) -> AttestationRef | None:
    if kind in (RecordType.ATTESTED_RELEASE, RecordType.IDENTITY, RecordType.KBS_RESOURCE):
        named = _mapping(body.get("attestation"))
        return AttestationRef(_text(named.get("jti")), _integer(named.get("log_index")))
    if kind in ATTESTING:
        return AttestationRef(_text(body.get("jti")), index)
    if kind is RecordType.ATTESTATION_REVOKED:
        return AttestationRef(_text(body.get("jti")), None)
    return None


def instant(when: Any) -> datetime | None:
    """An RFC 3339 time with a zone (``Z`` or an offset) as an aware datetime; anything else
    (absent, unreadable, no zone: which instant?) is None — in no interval."""
    if not isinstance(when, str):
        return None
    try:
        parsed = datetime.fromisoformat(when.replace("Z", "+00:00").replace("z", "+00:00"))
        # in UTC: comparing or converting instants of other offsets cannot overflow later
        return None if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValueError, OverflowError):  # 0001-01-01T00:00:00+01:00 is before year 1 in UTC
        return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _reasons(value: Any) -> tuple[str, ...]:
    return tuple(str(r) for r in value) if isinstance(value, list) else ()


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else MappingProxyType({})


def _mapping_or_none(value: Any) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def _objects(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []
