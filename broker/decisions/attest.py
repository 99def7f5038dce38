"""``POST /v1/attest``: the attestation plan. Evidence is verified once and answered with an
attestation result (EAR, ``attestation/ear.py``) bound to two keys the runner made inside the
TEE: a P-256 proof-of-possession key (``cnf.jwk``: every later use comes with a DPoP proof by
it) and an encryption key (keys released on the result are wrapped to it, ``attested_release.py``).

Order, as for a release (``release.py``; the kernel runs it: shielded, total, one
``attestation`` record durable before the answer): the body's shape; the nonce, a challenge
this broker made (no store); the evidence, bound to the nonce and to
``attestation_thumbprint(encryption key, PoP key)``, and only once it verified the nonce spent
atomically; the attestation policy (``data.broker.attest``, same bundle); then the EAR is
signed and stored, and once its record is durable, answered.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from broker.attestation.claims import build_attest_input
from broker.attestation.ear import (
    Submod,
    compact,
    ear_claims,
    signing_input,
    status_of,
    worst_status,
)
from broker.attestation.service import EvidenceVerifier, VerifiedEvidence, evidence_digests
from broker.attestation.stored import AttestationEntry, AttestationStore, note_log_index
from broker.audit.log import Appended
from broker.config import AttestSettings
from broker.core.binding import attestation_thumbprint
from broker.core.errors import ErrorCode, InputError
from broker.core.fields import string_field
from broker.core.records import RecordType
from broker.crypto.jwk import RunnerKey, parse_runner_key
from broker.decisions.kernel import Case, Family, Plan
from broker.decisions.policy import Evaluation, PolicyGate
from broker.decisions.release import Seen
from broker.signers.results import ResultSigner
from broker.stores.nonces import MAX_NONCE_CHARS, NonceStore

log = logging.getLogger(__name__)
RECORD_TYPE = RecordType.ATTESTATION
ATTEST_FIELDS = ("nonce", "evidence", "runner_key", "pop_key")
VERIFIER_BUILD = "sealed-runner-broker"


@dataclass(frozen=True)
class AttestRequest:
    nonce: str
    unverified_evidence: Mapping[str, Any]
    encryption_key: RunnerKey
    pop_key: RunnerKey

    @property
    def binding(self) -> str:
        return attestation_thumbprint(self.encryption_key.thumbprint, self.pop_key.thumbprint)


def parse_attest_request(unverified_body: Mapping[str, Any]) -> AttestRequest:
    """The body's fields, typed; the evidence stays unverified.

    Raises:
        InputError: ``bad_request`` or ``runner_key_invalid`` naming the field.
    """
    pop = parse_runner_key(unverified_body.get("pop_key"))
    if pop.jwk.get("kty") != "EC" or pop.jwk.get("crv") != "P-256":
        raise InputError(
            "pop_key must be an EC P-256 public key", code=ErrorCode.RUNNER_KEY_INVALID
        )
    return AttestRequest(
        nonce=string_field(unverified_body, "nonce", max_chars=MAX_NONCE_CHARS),
        unverified_evidence=unverified_body.get("evidence"),  # type: ignore[arg-type]
        encryption_key=parse_runner_key(unverified_body.get("runner_key")),
        pop_key=pop,
    )


@dataclass(frozen=True)
class Attested:
    token: str  # the signed EAR (compact JWS)
    jti: str
    expires_at: datetime
    log_index: int


@dataclass
class AttestFacts:
    """What the record says, learned as the attestation proceeds."""

    evidence: VerifiedEvidence | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)
    submods: list[Submod] = field(default_factory=list)
    expires_at: datetime | None = None


Body = Mapping[str, Any]
AttestCase = Case[Body, AttestRequest, AttestFacts]


@dataclass(kw_only=True, eq=False)
class AttestPlan(Plan[Body, AttestRequest, AttestFacts, Attested]):
    """An attestation result issued on evidence verified in this request."""

    record_type = RECORD_TYPE
    family = Family.ATTEST
    settings: AttestSettings
    issuer: str  # the results' iss and aud: this broker's audience
    nonces: NonceStore
    verifier: EvidenceVerifier
    policy: PolicyGate
    signer: ResultSigner
    store: AttestationStore
    seen: Seen

    def facts(self) -> AttestFacts:
        return AttestFacts()

    def parse(self, unverified: Body) -> AttestRequest:
        return parse_attest_request(unverified)

    async def decide(self, case: AttestCase, request: AttestRequest) -> Attested:
        facts, now, jti = case.facts, case.now, case.decision_id
        challenge = self.nonces.verify_challenge(request.nonce, now)
        facts.evidence = evidence = await self.verifier.verify(
            request.unverified_evidence, nonce=request.nonce, thumbprint=request.binding, now=now
        )
        await self.nonces.spend_challenge(challenge, now)  # authentic evidence: spent now
        await self.seen(evidence, now)
        policy_input = build_attest_input(
            runner_key_thumbprint=request.encryption_key.thumbprint,
            pop_key_thumbprint=request.pop_key.thumbprint,
            tee=evidence.tee,
            raw_claims=evidence.raw_claims,
            gpus=evidence.gpus,
            now=now,
        )
        decision = await self.policy.allow(facts.evaluation, policy_input, decision_id=jti)
        facts.submods = appraisal(evidence, decision.policy_digest)
        claims = ear_claims(
            issuer=self.issuer,
            audience=self.issuer,
            jti=jti,
            now=now,
            ttl=timedelta(seconds=self.settings.ttl_seconds),
            not_after=earliest_expiry(evidence),
            nonce=request.nonce,
            verifier_build=VERIFIER_BUILD,
            submods=facts.submods,
            pop_jwk=request.pop_key.jwk,
            encryption_jwk=request.encryption_key.jwk,
            policy_digest=decision.policy_digest,
            evidence_digests=evidence_digests(case.unverified.get("evidence")),
            input_digest=facts.evaluation.input_digest,
            legacy=self.settings.legacy_names,
        )
        facts.expires_at = expires_at = datetime.fromtimestamp(claims["exp"], UTC)
        text = signing_input(claims, kid=self.signer.kid)
        token = compact(text, await self.signer.sign(text.encode("ascii")))
        # stored before the record is written: a result is usable only once both exist, and a
        # store that fails makes this an error record and a 503, never a result nobody can use
        await self.store.put(
            AttestationEntry(
                jti=jti,
                expires_at=expires_at,
                pop_thumbprint=request.pop_key.thumbprint,
                policy_input=policy_input,
            )
        )
        return Attested(token, jti, expires_at, log_index=-1)

    async def placed(self, case: AttestCase, answer: Attested, appended: Appended) -> Attested:
        try:  # releases name it; the record is durable and names the jti either way
            await note_log_index(self.store, answer.jti, appended.index, case.now)
        except Exception:  # a store outage or a bug: the allow is durable, the answer leaves
            log.warning(
                "attestation %s: its log index could not be stored", answer.jti, exc_info=True
            )
        return dataclasses.replace(answer, log_index=appended.index)

    def body(self, case: AttestCase) -> dict[str, Any]:
        request, facts = case.request, case.facts
        return {
            "jti": case.decision_id,
            **self.policy.record(facts.evaluation),
            "runner_key_thumbprint": request.encryption_key.thumbprint if request else None,
            "pop_key_thumbprint": request.pop_key.thumbprint if request else None,
            "evidence_digests": evidence_digests(case.unverified.get("evidence")),
            "identity": None if facts.evidence is None else dict(facts.evidence.identity),
            "submods": {s.label: s.status for s in facts.submods},
            "expires_at": None if facts.expires_at is None else facts.expires_at.isoformat(),
        }

    def minimal(self, case: AttestCase) -> dict[str, Any]:
        return {"jti": case.decision_id}


def appraisal(evidence: VerifiedEvidence, policy_digest: str) -> list[Submod]:
    """One submodule per attester, labelled as Trustee labels them (``cpu0``, ``gpu0``…), with
    AR4SI values from what the pipeline verified: 2 (affirming) where a check held, 96
    (contraindicated) where it did not, absent where nothing was checked."""
    tee = evidence.tee
    cpu = {
        "instance-identity": 2,  # a token signed by a configured issuer, bound to this request
        "hardware": 2 if tee.get("technology") not in (None, "none", "unknown") else 96,
        "configuration": 2 if tee.get("debug") is False and tee.get("secure_boot") is True else 96,
    }
    submods = [Submod("cpu0", _tier(cpu), cpu, [policy_digest])]
    for index, gpu in enumerate(evidence.gpus):
        vector = {
            "hardware": 2 if gpu.get("cert_chain") == "valid" else 96,
            "configuration": 2 if gpu.get("cc_mode") == "on" and gpu.get("debug") is False else 96,
            "executables": 2 if gpu.get("measurements") == "match" else 96,
        }
        submods.append(Submod(f"gpu{index}", _tier(vector), vector, [policy_digest]))
    return submods


def earliest_expiry(evidence: VerifiedEvidence) -> datetime | None:
    """The first end among the inputs: every verified token's ``exp`` (NRAS: its overall and
    per-GPU tokens), and for local GPU evidence the first certificate or OCSP answer to lapse
    (``collateral_until``). A result never outlives what it was made from."""
    ends: list[datetime] = []
    for kind, claims in evidence.raw_claims.items():
        if not isinstance(claims, Mapping):
            continue
        tokens = [claims]
        if kind == "nras":
            gpus = claims.get("gpus")
            tokens = [
                claims.get("overall", {}),
                *(gpus.values() if isinstance(gpus, Mapping) else ()),
            ]
        ends += [
            datetime.fromtimestamp(token["exp"], UTC)
            for token in tokens
            if isinstance(token, Mapping) and isinstance(token.get("exp"), int | float)
        ]
        for gpu in claims.get("gpus", []) if kind == "nvidia" else []:
            if isinstance(gpu, Mapping) and isinstance(gpu.get("collateral_until"), str):
                ends.append(datetime.fromisoformat(gpu["collateral_until"]))
    return min(ends) if ends else None


def _tier(vector: Mapping[str, int]) -> str:
    return worst_status(status_of(value) for value in vector.values())
