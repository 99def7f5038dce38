"""``POST /v1/release`` on an attestation result: ``Authorization: DPoP <EAR>`` with a ``DPoP``
proof (RFC 9449) and a list of keys; no evidence is verified again (issue 19).

Order, for every request whose body parsed:

0. the ``Host`` header is a host[:port] (``host_invalid`` otherwise; it is used for nothing
   else); the body's shape (``keys``: 1..``MAX_KEYS`` names, optionally with versions; ``wrap``);
1. the EAR: this broker's result key, ``iss``/``aud``, times (``ear.verify_ear``);
2. the DPoP proof: its key is the EAR's ``cnf.jwk`` (checked before anything else of it), then
   ``htm``, ``htu`` (one of ``[server] public_urls`` + this route, never the request's ``Host``),
   ``iat``, ``ath`` of this EAR, the server's ``DPoP-Nonce`` (when required)
   (``dpop.verify_dpop_proof``);
3. the stored attestation: known, unexpired, not revoked (the shared store: every worker and
   replica sees a revocation at once);
4. the proof's ``jti`` spent in the shared store (a replayed proof: ``dpop_proof_reused``);
5. per key: resolve the version, run the **current** release policy on the attestation's
   stored input with this request's facts, unwrap the DEK and wrap it to the EAR's encryption
   key with the release id, key version and policy digest in the AAD;
6. one ``attested_release`` record (the attestation's jti and log index, the proof's jti, per
   key: version, result, reasons, policy digest, masked input), durable before the answer. Its
   top-level ``result`` is ``allow`` when every key was released, ``partial`` when some were
   and some were not, else ``deny`` (or ``error`` when a failure was the broker's).

Total and shielded like a full-evidence release (``release.py``): whatever fails, one record,
and nothing leaves before it is durable.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.claims import RequestFacts, build_input
from broker.attestation.ear import CLAIM, PresentedEar, verify_ear
from broker.attestation.stored import REVOKED, AttestationEntry, AttestationStore
from broker.attested_request import (
    RELEASE_PATH,
    AttestedRequest,
    KeyAsk,
    Presented,
    check_host,
    parse_attested_request,
    presented_token,
)
from broker.audit.log import DecisionLog
from broker.audit.mask import masked
from broker.audit.outcomes import overall
from broker.core.encoding import canonical
from broker.core.errors import (
    AttestationError,
    BrokerError,
    ErrorCode,
    InternalFailure,
    PolicyDenied,
    UpstreamError,
)
from broker.core.metrics import Metrics
from broker.crypto.dpop import (
    FUTURE_LEEWAY,
    MAX_PROOF_AGE,
    DpopError,
    DpopProof,
    verify_dpop_proof,
)
from broker.crypto.jwk import RunnerKey, parse_runner_key
from broker.crypto.wrap import check_wrap_mode, key_id, wrap_to_runner
from broker.keys.custody import release_from_custody
from broker.keys.service import KeyService
from broker.keys.store.base import KeyVersionRecord
from broker.nonces import NonceStore
from broker.policy.engine import Decision, PolicyEngine

log = logging.getLogger(__name__)
RECORD_TYPE = "attested_release"


@dataclass(frozen=True)
class ReleasedOnResult:
    key: str
    version: int
    wrapped_key: str
    algorithm: str
    policy_digest: str


@dataclass(frozen=True)
class RefusedOnResult:
    key: str
    version: int | None
    error: BrokerError


@dataclass(frozen=True)
class AttestedRelease:
    release_id: str
    attestation: str  # the EAR's jti
    wrap: str
    keys: tuple[ReleasedOnResult | RefusedOnResult, ...]
    log_index: int
    leaf_hash: bytes


@dataclass
class _Key:
    ask: KeyAsk
    record: KeyVersionRecord | None = None
    decision: Decision | None = None
    input_digest: str | None = None
    policy_input: dict[str, Any] | None = None
    wrapped: str | None = None
    error: BrokerError | None = None


@dataclass
class _Outcome:
    release_id: str
    request: AttestedRequest | None = None
    ear: PresentedEar | None = None
    proof: DpopProof | None = None
    entry: AttestationEntry | None = None
    encryption_key: RunnerKey | None = None
    error: BrokerError | None = None  # the request's (nothing released)
    keys: list[_Key] = field(default_factory=list)


ResultKeys = Callable[[], Mapping[str, ec.EllipticCurvePublicKey]]


class AttestedReleaseService:
    def __init__(
        self,
        *,
        issuer: str,
        result_keys: ResultKeys,
        store: AttestationStore,
        nonces: NonceStore,
        keys: KeyService,
        policy: PolicyEngine,
        audit: DecisionLog,
        metrics: Metrics,
        mask_key: bytes,
        public_urls: Sequence[str] = (),
        mask: tuple[str, ...] = (),
        require_nonce: bool = True,
    ) -> None:
        self._issuer = issuer
        # what a proof's htu must name ([server] public_urls): none configured, none accepted
        self._release_urls = tuple(url.rstrip("/") + RELEASE_PATH for url in public_urls)
        self._result_keys = result_keys
        self._store = store
        self._nonces = nonces
        self._keys = keys
        self._policy = policy
        self._audit = audit
        self._metrics = metrics
        self._mask_key = mask_key
        self._mask = mask
        self._require_nonce = require_nonce

    def server_nonce(self, now: datetime) -> str:
        """The ``DPoP-Nonce`` every answer carries (the next proof's)."""
        return self._nonces.server_nonce(now)

    async def release(
        self,
        unverified_body: Mapping[str, Any],
        *,
        presented: Presented,
        now: datetime,
        request_id: str,
    ) -> AttestedRelease:
        """Verify the result and proof, decide per key, log, wrap; cancellation of the caller
        does not interrupt it.

        Raises:
            BrokerError: nothing was released (the request's error, or the first key's), after
                the record was logged; ``details["keys"]`` says each key's code.
        """
        task = asyncio.ensure_future(self._release(unverified_body, presented, now, request_id))
        return await asyncio.shield(task)

    async def _release(
        self,
        unverified_body: Mapping[str, Any],
        presented: Presented,
        now: datetime,
        request_id: str,
    ) -> AttestedRelease:
        started = time.perf_counter()
        outcome = _Outcome(release_id=str(uuid.uuid4()))
        try:
            check_host(presented.host)
            outcome.request = parse_attested_request(unverified_body)
            await self._admit(outcome, presented, now)
            for ask in outcome.request.keys:
                outcome.keys.append(await self._decide_key(outcome, ask, now))
        except BrokerError as exc:
            outcome.error = exc
        except Exception:  # a bug: recorded, nothing released
            log.exception("attested release %s: unexpected failure", outcome.release_id)
            outcome.error = InternalFailure("internal error")
            for key in outcome.keys:  # wrapped but never sent: the record must not say allow
                if key.wrapped is not None:
                    key.wrapped, key.error = None, outcome.error
        appended = await self._audit.append_entry(self._safe_record(outcome, now, request_id))
        for key in outcome.keys:
            result, code = _result(key.error), key.error.code.value if key.error else "ok"
            self._metrics.decisions.labels(result, code).inc()
        if outcome.error is not None:
            self._metrics.decisions.labels(_result(outcome.error), outcome.error.code.value).inc()
        self._metrics.release_latency.labels(_result(outcome.error)).observe(
            time.perf_counter() - started
        )
        released = [k for k in outcome.keys if k.wrapped is not None]
        if outcome.error is not None or not released:
            error = outcome.error or next(k.error for k in outcome.keys if k.error is not None)
            error.details["log_index"] = appended.index
            error.details["release_id"] = outcome.release_id
            if outcome.keys:
                error.details["keys"] = [_key_summary(k) for k in outcome.keys]
            raise error
        if outcome.request is None or outcome.ear is None:
            raise RuntimeError("attested release finished without a request or a result")
        return AttestedRelease(
            release_id=outcome.release_id,
            attestation=outcome.ear.jti,
            wrap=outcome.request.wrap,
            keys=tuple(_answer(k) for k in outcome.keys),
            log_index=appended.index,
            leaf_hash=appended.leaf_hash,
        )

    async def _admit(self, outcome: _Outcome, presented: Presented, now: datetime) -> None:
        """Steps 1 to 4: the result, its proof, its stored state; the proof spent."""
        token = presented_token(presented.authorization)
        outcome.ear = ear = verify_ear(
            token, keys=self._result_keys(), audience=self._issuer, now=now
        )
        outcome.proof = checked = verify_dpop_proof(
            presented.proof,
            method="POST",
            url=self._release_urls,
            now=now,
            access_token=token,
            nonce_valid=(lambda n: self._nonces.server_nonce_valid(n, now))
            if self._require_nonce
            else None,
            bound_to=ear.pop_thumbprint,
        )
        entry = await self._store.get(ear.jti, now)
        if entry is None:
            raise AttestationError(
                "this attestation result is unknown here or expired; attest again",
                code=ErrorCode.ATTESTATION_UNKNOWN,
            )
        outcome.entry = entry
        if entry.status == REVOKED:
            raise AttestationError(
                f"this attestation result was revoked: {entry.reason}",
                code=ErrorCode.ATTESTATION_REVOKED,
                reason=entry.reason,
            )
        outcome.encryption_key = signed_content(ear, entry)
        if outcome.request is not None:
            check_wrap_mode(outcome.request.wrap, outcome.encryption_key)
        try:  # good once, in the store every worker and replica shares
            await self._nonces.spend_jti(
                f"dpop:{ear.pop_thumbprint}:{checked.jti}",
                checked.issued_at + MAX_PROOF_AGE + FUTURE_LEEWAY,
                now,
            )
        except AttestationError as exc:
            if exc.code is not ErrorCode.NONCE_REUSED:
                raise
            raise DpopError(
                "this DPoP proof was already used; sign a new one per request",
                code=ErrorCode.DPOP_PROOF_REUSED,
            ) from exc

    async def _decide_key(self, outcome: _Outcome, ask: KeyAsk, now: datetime) -> _Key:
        """Step 5 for one key; its failure is this key's, the others are still decided."""
        key = _Key(ask)
        entry, encryption_key, request = outcome.entry, outcome.encryption_key, outcome.request
        if entry is None or encryption_key is None or request is None:
            raise RuntimeError("a key decided before its attestation was admitted")
        try:
            key.record = record = await self._keys.resolve(ask.key, ask.version)
            custody = self._keys.check_release(record, request.wrap, encryption_key)
            key.policy_input = policy_input = release_input(
                entry,
                RequestFacts(
                    key=record.name,
                    version=record.version,
                    purpose=record.purpose.value,
                    runner_key_thumbprint=encryption_key.thumbprint,
                ),
                now,
            )
            encoded = canonical(policy_input)
            key.input_digest = "sha256:" + hashlib.sha256(encoded).hexdigest()
            key.decision = decision = await self._policy.evaluate(policy_input, encoded=encoded)
            if not decision.allowed:
                raise PolicyDenied(decision.reasons, outcome.release_id)
            if custody is not None:  # the HSM makes the wrapped key (keys/custody.py)
                key.wrapped = await release_from_custody(
                    custody,
                    record,
                    encryption_key,
                    decision_id=outcome.release_id,
                    policy_digest=decision.policy_digest,
                )
                return key
            dek = await self._keys.unwrap(record)
            key.wrapped = wrap_to_runner(
                dek,
                encryption_key,
                name=record.name,
                version=record.version,
                decision_id=outcome.release_id,
                mode=request.wrap,
                policy_digest=decision.policy_digest,
            )
        except BrokerError as exc:
            key.error = exc
        return key

    def _safe_record(self, outcome: _Outcome, now: datetime, request_id: str) -> dict[str, Any]:
        try:
            return self._record(outcome, now, request_id)
        except Exception:
            log.exception("attested release %s: building the record failed", outcome.release_id)
            outcome.error = InternalFailure("internal error")
            for key in outcome.keys:
                key.wrapped = None
            return {
                "type": RECORD_TYPE,
                "decision_id": outcome.release_id,
                "request_id": request_id,
                "time": now.isoformat(),
                "result": "error",
                "code": ErrorCode.INTERNAL.value,
            }

    def _record(self, outcome: _Outcome, now: datetime, request_id: str) -> dict[str, Any]:
        entry, ear, proof, error = outcome.entry, outcome.ear, outcome.proof, outcome.error
        results = [_result(k.error) for k in outcome.keys]
        result = _result(error) if error is not None or not results else overall(results)
        return {
            "type": RECORD_TYPE,
            "decision_id": outcome.release_id,
            "request_id": request_id,
            "time": now.isoformat(),
            "result": result,
            "code": error.code.value if error else None,
            "message": error.message if error else None,
            "attestation": {
                "jti": None if ear is None else ear.jti,
                "log_index": None if entry is None else entry.log_index,
            },
            "dpop_jti": None if proof is None else proof.jti,
            "pop_key_thumbprint": None if ear is None else ear.pop_thumbprint,
            "runner_key_thumbprint": None
            if outcome.encryption_key is None
            else outcome.encryption_key.thumbprint,
            "wrap": None if outcome.request is None else outcome.request.wrap,
            # who asked: the attestation's identity, once its stored entry matched the signed
            # result (OCSF's actor, `audit query --image/--project`)
            "identity": None
            if entry is None or outcome.encryption_key is None
            else attestation_identity(entry),
            "asked": []
            if outcome.request is None
            else [{"key": a.key, "version": a.version} for a in outcome.request.keys],
            "keys": [self._key_record(k) for k in outcome.keys],
        }

    def _key_record(self, key: _Key) -> dict[str, Any]:
        record, decision, error = key.record, key.decision, key.error
        return {
            "key": key.ask.key,
            "version": key.ask.version if record is None else record.version,
            "kid": None if record is None else key_id(record.name, record.version),
            "result": _result(error),
            "code": error.code.value if error else None,
            "message": error.message if error else None,
            "reasons": [] if decision is None else list(decision.reasons),
            "policy_digest": self._policy.digest if decision is None else decision.policy_digest,
            "input_digest": key.input_digest,
            "input": None
            if key.policy_input is None
            else masked(
                key.policy_input,
                (*self._mask, *(decision.mask if decision is not None else ())),
                self._mask_key,
            ),
        }


def signed_content(ear: PresentedEar, entry: AttestationEntry) -> RunnerKey:
    """The encryption key the signed result names, once the store's entry is shown to be the
    one the result was made with: its PoP thumbprint, and the digest of its claims (the EAR's
    ``input_digest``). The shared store is trusted for a result's status, never for what a
    release is decided on or wrapped to.

    Raises:
        AttestationError: the result lacks its broker claim (``token_claim_invalid``).
        UpstreamError: ``attestation_store_mismatch``: the entry is not what was signed.
    """
    own = ear.claims.get(CLAIM)
    if not isinstance(own, Mapping) or not isinstance(own.get("encryption_key"), Mapping):
        raise AttestationError(
            "the result lacks this broker's claim", code=ErrorCode.TOKEN_CLAIM_INVALID
        )
    stored = "sha256:" + hashlib.sha256(canonical(entry.policy_input)).hexdigest()
    if entry.pop_thumbprint != ear.pop_thumbprint or own.get("input_digest") != stored:
        log.error("attestation %s: the stored entry does not match the signed result", ear.jti)
        raise UpstreamError(
            "the stored attestation does not match the signed result; attest again",
            code=ErrorCode.ATTESTATION_STORE_MISMATCH,
        )
    return parse_runner_key(dict(own["encryption_key"]))


def attestation_identity(entry: AttestationEntry) -> dict[str, Any]:
    """The attestation a release came through, as records name a runner: its jti, and the
    workload, project and instance its verified claims named."""
    tee = entry.policy_input.get("tee")
    tee = tee if isinstance(tee, Mapping) else {}
    workload, platform = tee.get("workload"), tee.get("platform")
    workload = workload if isinstance(workload, Mapping) else {}
    platform = platform if isinstance(platform, Mapping) else {}
    return {
        "attestation": entry.jti,
        "issuer": tee.get("issuer"),
        "image_digest": workload.get("image_digest"),
        "project_id": platform.get("project_id"),
        "instance_id": platform.get("instance_id"),
    }


def release_input(entry: AttestationEntry, facts: RequestFacts, now: datetime) -> dict[str, Any]:
    """The release policy's input for a key asked on a stored attestation: the input a
    full-evidence release would have had (the same claims, normalised when they were verified),
    at ``now``, with ``request.attestation`` naming the result it came through."""
    stored = entry.policy_input
    policy_input = build_input(
        request=facts,
        tee=stored.get("tee", {}),
        raw_claims=stored.get("claims", {}),
        gpus=stored.get("gpus", []),
        now=now,
    )
    policy_input["request"]["attestation"] = {
        "jti": entry.jti,
        "expires_at": entry.expires_at.isoformat(),
    }
    return policy_input


def _result(error: BrokerError | None) -> str:
    if error is None:
        return "allow"
    return "deny" if error.status < 500 else "error"


def _key_summary(key: _Key) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "key": key.ask.key,
        "code": key.error.code.value if key.error else "ok",
    }
    if isinstance(key.error, PolicyDenied):
        summary["reasons"] = key.error.details.get("reasons", [])
    return summary


def _answer(key: _Key) -> ReleasedOnResult | RefusedOnResult:
    if key.wrapped is not None and key.record is not None and key.decision is not None:
        return ReleasedOnResult(
            key=key.record.name,
            version=key.record.version,
            wrapped_key=key.wrapped,
            algorithm=key.record.algorithm.value,
            policy_digest=key.decision.policy_digest,
        )
    error = key.error or InternalFailure("internal error")
    return RefusedOnResult(key.ask.key, None if key.record is None else key.record.version, error)
