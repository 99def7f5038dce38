"""A stored attestation (issue 19): what a release on an EAR is decided from, and its status.
Pure data; the stores are ``broker/stores/attestations.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from broker.core.errors import ErrorCode, UpstreamError

log = logging.getLogger(__name__)
ACTIVE = "active"
REVOKED = "revoked"
MAX_REASON_CHARS = 512
# A revocation's record is written by whoever revoked it within this; after it, anyone re-deciding
# may write it (``claim_record``). Far longer than an append takes, so two writers are unlikely.
RECORD_GRACE = timedelta(seconds=60)


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

    def to_json(self) -> str:
        due = {} if self.record_due is None else {"record_due": self.record_due.timestamp()}
        return json.dumps(
            {
                "jti": self.jti,
                "expires_at": self.expires_at.timestamp(),
                "pop_thumbprint": self.pop_thumbprint,
                "policy_input": dict(self.policy_input),
                "status": self.status,
                "reason": self.reason,
                "log_index": self.log_index,
                **due,
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> AttestationEntry:
        value = json.loads(text)
        due = value.get("record_due")
        return cls(
            jti=value["jti"],
            expires_at=datetime.fromtimestamp(value["expires_at"], UTC),
            pop_thumbprint=value["pop_thumbprint"],
            policy_input=value["policy_input"],
            status=value["status"],
            reason=value.get("reason"),
            log_index=value.get("log_index"),
            record_due=None if due is None else datetime.fromtimestamp(due, UTC),
        )


Change = Callable[["AttestationEntry"], "AttestationEntry"]


class AttestationStore(Protocol):
    async def put(self, entry: AttestationEntry) -> None:
        """Store a new, active attestation until it expires."""
        ...

    async def get(self, jti: str, now: datetime) -> AttestationEntry | None:
        """The entry, active or revoked; ``None`` when unknown or expired."""
        ...

    async def update(
        self, jti: str, now: datetime, change: Change
    ) -> tuple[AttestationEntry, AttestationEntry] | None:
        """Replace the entry by ``change(entry)`` atomically across every client of the store
        (a concurrent update is read again, never overwritten); ``(before, after)``, or ``None``
        when unknown or expired."""
        ...

    async def unexpired(self, now: datetime) -> list[AttestationEntry]:
        """Every unexpired entry, active or revoked (a policy reload re-decides the active
        ones and writes the revocation records still owed)."""
        ...

    async def close(self) -> None: ...


def unavailable(kind: str, exc: BaseException) -> UpstreamError:
    error = UpstreamError(
        "the attestation store did not answer", code=ErrorCode.NONCE_STORE_UNAVAILABLE
    )
    error.__cause__ = exc
    log.warning("%s attestation store: %s", kind, exc)  # the operator's log keeps the cause
    return error


def revoked_entry(entry: AttestationEntry, reason: str, now: datetime) -> AttestationEntry:
    """Revoked with ``reason``, its record due within ``RECORD_GRACE``; one already revoked
    keeps its first reason."""
    if entry.status == REVOKED:
        return entry
    return replace(
        entry, status=REVOKED, reason=reason[:MAX_REASON_CHARS], record_due=now + RECORD_GRACE
    )


@dataclass(frozen=True)
class Revocation:
    entry: AttestationEntry  # as it is now: revoked, with the first reason given
    newly: bool  # this call revoked it (False: it already was)


async def revoke(
    store: AttestationStore, jti: str, reason: str, now: datetime
) -> Revocation | None:
    """Revoke for every worker and replica; ``None`` when unknown or expired."""
    changed = await store.update(jti, now, lambda entry: revoked_entry(entry, reason, now))
    if changed is None:
        return None
    before, after = changed
    return Revocation(after, newly=before.status != REVOKED)


async def claim_record(store: AttestationStore, jti: str, now: datetime) -> bool:
    """Take over writing a revocation record overdue at ``now`` (its revoker stopped before
    writing it): the record falls due again ``RECORD_GRACE`` later, so one writer at a time
    has it, and a claimant that stops too hands it on. Whether this call claimed it."""

    def take(entry: AttestationEntry) -> AttestationEntry:
        if entry.record_due is None or entry.record_due > now:
            return entry
        return replace(entry, record_due=now + RECORD_GRACE)

    changed = await store.update(jti, now, take)
    return changed is not None and changed[0].record_due != changed[1].record_due


async def record_written(store: AttestationStore, jti: str, now: datetime) -> None:
    """The revocation's record is in the log: no one owes it any more."""
    await store.update(jti, now, lambda entry: replace(entry, record_due=None))


async def note_log_index(store: AttestationStore, jti: str, index: int, now: datetime) -> None:
    """Remember the ``attestation`` record's index: each release record names it."""
    await store.update(jti, now, lambda entry: replace(entry, log_index=index))


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
