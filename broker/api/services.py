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

from broker.api.readiness import Readiness
from broker.audit.log import DecisionLog
from broker.config import Settings
from broker.core.errors import ErrorCode, NotFound
from broker.decisions.attest import AttestPlan
from broker.decisions.attested_release import AttestedReleasePlan
from broker.decisions.identity import IdentityPlan
from broker.decisions.kernel import Kernel
from broker.decisions.release import ReleasePlan
from broker.decisions.results import AttestationResults
from broker.keys.service import KeyService
from broker.policy.engine import PolicyEngine
from broker.policy.manager import PolicyManager
from broker.signers.results import ResultKeys
from broker.stores.nonces import NonceStore

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

    service: AttestationResults | None  # issued results: status, revocation, re-decision
    attest: AttestPlan | None = None  # ``POST /v1/attest``
    releases: AttestedReleasePlan | None = None  # ``POST /v1/release`` on a result
    result_keys: ResultKeys | None = None  # published at /.well-known/jwks.json
    identity: IdentityPlan | None = None  # ``POST /v1/identity`` when ``[identity] enabled``

    def require(self) -> AttestationResults:
        """Raises ``NotFound``: attestation results are off here (not a failing dependency)."""
        if self.service is None:
            raise _off()
        return self.service

    def require_attest(self) -> AttestPlan:
        if self.attest is None:
            raise _off()
        return self.attest

    def require_releases(self) -> AttestedReleasePlan:
        if self.releases is None:
            raise _off()
        return self.releases

    def require_identity(self) -> IdentityPlan:
        """Raises ``NotFound``: workload certificates are off here."""
        if self.identity is None:
            raise NotFound(
                "this broker issues no workload certificates ([identity] enabled is false)",
                code=ErrorCode.NOT_FOUND,
            )
        return self.identity


def _off() -> NotFound:
    return NotFound(
        "this broker issues no attestation results ([attest] enabled is false)",
        code=ErrorCode.NOT_FOUND,
    )


SETTINGS: web.AppKey[Settings] = web.AppKey("settings", Settings)
CLOCK: web.AppKey[Clock] = web.AppKey("clock")
NONCES: web.AppKey[NonceStore] = web.AppKey("nonces")
DECISIONS: web.AppKey[DecisionLog] = web.AppKey("decisions", DecisionLog)
KEYS: web.AppKey[KeyService] = web.AppKey("keys", KeyService)
POLICIES: web.AppKey[PolicyManager] = web.AppKey("policies", PolicyManager)
POLICY: web.AppKey[PolicyEngine] = web.AppKey("policy")
KERNEL: web.AppKey[Kernel] = web.AppKey("kernel", Kernel)  # runs every decision plan
RELEASE: web.AppKey[ReleasePlan] = web.AppKey("release", ReleasePlan)
CHECKPOINTS: web.AppKey[Checkpoints] = web.AppKey("checkpoints")
STATEMENTS: web.AppKey[StatementKey] = web.AppKey("statements", StatementKey)
READINESS: web.AppKey[Readiness] = web.AppKey("readiness", Readiness)
ATTESTATIONS: web.AppKey[Attestations] = web.AppKey("attestations", Attestations)
