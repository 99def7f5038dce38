"""A stored attestation (issue 19): what a release on an EAR is decided from, and its status.
Pure data; the stores are ``broker/attestation_stores.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
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
    encryption_jwk: Mapping[str, str]
    pop_thumbprint: str
    policy_input: Mapping[str, Any]
    status: str = ACTIVE
    reason: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "jti": self.jti,
                "expires_at": self.expires_at.timestamp(),
                "encryption_jwk": dict(self.encryption_jwk),
                "pop_thumbprint": self.pop_thumbprint,
                "policy_input": dict(self.policy_input),
                "status": self.status,
                "reason": self.reason,
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
            encryption_jwk=value["encryption_jwk"],
            pop_thumbprint=value["pop_thumbprint"],
            policy_input=value["policy_input"],
            status=value["status"],
            reason=value.get("reason"),
        )


class AttestationStore(Protocol):
    async def put(self, entry: AttestationEntry) -> None:
        """Store a new, active attestation until it expires."""
        ...

    async def get(self, jti: str, now: datetime) -> AttestationEntry | None:
        """The entry, active or revoked; ``None`` when unknown or expired."""
        ...

    async def revoke(self, jti: str, reason: str, now: datetime) -> AttestationEntry | None:
        """Mark it revoked (the first reason stays); ``None`` when unknown or expired."""
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
    if entry.status == REVOKED:
        return entry
    return AttestationEntry(
        entry.jti,
        entry.expires_at,
        entry.encryption_jwk,
        entry.pop_thumbprint,
        entry.policy_input,
        REVOKED,
        reason[:MAX_REASON_CHARS],
    )
