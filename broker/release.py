"""The release path of protocol v1 (docs/api.md), as one service.

Order, for every request body that parsed as a JSON object:

0. check the body's shape (key name, version, nonce, runner key, wrap) — a malformed request
   is a ``deny`` record like any other, its nonce untouched (it cannot be trusted to name one);
1. check the nonce is a challenge this broker made and that has not expired (a MAC: no store);
2. verify the evidence and its binding to the nonce and the runner key, then spend the nonce
   atomically (whatever happens next, it is spent): forged or garbage evidence spends nothing,
   so junk releases carrying fresh challenges cannot fill the spent-nonce store;
3. resolve the key version;
4. normalise claims and evaluate the policy;
5. if allowed, unwrap the DEK and wrap it to the runner key, in memory only;
6. append the decision (allow, deny or error) to the log durably — if that fails, 503 and
   nothing leaves;
7. only then return the wrapped key.

The release is total: every outcome ends in exactly one record, ``allow``, ``deny`` (a 4xx:
the caller's fault, with its code) or ``error`` (a 5xx: ours or an upstream's). An exception
that is not a ``BrokerError`` is a bug; it is still recorded (``internal_error``) and nothing
is released. The whole sequence runs shielded from cancellation: a client that hangs up cannot
cut "log, then release" in half.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.attestation.claims import RequestFacts, build_input
from broker.attestation.service import EvidenceVerifier, VerifiedEvidence, evidence_digests
from broker.audit.log import DecisionLog
from broker.audit.mask import masked
from broker.core.encoding import canonical
from broker.core.errors import BrokerError, ErrorCode, InputError, InternalFailure, PolicyDenied
from broker.core.fields import optional_version, string_field
from broker.core.metrics import Metrics
from broker.crypto.jwk import RunnerKey, parse_runner_key
from broker.crypto.wrap import WRAP_MODES, check_wrap_mode, key_id, wrap_to_runner
from broker.keys.custody import release_from_custody
from broker.keys.service import MAX_KEY_NAME, KeyService, validate_key_name
from broker.keys.store.base import KeyVersionRecord
from broker.nonces import MAX_NONCE_CHARS, NonceStore
from broker.policy.engine import Decision, PolicyEngine

log = logging.getLogger(__name__)
# told of each verified evidence: attestation results that used a revoked GPU or RIM are revoked
Seen = Callable[[VerifiedEvidence, datetime], Awaitable[None]]


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
    log_index: int = -1  # the decision record's leaf index
    leaf_hash: bytes = b""  # its RFC 6962 leaf hash: the runner can prove its inclusion
    stages: tuple[tuple[str, float], ...] = ()  # (stage, seconds), in order: where the time went


RELEASE_FIELDS = ("key", "nonce", "evidence", "runner_key")
RELEASE_OPTIONAL = ("version", "wrap")


def parse_release_request(unverified_body: Mapping[str, Any]) -> ReleaseRequest:
    """Step 0: the body's fields, typed. Evidence stays unverified.

    Raises:
        InputError: ``bad_request`` or ``runner_key_invalid`` naming the field.
    """
    wrap = unverified_body.get("wrap", "jwe")
    if not isinstance(wrap, str) or wrap not in WRAP_MODES:
        raise InputError(f"wrap must be one of {', '.join(WRAP_MODES)}")
    parsed = ReleaseRequest(
        key=validate_key_name(string_field(unverified_body, "key", max_chars=MAX_KEY_NAME)),
        version=optional_version(unverified_body),
        nonce=string_field(unverified_body, "nonce", max_chars=MAX_NONCE_CHARS),
        unverified_evidence=unverified_body.get("evidence"),  # type: ignore[arg-type]
        runner_key=parse_runner_key(unverified_body.get("runner_key")),
        wrap=wrap,
    )
    check_wrap_mode(wrap, parsed.runner_key)
    return parsed


@dataclass
class _Outcome:
    """What the decision record says; filled in as the release proceeds."""

    decision_id: str
    unverified_body: Mapping[str, Any]
    request: ReleaseRequest | None = None
    evidence: VerifiedEvidence | None = None
    record: KeyVersionRecord | None = None
    decision: Decision | None = None
    input_digest: str | None = None
    policy_input: dict[str, Any] | None = None
    error: BrokerError | None = None
    stages: list[tuple[str, float]] = field(default_factory=list)
    _mark: float = field(default_factory=time.perf_counter)

    def lap(self, stage: str) -> None:
        """The time since the previous lap (or the start) belongs to ``stage``."""
        now = time.perf_counter()
        self.stages.append((stage, now - self._mark))
        self._mark = now


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
        mask_key: bytes,
        mask: tuple[str, ...] = (),
        seen: Seen | None = None,
    ) -> None:
        self._seen = seen
        self._nonces = nonces
        self._verifier = verifier
        self._keys = keys
        self._policy = policy
        self._audit = audit
        self._metrics = metrics
        self._mask = mask
        self._mask_key = mask_key

    async def release(
        self, unverified_body: Mapping[str, Any], *, now: datetime, request_id: str
    ) -> ReleasedKey:
        """Parse, verify, decide, log and wrap; cancellation of the caller does not interrupt it.

        Raises:
            BrokerError: the specific reason, after the decision was logged.
        """
        task = asyncio.ensure_future(self._release(unverified_body, now=now, request_id=request_id))
        return await asyncio.shield(task)

    async def _release(
        self, unverified_body: Mapping[str, Any], *, now: datetime, request_id: str
    ) -> ReleasedKey:
        started = time.perf_counter()
        outcome = _Outcome(decision_id=str(uuid.uuid4()), unverified_body=unverified_body)
        wrapped: str | None = None
        try:
            outcome.request = parse_release_request(unverified_body)
            outcome.lap("parse")
            wrapped = await self._decide(outcome, outcome.request, now)
        except BrokerError as exc:
            outcome.error = exc
        except Exception:  # a bug: recorded, nothing released, details only in the server log
            log.exception("release %s: unexpected failure", outcome.decision_id)
            outcome.error = InternalFailure("internal error")
        record = self._safe_record(outcome, now=now, request_id=request_id)
        outcome.lap("record")
        appended = await self._audit.append_entry(record)
        outcome.lap("log")
        result = _result(outcome)
        code = outcome.error.code.value if outcome.error else "ok"
        self._metrics.decisions.labels(result, code).inc()
        self._metrics.release_latency.labels(result).observe(time.perf_counter() - started)
        if outcome.error is not None:
            outcome.error.details["log_index"] = appended.index  # ask for its inclusion proof
            raise outcome.error
        if wrapped is None or outcome.record is None or outcome.request is None:
            raise RuntimeError("release finished without a wrapped key or a key record")
        return ReleasedKey(
            key=outcome.record.name,
            version=outcome.record.version,
            decision_id=outcome.decision_id,
            wrapped_key=wrapped,
            wrap=outcome.request.wrap,
            algorithm=outcome.record.algorithm.value,
            log_index=appended.index,
            leaf_hash=appended.leaf_hash,
            stages=tuple(outcome.stages),
        )

    async def _decide(self, outcome: _Outcome, request: ReleaseRequest, now: datetime) -> str:
        challenge = self._nonces.verify_challenge(request.nonce, now)
        outcome.evidence = await self._verifier.verify(
            request.unverified_evidence,
            nonce=request.nonce,
            thumbprint=request.runner_key.thumbprint,
            now=now,
        )
        outcome.lap("evidence")
        await self._nonces.spend_challenge(challenge, now)  # authentic evidence: spent now
        outcome.lap("nonce")
        if self._seen is not None:  # what OCSP revoked revokes attestation results too
            await self._seen(outcome.evidence, now)
        outcome.record = record = await self._keys.resolve(request.key, request.version)
        custody = self._keys.check_release(record, request.wrap, request.runner_key)
        outcome.lap("key")
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
        encoded = canonical(policy_input)  # digested, and the very bytes the policy reads
        outcome.input_digest = "sha256:" + hashlib.sha256(encoded).hexdigest()
        outcome.policy_input = policy_input
        outcome.decision = decision = await self._policy.evaluate(policy_input, encoded=encoded)
        outcome.lap("policy")
        if not decision.allowed:
            raise PolicyDenied(decision.reasons, outcome.decision_id)
        if custody is not None:  # the HSM unwraps and wraps in one call: timed as "wrap"
            outcome.lap("unwrap")
            wrapped = await release_from_custody(
                custody, record, request.runner_key, decision_id=outcome.decision_id
            )
            outcome.lap("wrap")
            return wrapped
        dek = await self._keys.unwrap(record)
        outcome.lap("unwrap")
        wrapped = wrap_to_runner(
            dek,
            request.runner_key,
            name=record.name,
            version=record.version,
            decision_id=outcome.decision_id,
            mode=request.wrap,
        )
        outcome.lap("wrap")
        return wrapped

    def _safe_record(self, outcome: _Outcome, *, now: datetime, request_id: str) -> dict[str, Any]:
        """``_record``, and if building it fails (a bug), a minimal record and no release."""
        try:
            return self._record(outcome, now=now, request_id=request_id)
        except Exception:
            log.exception("release %s: building the record failed", outcome.decision_id)
            outcome.error = InternalFailure("internal error")
            return {
                "type": "release",
                "decision_id": outcome.decision_id,
                "request_id": request_id,
                "time": now.isoformat(),
                "result": "error",
                "code": ErrorCode.INTERNAL.value,
            }

    def _record(self, outcome: _Outcome, *, now: datetime, request_id: str) -> dict[str, Any]:
        """The decision record. Total: built from whatever the release learned, never raising."""
        request = outcome.request
        body = outcome.unverified_body
        evidence = outcome.evidence
        error = outcome.error
        record = outcome.record
        return {
            "type": "release",
            "decision_id": outcome.decision_id,
            "request_id": request_id,
            "time": now.isoformat(),
            "path": "broker/release",
            "key": request.key if request else _loggable_string(body.get("key")),
            "version": (request.version if request else None) if record is None else record.version,
            "kid": None if record is None else key_id(record.name, record.version),
            "result": _result(outcome),
            "code": error.code.value if error else None,
            "message": error.message if error else None,
            "reasons": [] if outcome.decision is None else list(outcome.decision.reasons),
            # the digest of the engine that decided (a reload during the key unwrap must not
            # attribute this decision to its successor); no decision: the policy in force
            "policy_digest": self._policy.digest
            if outcome.decision is None
            else outcome.decision.policy_digest,
            "input_digest": outcome.input_digest,
            "runner_key_thumbprint": request.runner_key.thumbprint if request else None,
            "wrap": request.wrap if request else _loggable_string(body.get("wrap")),
            "evidence_digests": evidence_digests(body.get("evidence")),
            "identity": None if evidence is None else dict(evidence.identity),
            # the policy input, masked, so that `broker policy replay` can re-decide it
            "input": None
            if outcome.policy_input is None
            else masked(
                outcome.policy_input,
                (*self._mask, *(outcome.decision.mask if outcome.decision is not None else ())),
                self._mask_key,
            ),
        }


def _loggable_string(value: Any) -> str | None:
    """A field of a request that failed its shape check, as the record shows it: a short
    printable string, or nothing (a hostile value is not copied into the log)."""
    if isinstance(value, str) and len(value) <= MAX_KEY_NAME and value.isprintable():
        return value
    return None


def _result(outcome: _Outcome) -> str:
    """``allow``; ``deny`` when the requester is at fault (4xx or policy); ``error`` when we or
    an upstream are (5xx)."""
    if outcome.error is None:
        return "allow"
    return "deny" if outcome.error.status < 500 else "error"
