"""The services handlers use, each under its own typed ``AppKey``.

The composition root (``app.py``) sets every key once, in dependency order, inside the app's
cleanup context; aiohttp serves no request before that context has entered, so a handler never
meets a missing or half-built service and needs no "not ready" guard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec

from broker.attest import AttestService, ResultKeys
from broker.attested_release import AttestedReleaseService
from broker.audit.log import DecisionLog
from broker.config import Settings
from broker.core.errors import ErrorCode, NotFound, UpstreamError
from broker.keys.service import KeyService
from broker.keys.store.base import Purpose
from broker.nonces import NonceStore
from broker.policy.engine import PolicyEngine
from broker.policy.manager import PolicyManager
from broker.release import ReleaseService

Clock = Callable[[], datetime]


class Checkpoints(Protocol):
    async def current(self) -> str | None:
        """The latest signed checkpoint note, or None when none is signed."""
        ...

    def verifier_key(self) -> str | None:
        """The note verifier key (``<name>+<hash>+<key>``) that checks them, if any."""
        ...


class NoCheckpoints:
    """Without ``[audit] signing_key`` no checkpoint is signed."""

    async def current(self) -> str | None:
        return None

    def verifier_key(self) -> str | None:
        return None


@dataclass(frozen=True)
class StatementKey:
    """The EC P-256 key that signs query-key statements (``[keys] signing_key``), if set."""

    key: ec.EllipticCurvePrivateKey | None

    def require(self) -> ec.EllipticCurvePrivateKey:
        """Raises ``NotFound``: without the key this broker publishes no query keys (the
        resource does not exist here; it is not a failing dependency, which would page)."""
        if self.key is None:
            raise NotFound(
                "this broker publishes no query keys ([keys] signing_key is not set)",
                code=ErrorCode.NOT_FOUND,
            )
        return self.key


@dataclass(frozen=True)
class Attestations:
    """``POST /v1/attest`` when ``[attest] enabled``; otherwise its routes answer 404."""

    service: AttestService | None
    releases: AttestedReleaseService | None = None  # ``POST /v1/release`` on a result
    result_keys: ResultKeys | None = None  # published at /.well-known/jwks.json

    def require(self) -> AttestService:
        """Raises ``NotFound``: attestation results are off here (not a failing dependency)."""
        if self.service is None:
            raise _off()
        return self.service

    def require_releases(self) -> AttestedReleaseService:
        if self.releases is None:
            raise _off()
        return self.releases


def _off() -> NotFound:
    return NotFound(
        "this broker issues no attestation results ([attest] enabled is false)",
        code=ErrorCode.NOT_FOUND,
    )


@dataclass(frozen=True)
class Readiness:
    """``/readyz``: asks each service in turn; static facts come from the set-up."""

    facts: dict[str, str]
    policies: PolicyManager
    policy: PolicyEngine
    decisions: DecisionLog
    keys: KeyService
    nonces: NonceStore
    statements: StatementKey

    async def report(self) -> dict[str, str]:
        """The checks, live.

        Raises:
            UpstreamError: ``not_ready`` naming each service that does not answer.
        """
        checks = {
            **self.facts,
            "policy": self.policy.digest,
            "audit_log": f"{self.decisions.head.size} records",
        }
        reload = self.policies.last_reload
        if reload is not None:
            checks["policy_last_reload"] = (
                f"{'ok' if reload.ok else 'failed'} at {reload.time} ({reload.trigger})"
                + ("" if reload.ok else "; the last good policy is serving")
            )
        problems = []
        try:
            versions = await self.keys.list_versions()
        except UpstreamError:
            problems.append("the key store does not answer")
            versions = []
        query_keys = sorted({v.name for v in versions if v.purpose is Purpose.QUERY})
        try:
            await self.nonces.check()
        except UpstreamError:
            problems.append("the nonce store does not answer")
        if query_keys and self.statements.key is None:
            problems.append(
                f"{len(query_keys)} query key(s) but no [keys] signing_key: their public "
                "halves cannot be published with a signed statement"
            )
        if problems:
            raise UpstreamError(
                "not ready: " + "; ".join(problems), code=ErrorCode.NOT_READY, checks=checks
            )
        return checks


SETTINGS: web.AppKey[Settings] = web.AppKey("settings", Settings)
CLOCK: web.AppKey[Clock] = web.AppKey("clock")
NONCES: web.AppKey[NonceStore] = web.AppKey("nonces")
DECISIONS: web.AppKey[DecisionLog] = web.AppKey("decisions", DecisionLog)
KEYS: web.AppKey[KeyService] = web.AppKey("keys", KeyService)
POLICIES: web.AppKey[PolicyManager] = web.AppKey("policies", PolicyManager)
POLICY: web.AppKey[PolicyEngine] = web.AppKey("policy")
RELEASE: web.AppKey[ReleaseService] = web.AppKey("release", ReleaseService)
CHECKPOINTS: web.AppKey[Checkpoints] = web.AppKey("checkpoints")
STATEMENTS: web.AppKey[StatementKey] = web.AppKey("statements", StatementKey)
READINESS: web.AppKey[Readiness] = web.AppKey("readiness", Readiness)
ATTESTATIONS: web.AppKey[Attestations] = web.AppKey("attestations", Attestations)
