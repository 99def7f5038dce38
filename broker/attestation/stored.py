"""A stored attestation (issue 19): what a release on an EAR is decided from, and its status.
Pure data; the stores are ``broker/stores/attestations.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from broker.core.errors import ErrorCode, UpstreamError

log = logging.getLogger(__name__)
ACTIVE = "active"
REVOKED = "revoked"
MAX_REASON_CHARS = 512


@dataclass(frozen=True)
class AttestationEntry:
    jti: str
    expires_at: datetime
    pop_thumbprint: str
    policy_input: Mapping[str, Any]
    status: str = ACTIVE
    reason: str | None = None
    log_index: int | None = None  # its ``attestation`` record's index, once appended

    def to_json(self) -> str:
        return json.dumps(
            {
                "jti": self.jti,
                "expires_at": self.expires_at.timestamp(),
                "pop_thumbprint": self.pop_thumbprint,
                "policy_input": dict(self.policy_input),
                "status": self.status,
                "reason": self.reason,
                "log_index": self.log_index,
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> AttestationEntry:
        value = json.loads(text)
        return cls(
            jti=value["jti"],
            expires_at=datetime.fromtimestamp(value["expires_at"], UTC),
            pop_thumbprint=value["pop_thumbprint"],
            policy_input=value["policy_input"],
            status=value["status"],
            reason=value.get("reason"),
            log_index=value.get("log_index"),
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

    async def active(self, now: datetime) -> list[AttestationEntry]:
        """Every unexpired entry still active (a policy reload re-decides them)."""
        ...

    async def close(self) -> None: ...


def unavailable(kind: str, exc: BaseException) -> UpstreamError:
    error = UpstreamError(
        "the attestation store did not answer", code=ErrorCode.NONCE_STORE_UNAVAILABLE
    )
    error.__cause__ = exc
    log.warning("%s attestation store: %s", kind, exc)  # the operator's log keeps the cause
    return error


def revoked_entry(entry: AttestationEntry, reason: str) -> AttestationEntry:
    """Revoked with ``reason``; one already revoked keeps its first reason."""
    if entry.status == REVOKED:
        return entry
    return replace(entry, status=REVOKED, reason=reason[:MAX_REASON_CHARS])


@dataclass(frozen=True)
class Revocation:
    entry: AttestationEntry  # as it is now: revoked, with the first reason given
    newly: bool  # this call revoked it (False: it already was)


async def revoke(
    store: AttestationStore, jti: str, reason: str, now: datetime
) -> Revocation | None:
    """Revoke for every worker and replica; ``None`` when unknown or expired."""
    changed = await store.update(jti, now, lambda entry: revoked_entry(entry, reason))
    if changed is None:
        return None
    before, after = changed
    return Revocation(after, newly=before.status != REVOKED)


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
