"""``POST /v1/release`` with full evidence (protocol v1, docs/api.md): the release plan.

Order, for every request body that parsed as a JSON object (the kernel, ``kernel.py``, runs it:
shielded, total, one ``release`` record durable before the answer):

0. check the body's shape (key name, version, nonce, runner key, wrap) — a malformed request
   is a ``deny`` record like any other, its nonce untouched (it cannot be trusted to name one);
1. check the nonce is a challenge this broker made and that has not expired (a MAC: no store);
2. verify the evidence and its binding to the nonce and the runner key, then spend the nonce
   atomically (whatever happens next, it is spent): forged or garbage evidence spends nothing,
   so junk releases carrying fresh challenges cannot fill the spent-nonce store;
3. resolve the key version and check it can be released with this wrap;
4. normalise claims and evaluate the policy (``policy.py``);
5. if allowed, unwrap the DEK and wrap it to the runner key, in memory only (``wrapping.py``);
6. the kernel appends the decision (allow, deny or error) durably — if that fails, 503 and
   nothing leaves — and only then returns the wrapped key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.attestation.claims import build_input
from broker.attestation.service import EvidenceVerifier, VerifiedEvidence, evidence_digests
from broker.audit.log import Appended
from broker.core.errors import InputError
from broker.core.fields import optional_version, string_field
from broker.core.records import RecordType
from broker.crypto.jwk import RunnerKey, parse_runner_key
from broker.crypto.wrap import WRAP_MODES, check_wrap_mode, key_id
from broker.decisions.kernel import Case, Plan
from broker.decisions.policy import Evaluation, PolicyGate
from broker.decisions.wrapping import request_facts, wrap_for_runner
from broker.keys.service import MAX_KEY_NAME, KeyService, validate_key_name
from broker.keys.store.base import KeyVersionRecord
from broker.stores.nonces import MAX_NONCE_CHARS, NonceStore

RECORD_TYPE = RecordType.RELEASE
RELEASE_FIELDS = ("key", "nonce", "evidence", "runner_key")
RELEASE_OPTIONAL = ("version", "wrap")
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
class ReleaseFacts:
    """What the record says, learned as the release proceeds."""

    evidence: VerifiedEvidence | None = None
    record: KeyVersionRecord | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)


Body = Mapping[str, Any]
ReleaseCase = Case[Body, ReleaseRequest, ReleaseFacts]


@dataclass(kw_only=True, eq=False)
class ReleasePlan(Plan[Body, ReleaseRequest, ReleaseFacts, ReleasedKey]):
    """A key released on evidence verified in this request (steps 0 to 5 above)."""

    record_type = RECORD_TYPE
    nonces: NonceStore
    verifier: EvidenceVerifier
    keys: KeyService
    policy: PolicyGate
    seen: Seen | None = None

    def facts(self) -> ReleaseFacts:
        return ReleaseFacts()

    def parse(self, unverified: Body) -> ReleaseRequest:
        return parse_release_request(unverified)

    async def decide(self, case: ReleaseCase, request: ReleaseRequest) -> ReleasedKey:
        facts, now, lap = case.facts, case.now, case.watch.lap
        challenge = self.nonces.verify_challenge(request.nonce, now)
        facts.evidence = evidence = await self.verifier.verify(
            request.unverified_evidence,
            nonce=request.nonce,
            thumbprint=request.runner_key.thumbprint,
            now=now,
        )
        lap("evidence")
        await self.nonces.spend_challenge(challenge, now)  # authentic evidence: spent now
        lap("nonce")
        if self.seen is not None:  # what OCSP revoked revokes attestation results too
            await self.seen(evidence, now)
        facts.record = record = await self.keys.resolve(request.key, request.version)
        custody = self.keys.check_release(record, request.wrap, request.runner_key)
        lap("key")
        policy_input = build_input(
            request=request_facts(record, request.runner_key),
            tee=evidence.tee,
            raw_claims=evidence.raw_claims,
            gpus=evidence.gpus,
            now=now,
        )
        await self.policy.allow(facts.evaluation, policy_input, decision_id=case.decision_id)
        lap("policy")
        wrapped = await wrap_for_runner(
            self.keys,
            record,
            custody,
            request.runner_key,
            decision_id=case.decision_id,
            mode=request.wrap,
            lap=lap,
        )
        return ReleasedKey(
            key=record.name,
            version=record.version,
            decision_id=case.decision_id,
            wrapped_key=wrapped,
            wrap=request.wrap,
            algorithm=record.algorithm.value,
        )

    async def placed(
        self, case: ReleaseCase, answer: ReleasedKey, appended: Appended
    ) -> ReleasedKey:
        return dataclasses.replace(
            answer,
            log_index=appended.index,
            leaf_hash=appended.leaf_hash,
            stages=tuple(case.watch.stages),
        )

    def body(self, case: ReleaseCase) -> dict[str, Any]:
        """Built from whatever the release learned; a field of a request that failed its shape
        check is shown only if it is a short printable string."""
        request, unverified, facts = case.request, case.unverified, case.facts
        evidence, record = facts.evidence, facts.record
        return {
            "path": "broker/release",
            "key": request.key if request else _loggable_string(unverified.get("key")),
            "version": (request.version if request else None) if record is None else record.version,
            "kid": None if record is None else key_id(record.name, record.version),
            **self.policy.record(facts.evaluation),
            "runner_key_thumbprint": request.runner_key.thumbprint if request else None,
            "wrap": request.wrap if request else _loggable_string(unverified.get("wrap")),
            "evidence_digests": evidence_digests(unverified.get("evidence")),
            "identity": None if evidence is None else dict(evidence.identity),
        }


def _loggable_string(value: Any) -> str | None:
    """A field of a request that failed its shape check, as the record shows it: a short
    printable string, or nothing (a hostile value is not copied into the log)."""
    if isinstance(value, str) and len(value) <= MAX_KEY_NAME and value.isprintable():
        return value
    return None
