"""A stored attestation (issue 19): what a release on an EAR is decided from, and its status.
Pure data; the stores are ``broker/stores/attestations.py``.

A revocation takes effect before its ``attestation_revoked`` record is written, so the entry
holds that record (``pending_record``: who revoked, when, why) until it is written, and a store
keeps such an entry past its expiry until then (``kept_until``; docs/decisions.md,
"Revocations are recorded after they take effect"). An entry read back is parsed strictly
(``from_json``): the store is trusted for a result's status, not for its form; a record a
pass writes late is rebuilt from checked fields (``late.py``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from broker.attestation.issued import IssuedCertificate, parse_identities, with_certificate
from broker.core.errors import ErrorCode, UpstreamError
from broker.core.jsonsafe import loads_bounded
from broker.core.records import RecordType

log = logging.getLogger(__name__)
ACTIVE = "active"
REVOKED = "revoked"
MAX_REASON_CHARS = 512
MAX_JTI_CHARS = 256  # a stored jti or thumbprint (the broker's: 22 to 43 characters)
# A revocation's record is written by whoever revoked it within this; after it, any process's
# owed-record pass may write it (``claim_record``). Far longer than an append takes, so two
# writers are unlikely.
RECORD_GRACE = timedelta(seconds=60)
# An entry whose record is owed is kept until the record is written, whatever its expiry: the SQL
# stores' ``expires_at`` column (when the row may be deleted) holds this for it.
KEPT_WHILE_OWED = datetime(9999, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class AttestationEntry:
    jti: str
    expires_at: datetime
    pop_thumbprint: str
    policy_input: Mapping[str, Any]
    status: str = ACTIVE
    reason: str | None = None
    log_index: int | None = None  # its ``attestation`` record's index, once appended
    # revoked, and its ``attestation_revoked`` record not written yet: due then (None: written,
    # or revoked before this field existed, when the record was written after the revocation)
    record_due: datetime | None = None
    # that record, as its revoker made it (None: none owed, or owed by a broker that did not
    # keep it); one written late is rebuilt from its checked fields (``late.late_record``)
    pending_record: Mapping[str, Any] | None = None
    # the workload certificates issued on it, newest last (issue 32: ``issued.py``)
    identities: tuple[IssuedCertificate, ...] = ()

    @property
    def owed(self) -> bool:
        """Its revocation record is not written yet."""
        return self.record_due is not None

    @property
    def kept_until(self) -> datetime:
        """How long a store keeps it: until it expires, and while its record is owed, until the
        record is written (``get`` still answers ``None`` once it expired)."""
        return KEPT_WHILE_OWED if self.owed else self.expires_at

    def to_json(self) -> str:
        optional: dict[str, Any] = {}
        if self.record_due is not None:
            optional["record_due"] = self.record_due.timestamp()
        if self.pending_record is not None:
            optional["pending_record"] = dict(self.pending_record)
        if self.identities:  # absent while none: an entry's text as before issue 32
            optional["identities"] = [c.stored() for c in self.identities]
        return json.dumps(
            {
                "jti": self.jti,
                "expires_at": self.expires_at.timestamp(),
                "pop_thumbprint": self.pop_thumbprint,
                "policy_input": dict(self.policy_input),
                "status": self.status,
                "reason": self.reason,
                "log_index": self.log_index,
                **optional,
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> AttestationEntry:
        """Parse an entry as a store holds it, strictly: the store's writers are trusted for a
        result's status, not for what the broker computes or logs from its entry (RFC 8259 JSON
        only, no ``NaN``; each field its type; ``pending_record`` an object, its members
        checked where a record is made of it: ``late.py``).

        Raises:
            MalformedEntry: 503 ``attestation_store_mismatch`` (logged at error).
        """
        try:
            return _entry(loads_bounded(text))
        except (TypeError, ValueError) as exc:
            log.error(  # noqa: TRY400 - the store's content, not a bug: no traceback
                "the attestation store holds an entry in an unexpected form: %s", exc
            )
            raise MalformedEntry(str(exc)) from exc


class MalformedEntry(UpstreamError):
    """The attestation store holds an entry in a form no broker writes (tampered or corrupted):
    the store answered nonsense. A release on it is refused as one on an entry that does not
    match its signed result (503 ``attestation_store_mismatch``), never a 500; a listing skips
    it (``parsed_entries``)."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            "the stored attestation is in an unexpected form; attest again",
            code=ErrorCode.ATTESTATION_STORE_MISMATCH,
        )
        self.problem = problem


def parsed_entries(bodies: Iterable[str | bytes]) -> list[AttestationEntry]:
    """The entries a store's listing read, each parsed strictly; one in an unexpected form is
    skipped (``from_json`` logs it): nonsense in one entry stops neither a re-decision nor an
    owed-record pass for every other."""
    entries: list[AttestationEntry] = []
    for body in bodies:
        try:
            entries.append(AttestationEntry.from_json(body))
        except MalformedEntry:
            continue
    return entries


def _entry(value: Any) -> AttestationEntry:
    """The entry a parsed store value holds, each field checked.

    Raises:
        TypeError, ValueError: naming the first field in an unexpected form.
    """
    if not isinstance(value, dict):
        raise TypeError("not a JSON object")
    reason, pending, status = value.get("reason"), value.get("pending_record"), value.get("status")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS):
        raise ValueError(f"reason is not a string of at most {MAX_REASON_CHARS} characters")
    if pending is not None and not isinstance(pending, dict):
        raise ValueError("pending_record is not an object")
    if status not in (ACTIVE, REVOKED):
        raise ValueError("status is neither active nor revoked")
    return AttestationEntry(
        jti=_string(value, "jti", MAX_JTI_CHARS),
        expires_at=_time(value, "expires_at"),
        pop_thumbprint=_string(value, "pop_thumbprint", MAX_JTI_CHARS),
        policy_input=_object(value, "policy_input"),
        status=status,
        reason=reason,
        log_index=_integer(value, "log_index"),
        record_due=None if value.get("record_due") is None else _time(value, "record_due"),
        pending_record=pending,
        identities=parse_identities(value.get("identities")),
    )


def _string(value: Mapping[str, Any], name: str, limit: int) -> str:
    member = value.get(name)
    if not isinstance(member, str) or not 0 < len(member) <= limit:
        raise ValueError(f"{name} is not a string of 1 to {limit} characters")
    return member


def _object(value: Mapping[str, Any], name: str) -> dict[str, Any]:
    member = value.get(name)
    if not isinstance(member, dict):
        raise TypeError(f"{name} is not an object")
    return member


def _integer(value: Mapping[str, Any], name: str) -> int | None:
    member = value.get(name)
    if member is not None and (isinstance(member, bool) or not isinstance(member, int)):
        raise ValueError(f"{name} is not an integer")
    return member


def _time(value: Mapping[str, Any], name: str) -> datetime:
    seconds = value.get(name)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"{name} is not a number")
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError) as exc:
        raise ValueError(f"{name} is out of range") from exc


Change = Callable[["AttestationEntry"], "AttestationEntry"]
PARSED_ENTRIES = 1024  # entries a shared store's reader keeps parsed, by their text


class ParsedEntries:
    """Entries as a shared store's text reads, parsed once per text: equal text gives the same
    entry object (never changed: entries are frozen, their input only read), so what a worker
    prepared from an entry is found again by identity (``decisions/attested_cache.py``) while
    a rewritten entry, other text, is parsed and checked anew. At most ``max_entries``, the
    oldest forgotten first."""

    def __init__(self, max_entries: int = PARSED_ENTRIES) -> None:
        self._max = max(1, max_entries)
        self._parsed: dict[str | bytes, AttestationEntry] = {}

    def parse(self, text: str | bytes) -> AttestationEntry:
        """``AttestationEntry.from_json(text)``, or the entry equal text gave before."""
        entry = self._parsed.get(text)
        if entry is None:
            entry = AttestationEntry.from_json(text)
            if len(self._parsed) >= self._max:
                del self._parsed[next(iter(self._parsed))]
            self._parsed[text] = entry
        return entry


class AttestationStore(Protocol):
    async def put(self, entry: AttestationEntry) -> None:
        """Store a new, active attestation until it expires."""
        ...

    async def get(self, jti: str, now: datetime) -> AttestationEntry | None:
        """The entry, active or revoked; ``None`` when unknown or expired."""
        ...

    async def update(
        self, jti: str, now: datetime, change: Change, *, expired_too: bool = False
    ) -> tuple[AttestationEntry, AttestationEntry] | None:
        """Replace the entry by ``change(entry)`` atomically across every client of the store
        (a concurrent update is read again, never overwritten), kept as long as the new entry's
        ``kept_until`` says; ``(before, after)``, or ``None`` when unknown or expired (with
        ``expired_too``, only when gone: an expired entry kept for its owed record is changed
        too)."""
        ...

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        """Every unexpired entry, active or revoked (a policy reload re-decides the active
        ones)."""
        ...

    async def owed(self) -> list[AttestationEntry]:
        """Every entry whose revocation record is owed, expired or not (the owed-record pass
        writes them). A store that finds it dropped one logs that at error."""
        ...

    async def close(self) -> None: ...


def unavailable(kind: str, exc: BaseException) -> UpstreamError:
    error = UpstreamError(
        "the attestation store did not answer", code=ErrorCode.NONCE_STORE_UNAVAILABLE
    )
    error.__cause__ = exc
    log.warning("%s attestation store: %s", kind, exc)  # the operator's log keeps the cause
    return error


def revoked_entry(
    entry: AttestationEntry,
    reason: str,
    now: datetime,
    *,
    who: str,
    facts: Mapping[str, Any] | None = None,
) -> AttestationEntry:
    """Revoked with ``reason``, holding its ``attestation_revoked`` record (``who``, ``now``,
    the reason and ``facts``), due within ``RECORD_GRACE``; one already revoked keeps its first
    reason and record."""
    if entry.status == REVOKED:
        return entry
    reason = reason[:MAX_REASON_CHARS]
    record = {
        "type": RecordType.ATTESTATION_REVOKED,
        "jti": entry.jti,
        "time": now.isoformat(),
        "who": who,
        "reason": reason,
        **(facts or {}),
    }
    return replace(
        entry,
        status=REVOKED,
        reason=reason,
        record_due=now + RECORD_GRACE,
        pending_record=record,
    )


@dataclass(frozen=True)
class Revocation:
    entry: AttestationEntry  # as it is now: revoked, with the first reason given
    newly: bool  # this call revoked it (False: it already was)


async def revoke(
    store: AttestationStore,
    jti: str,
    reason: str,
    now: datetime,
    *,
    who: str,
    facts: Mapping[str, Any] | None = None,
) -> Revocation | None:
    """Revoke for every worker and replica, the record owed in the same update; ``None`` when
    unknown or expired."""
    changed = await store.update(
        jti, now, lambda entry: revoked_entry(entry, reason, now, who=who, facts=facts)
    )
    if changed is None:
        return None
    before, after = changed
    return Revocation(after, newly=before.status != REVOKED)


async def claim_record(store: AttestationStore, jti: str, now: datetime) -> AttestationEntry | None:
    """Take over writing a revocation record overdue at ``now`` (its revoker stopped before
    writing it, or handed it over): the record falls due again ``RECORD_GRACE`` later, so one
    writer at a time has it, and a claimant that stops too hands it on. The entry as claimed,
    or ``None`` when this call did not claim it (not due, taken, written, or gone)."""

    def take(entry: AttestationEntry) -> AttestationEntry:
        if entry.record_due is None or entry.record_due > now:
            return entry
        return replace(entry, record_due=now + RECORD_GRACE)

    changed = await store.update(jti, now, take, expired_too=True)
    if changed is None or changed[0].record_due == changed[1].record_due:
        return None
    return changed[1]


async def record_written(store: AttestationStore, jti: str, now: datetime) -> None:
    """The revocation's record is in the log: no one owes it any more (an expired entry may
    go now)."""
    await store.update(
        jti,
        now,
        lambda entry: replace(entry, record_due=None, pending_record=None),
        expired_too=True,
    )


async def hand_over(store: AttestationStore, jti: str, now: datetime) -> None:
    """Its writer could not write the record (the log did not take it): due at once, for
    whichever pass comes first."""

    def due_now(entry: AttestationEntry) -> AttestationEntry:
        if entry.record_due is None or entry.record_due <= now:
            return entry
        return replace(entry, record_due=now)

    await store.update(jti, now, due_now, expired_too=True)


async def note_log_index(store: AttestationStore, jti: str, index: int, now: datetime) -> None:
    """Remember the ``attestation`` record's index: each release record names it."""
    await store.update(jti, now, lambda entry: replace(entry, log_index=index))


async def note_certificate(
    store: AttestationStore, jti: str, certificate: IssuedCertificate, now: datetime
) -> AttestationEntry | None:
    """List a workload certificate on its result, for every worker and replica, in the same
    atomic update that reads the result's status: the entry as it is now (``certificate`` is
    listed unless it is revoked), or ``None`` when unknown or expired. The caller issues the
    certificate only when it is listed.

    Raises:
        UpstreamError: the store did not answer, or holds the entry in an unexpected form.
    """

    def listed(entry: AttestationEntry) -> AttestationEntry:
        if entry.status == REVOKED:  # revoked since it was admitted: no certificate on it
            return entry
        return replace(entry, identities=with_certificate(entry.identities, certificate, now))

    changed = await store.update(jti, now, listed)
    return None if changed is None else changed[1]


def revoked_sightings(gpus: Sequence[Mapping[str, Any]], raw_claims: Mapping[str, Any]) -> set[str]:
    """What verified evidence showed revoked by OCSP: ``gpu:<ueid>`` for a device whose
    certificate chain is revoked, ``rim:<id>`` for a RIM whose signer is (local evidence says
    which; an NRAS result says only that the device's status is revoked)."""
    seen: set[str] = set()
    local = raw_claims.get("nvidia")
    for summary in local.get("gpus", []) if isinstance(local, Mapping) else []:
        revoked = summary.get("ocsp_revoked") if isinstance(summary, Mapping) else None
        if not isinstance(revoked, Mapping):
            continue
        if revoked.get("device") is True and summary.get("ueid"):
            seen.add(f"gpu:{summary['ueid']}")
        seen.update(f"rim:{rim}" for rim in revoked.get("rims", []) if isinstance(rim, str))
    for gpu in gpus:
        if gpu.get("verifier") == "nras" and gpu.get("ocsp") == "revoked" and gpu.get("ueid"):
            seen.add(f"gpu:{gpu['ueid']}")
    return seen


def used_by(entry: AttestationEntry) -> set[str]:
    """The devices (``gpu:<ueid>``) and RIMs (``rim:<id>``) an attestation's evidence named."""
    policy_input = entry.policy_input
    used = {
        f"gpu:{gpu['ueid']}"
        for gpu in policy_input.get("gpus", [])
        if isinstance(gpu, Mapping) and gpu.get("ueid")
    }
    claims = policy_input.get("claims", {})
    local = claims.get("nvidia") if isinstance(claims, Mapping) else None
    for summary in local.get("gpus", []) if isinstance(local, Mapping) else []:
        if isinstance(summary, Mapping):
            used.update(f"rim:{rim}" for rim in summary.get("rim_ids", []) if isinstance(rim, str))
    return used
