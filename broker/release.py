"""The release path of protocol v1 (DESIGN.md §2), as one service.

Order, for every parsed request:

1. consume the nonce atomically (whatever happens next, it is spent);
2. verify the evidence and its binding to the nonce and the runner key;
3. resolve the key version;
4. normalise claims and evaluate the policy;
5. if allowed, unwrap the DEK and wrap it to the runner key, in memory only;
6. append the decision (allow, deny or error) to the log durably — if that fails, 503 and
   nothing leaves;
7. only then return the wrapped key.

Every outcome after parsing is logged, including failed attestation, so auditors see attempts
as well as releases. The whole sequence runs shielded from cancellation: a client that hangs
up cannot cut "log, then release" in half.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from broker.attestation.claims import RequestFacts, build_input
from broker.attestation.service import EvidenceVerifier, VerifiedEvidence, evidence_digests
from broker.audit.log import DecisionLog, canonical
from broker.crypto.jwk import RunnerKey
from broker.errors import BrokerError, PolicyDenied
from broker.keys.service import KeyService
from broker.keys.store.base import KeyVersionRecord
from broker.keys.wrap import key_id, wrap_to_runner
from broker.metrics import Metrics
from broker.nonces import NonceStore
from broker.policy.engine import Decision, PolicyEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReleaseRequest:
    """A parsed, shape-checked release request (evidence not yet verified)."""

    key: str
    version: int | None
    nonce: str
    unverified_evidence: Mapping[str, Any]
    runner_key: RunnerKey
    wrap: str = "jwe"


@dataclass(frozen=True)
class ReleasedKey:
    key: str
    version: int
    decision_id: str
    wrapped_key: str
    wrap: str = "jwe"
    algorithm: str = "AES-256"


@dataclass
class _Outcome:
    """What the decision record says; filled in as the release proceeds."""

    decision_id: str
    request: ReleaseRequest
    evidence: VerifiedEvidence | None = None
    record: KeyVersionRecord | None = None
    decision: Decision | None = None
    input_digest: str | None = None
    error: BrokerError | None = None


class ReleaseService:
    def __init__(
        self,
        *,
        nonces: NonceStore,
        verifier: EvidenceVerifier,
        keys: KeyService,
        policy: PolicyEngine,
        audit: DecisionLog,
        metrics: Metrics,
    ) -> None:
        self._nonces = nonces
        self._verifier = verifier
        self._keys = keys
        self._policy = policy
        self._audit = audit
        self._metrics = metrics

    @property
    def keys(self) -> KeyService:
        return self._keys

    @property
    def policy(self) -> PolicyEngine:
        return self._policy

    async def release(
        self, request: ReleaseRequest, *, now: datetime, request_id: str
    ) -> ReleasedKey:
        """Run the release; cancellation of the caller does not interrupt it.

        Raises:
            BrokerError: the specific reason, after the decision was logged.
        """
        task = asyncio.ensure_future(self._release(request, now=now, request_id=request_id))
        return await asyncio.shield(task)

    async def _release(
        self, request: ReleaseRequest, *, now: datetime, request_id: str
    ) -> ReleasedKey:
        started = time.perf_counter()
        outcome = _Outcome(decision_id=str(uuid.uuid4()), request=request)
        wrapped: str | None = None
        try:
            wrapped = await self._decide(outcome, now)
        except BrokerError as exc:
            outcome.error = exc
        await self._audit.append(self._record(outcome, now=now, request_id=request_id))
        result = _result(outcome)
        code = outcome.error.code.value if outcome.error else "ok"
        self._metrics.decisions.labels(result, code).inc()
        self._metrics.release_latency.labels(result).observe(time.perf_counter() - started)
        if outcome.error is not None:
            raise outcome.error
        if wrapped is None or outcome.record is None:
            raise RuntimeError("release finished without a wrapped key or a key record")
        return ReleasedKey(
            key=outcome.record.name,
            version=outcome.record.version,
            decision_id=outcome.decision_id,
            wrapped_key=wrapped,
            wrap=outcome.request.wrap,
            algorithm=outcome.record.algorithm.value,
        )

    async def _decide(self, outcome: _Outcome, now: datetime) -> str:
        request = outcome.request
        await self._nonces.consume(request.nonce, now)
        outcome.evidence = await self._verifier.verify(
            request.unverified_evidence,
            nonce=request.nonce,
            thumbprint=request.runner_key.thumbprint,
            now=now,
        )
        outcome.record = record = await self._keys.resolve(request.key, request.version)
        facts = RequestFacts(
            key=record.name,
            version=record.version,
            purpose=record.purpose.value,
            runner_key_thumbprint=request.runner_key.thumbprint,
        )
        policy_input = build_input(
            request=facts,
            tee=outcome.evidence.tee,
            raw_claims=outcome.evidence.raw_claims,
            gpus=outcome.evidence.gpus,
            now=now,
        )
        outcome.input_digest = "sha256:" + hashlib.sha256(canonical(policy_input)).hexdigest()
        outcome.decision = decision = await self._policy.evaluate(policy_input)
        if not decision.allowed:
            raise PolicyDenied(decision.reasons, outcome.decision_id)
        dek = await self._keys.unwrap(record)
        return wrap_to_runner(
            dek,
            request.runner_key,
            name=record.name,
            version=record.version,
            decision_id=outcome.decision_id,
            mode=request.wrap,
        )

    def _record(self, outcome: _Outcome, *, now: datetime, request_id: str) -> dict[str, Any]:
        request = outcome.request
        evidence = outcome.evidence
        error = outcome.error
        record = outcome.record
        return {
            "type": "release",
            "decision_id": outcome.decision_id,
            "request_id": request_id,
            "time": now.isoformat(),
            "path": "broker/release",
            "key": request.key,
            "version": request.version if record is None else record.version,
            "kid": None if record is None else key_id(record.name, record.version),
            "result": _result(outcome),
            "code": error.code.value if error else None,
            "message": error.message if error else None,
            "reasons": [] if outcome.decision is None else list(outcome.decision.reasons),
            "policy_digest": self._policy.digest,
            "input_digest": outcome.input_digest,
            "runner_key_thumbprint": request.runner_key.thumbprint,
            "wrap": request.wrap,
            "evidence_digests": dict(evidence_digests(request.unverified_evidence)),
            "identity": None if evidence is None else dict(evidence.identity),
        }


def _result(outcome: _Outcome) -> str:
    """``allow``; ``deny`` when the requester is at fault (4xx or policy); ``error`` when we or
    an upstream are (5xx)."""
    if outcome.error is None:
        return "allow"
    return "deny" if outcome.error.status < 500 else "error"
