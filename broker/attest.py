"""``POST /v1/attest``: verify a runner's evidence once and answer an attestation result (EAR,
``attestation/ear.py``) bound to two keys the runner made inside the TEE: a P-256
proof-of-possession key (``cnf.jwk``: every later use comes with a DPoP proof by it) and an
encryption key (keys released on the result are wrapped to it). Issue 19; releasing keys on a
result is not wired yet.

Order, as for a release (``release.py``): the body's shape; the nonce, a challenge this broker
made (no store); the evidence, bound to the nonce and to ``attestation_thumbprint(encryption
key, PoP key)``, and only once it verified the nonce spent atomically; the attestation policy
(``data.broker.attest``, same bundle); then the EAR is signed, its record appended durably, and
only then answered. Every request whose body parsed ends in exactly one
``attestation`` record (``allow``, ``deny`` or ``error``); the whole sequence is shielded from
the client hanging up.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

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
from broker.attestation.stored import (
    AttestationEntry,
    AttestationStore,
    note_log_index,
    revoke,
    revoked_sightings,
    used_by,
)
from broker.audit.log import DecisionLog
from broker.audit.mask import masked
from broker.config import AttestSettings
from broker.core.binding import attestation_thumbprint
from broker.core.encoding import canonical
from broker.core.errors import (
    BrokerError,
    ConfigError,
    ErrorCode,
    InputError,
    InternalFailure,
    NotFound,
    PolicyDenied,
)
from broker.core.fields import string_field
from broker.crypto.jwk import RunnerKey, parse_runner_key, public_jwk, thumbprint
from broker.crypto.keyfiles import p256_private_key_file, p256_public_key_file
from broker.nonces import MAX_NONCE_CHARS, NonceStore
from broker.policy.engine import Decision, PolicyEngine

log = logging.getLogger(__name__)
ATTEST_FIELDS = ("nonce", "evidence", "runner_key", "pop_key")
VERIFIER_BUILD = "sealed-runner-broker"
SWEEP_INTERVAL = timedelta(seconds=30)  # a revoked device's results are looked for once per this


class ResultSigner(Protocol):
    """What signs attestation results (ES256); its public half is at ``/.well-known/jwks.json``."""

    @property
    def kid(self) -> str:
        """The RFC 7638 thumbprint of ``jwk``: the EAR header's ``kid``."""
        ...

    @property
    def jwk(self) -> Mapping[str, str]: ...

    async def sign(self, data: bytes) -> bytes:
        """R || S of ``data``."""
        ...

    def jwks(self) -> dict[str, Any]: ...


def result_jwks(jwk: Mapping[str, str], kid: str) -> dict[str, Any]:
    return {"keys": [{**jwk, "kid": kid, "alg": "ES256", "use": "sig"}]}


@dataclass(frozen=True)
class ResultKeys:
    """The keys results are verified with, by ``kid``: the signer's, and the previous keys a
    rotation retired (``[attest] previous_keys``) until the results they signed expire; all
    are published at ``/.well-known/jwks.json``."""

    verifying: Mapping[str, ec.EllipticCurvePublicKey]
    jwks: dict[str, Any]


def result_keys(signer: ResultSigner, previous: Sequence[Path]) -> ResultKeys:
    """Raises: ConfigError naming a previous key that is not a P-256 PEM (public or private)."""
    jwks = signer.jwks()
    verifying = {signer.kid: _public_key(signer.jwk)}
    for path in previous:
        key = p256_public_key_file(path, "attest.previous_keys")
        jwk = public_jwk(key)
        kid = thumbprint(jwk)
        if kid not in verifying:
            verifying[kid] = key
            jwks["keys"].extend(result_jwks(jwk, kid)["keys"])
    return ResultKeys(verifying, jwks)


def _public_key(jwk: Mapping[str, str]) -> ec.EllipticCurvePublicKey:
    key = parse_runner_key(dict(jwk)).key
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ConfigError("attest.signing_key", "must be an EC P-256 key")
    return key


class LocalResultSigner:
    """An EC P-256 PEM file (``[attest] signing_key = "PATH"``): development and tests; in
    production the key lives in Cloud KMS (``attest_kms.py``)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey) -> None:
        if key.curve.name != "secp256r1":
            raise ConfigError("attest.signing_key", "must be an EC P-256 private key")
        self._key = key
        self.jwk = public_jwk(key.public_key())
        self.kid = thumbprint(self.jwk)

    @classmethod
    def from_pem(cls, path: Path) -> LocalResultSigner:
        """Raises: ConfigError naming the key when the file is unreadable or not P-256."""
        return cls(p256_private_key_file(path, "attest.signing_key"))

    async def sign(self, data: bytes) -> bytes:
        """ES256: R || S of the signing input (a local key: microseconds, on the loop)."""
        r, s = decode_dss_signature(self._key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")

    def jwks(self) -> dict[str, Any]:
        return result_jwks(self.jwk, self.kid)


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
class _Outcome:
    jti: str
    unverified_body: Mapping[str, Any]
    request: AttestRequest | None = None
    evidence: VerifiedEvidence | None = None
    decision: Decision | None = None
    input_digest: str | None = None
    policy_input: dict[str, Any] | None = None
    submods: list[Submod] = field(default_factory=list)
    expires_at: datetime | None = None
    error: BrokerError | None = None
    evidence_digests: dict[str, str] = field(default_factory=dict)


class AttestService:
    def __init__(
        self,
        *,
        settings: AttestSettings,
        issuer: str,
        nonces: NonceStore,
        verifier: EvidenceVerifier,
        policy: PolicyEngine,
        audit: DecisionLog,
        signer: ResultSigner,
        store: AttestationStore,
        mask_key: bytes,
        mask: tuple[str, ...] = (),
    ) -> None:
        self._settings = settings
        self.store = store
        self._issuer = issuer
        self._nonces = nonces
        self._verifier = verifier
        self._policy = policy
        self._audit = audit
        self.signer = signer
        self._mask_key = mask_key
        self._mask = mask
        self._swept: dict[str, datetime] = {}  # revoked device/RIM -> when results were swept

    async def attest(
        self, unverified_body: Mapping[str, Any], *, now: datetime, request_id: str
    ) -> Attested:
        """Verify, decide, sign, log; cancellation of the caller does not interrupt it.

        Raises:
            BrokerError: the specific reason, after the decision was logged.
        """
        task = asyncio.ensure_future(self._attest(unverified_body, now=now, request_id=request_id))
        return await asyncio.shield(task)

    async def _attest(
        self, unverified_body: Mapping[str, Any], *, now: datetime, request_id: str
    ) -> Attested:
        outcome = _Outcome(
            jti=str(uuid.uuid4()),
            unverified_body=unverified_body,
            evidence_digests=evidence_digests(unverified_body.get("evidence")),
        )
        token: str | None = None
        try:
            outcome.request = parse_attest_request(unverified_body)
            token = await self._decide(outcome, outcome.request, now)
        except BrokerError as exc:
            outcome.error = exc
        except Exception:  # a bug: recorded, nothing answered but internal_error
            log.exception("attestation %s: unexpected failure", outcome.jti)
            outcome.error = InternalFailure("internal error")
        appended = await self._audit.append_entry(self._safe_record(outcome, now, request_id))
        if outcome.error is not None:
            outcome.error.details["log_index"] = appended.index
            raise outcome.error
        if token is None or outcome.expires_at is None:
            raise RuntimeError("attestation finished without a result")
        try:  # releases name it; the record is durable and names the jti either way
            await note_log_index(self.store, outcome.jti, appended.index, now)
        except BrokerError:
            log.warning("attestation %s: its log index could not be stored", outcome.jti)
        return Attested(token, outcome.jti, outcome.expires_at, appended.index)

    async def _decide(self, outcome: _Outcome, request: AttestRequest, now: datetime) -> str:
        challenge = self._nonces.verify_challenge(request.nonce, now)
        outcome.evidence = evidence = await self._verifier.verify(
            request.unverified_evidence, nonce=request.nonce, thumbprint=request.binding, now=now
        )
        await self._nonces.spend_challenge(challenge, now)  # authentic evidence: spent now
        await self.seen(evidence, now)
        policy_input = build_attest_input(
            runner_key_thumbprint=request.encryption_key.thumbprint,
            pop_key_thumbprint=request.pop_key.thumbprint,
            tee=evidence.tee,
            raw_claims=evidence.raw_claims,
            gpus=evidence.gpus,
            now=now,
        )
        encoded = canonical(policy_input)
        outcome.input_digest = "sha256:" + hashlib.sha256(encoded).hexdigest()
        outcome.policy_input = policy_input
        outcome.decision = decision = await self._policy.evaluate(policy_input, encoded=encoded)
        if not decision.allowed:
            raise PolicyDenied(decision.reasons, outcome.jti)
        outcome.submods = appraisal(evidence, decision.policy_digest)
        claims = ear_claims(
            issuer=self._issuer,
            audience=self._issuer,
            jti=outcome.jti,
            now=now,
            ttl=timedelta(seconds=self._settings.ttl_seconds),
            not_after=earliest_expiry(evidence),
            nonce=request.nonce,
            verifier_build=VERIFIER_BUILD,
            submods=outcome.submods,
            pop_jwk=request.pop_key.jwk,
            encryption_jwk=request.encryption_key.jwk,
            policy_digest=decision.policy_digest,
            evidence_digests=outcome.evidence_digests,
            input_digest=outcome.input_digest,
            legacy=self._settings.legacy_names,
        )
        outcome.expires_at = datetime.fromtimestamp(claims["exp"], UTC)
        text = signing_input(claims, kid=self.signer.kid)
        token = compact(text, await self.signer.sign(text.encode("ascii")))
        # stored before the record is written: a result is usable only once both exist, and a
        # store that fails makes this an error record and a 503, never a result nobody can use
        await self.store.put(
            AttestationEntry(
                jti=outcome.jti,
                expires_at=outcome.expires_at,
                pop_thumbprint=request.pop_key.thumbprint,
                policy_input=policy_input,
            )
        )
        return token

    async def status(self, jti: str, now: datetime) -> AttestationEntry:
        """Raises: NotFound when unknown or expired; UpstreamError when the store is down."""
        entry = await self.store.get(jti, now)
        if entry is None:
            raise NotFound("no such attestation (unknown or expired)")
        return entry

    async def revoke(self, jti: str, *, reason: str, who: str, now: datetime) -> AttestationEntry:
        """Revoke in the shared store (every worker and replica refuses it from now on), then
        log who did it and why (the first revocation's reason stays).

        Raises: NotFound, UpstreamError."""
        revocation = await revoke(self.store, jti, reason, now)
        if revocation is None:
            raise NotFound("no such attestation (unknown or expired)")
        await self._log_revocation(jti, revocation.entry, now, who=who)
        return revocation.entry

    async def revalidate(self, *, who: str, now: datetime, trigger: str = "policy_change") -> int:
        """Re-decide every unexpired active attestation with the attestation policy now in
        force, on its stored input at ``now``; revoke (for every worker and replica, one record
        each, naming ``trigger``) those it no longer allows. Several workers re-deciding at
        once log each revocation once (the store says who revoked first). Run after each policy
        change, at start-up and again until a failed run succeeds (``attest_redecide.py``).

        Returns the number revoked here. Raises: UpstreamError (store or policy down)."""
        revoked = 0
        for entry in await self.store.active(now):
            await asyncio.sleep(0)  # thousands of results: let requests run between decisions
            policy_input = {**entry.policy_input, "time": now.isoformat()}
            decision = await self._policy.evaluate(policy_input)
            if decision.allowed:
                continue
            reasons = "; ".join(decision.reasons) or "the attestation policy denies it"
            reason = f"policy {decision.policy_digest[:19]} no longer allows it: {reasons}"
            revoked += await self._revoke_logged(
                entry.jti,
                reason,
                now,
                who=who,
                trigger=trigger,
                policy_digest=decision.policy_digest,
                reasons=list(decision.reasons),
            )
        return revoked

    async def seen(self, evidence: VerifiedEvidence, now: datetime) -> None:
        """Evidence any request verified (a release or an attestation) showed a GPU
        certificate or a RIM signer revoked by OCSP: revoke every active attestation whose
        evidence named that device or RIM, one record each (``who`` = ``ocsp``). Best effort:
        a store that does not answer is logged; the request itself is decided as it would be."""
        # a device or RIM swept within SWEEP_INTERVAL is not swept again: a runner of a revoked
        # GPU retrying cannot make every one of its requests scan the whole store
        self._swept = {k: t for k, t in self._swept.items() if now - t < SWEEP_INTERVAL}
        sightings = revoked_sightings(evidence.gpus, evidence.raw_claims) - set(self._swept)
        if not sightings:
            return
        try:
            for entry in await self.store.active(now):
                hit = sorted(used_by(entry) & sightings)
                if hit:
                    reason = f"revoked by OCSP: {', '.join(hit)}"
                    await self._revoke_logged(entry.jti, reason, now, who="ocsp", revoked=hit)
        except BrokerError as exc:
            log.error("revoking results that used %s failed: %s", sorted(sightings), exc.message)  # noqa: TRY400
            return
        self._swept.update(dict.fromkeys(sightings, now))

    async def _revoke_logged(
        self, jti: str, reason: str, now: datetime, *, who: str, **facts: Any
    ) -> int:
        """Revoke; log it when this call revoked it (1), not when it already was (0)."""
        revocation = await revoke(self.store, jti, reason, now)
        if revocation is None or not revocation.newly:
            return 0
        await self._log_revocation(jti, revocation.entry, now, who=who, **facts)
        return 1

    async def _log_revocation(
        self, jti: str, entry: AttestationEntry, now: datetime, *, who: str, **facts: Any
    ) -> None:
        await self._audit.append_entry(
            {
                "type": "attestation_revoked",
                "jti": jti,
                "time": now.isoformat(),
                "who": who,
                "reason": entry.reason,
                **facts,
            }
        )

    def _safe_record(self, outcome: _Outcome, now: datetime, request_id: str) -> dict[str, Any]:
        """``_record``; if building it fails (a bug), a minimal record and no result."""
        try:
            return self._record(outcome, now, request_id)
        except Exception:
            log.exception("attestation %s: building the record failed", outcome.jti)
            outcome.error = InternalFailure("internal error")
            return {
                "type": "attestation",
                "decision_id": outcome.jti,
                "jti": outcome.jti,
                "request_id": request_id,
                "time": now.isoformat(),
                "result": "error",
                "code": ErrorCode.INTERNAL.value,
            }

    def _record(self, outcome: _Outcome, now: datetime, request_id: str) -> dict[str, Any]:
        request, error, decision = outcome.request, outcome.error, outcome.decision
        result = "allow" if error is None else ("deny" if error.status < 500 else "error")
        return {
            "type": "attestation",
            "decision_id": outcome.jti,
            "jti": outcome.jti,
            "request_id": request_id,
            "time": now.isoformat(),
            "result": result,
            "code": error.code.value if error else None,
            "message": error.message if error else None,
            "reasons": [] if decision is None else list(decision.reasons),
            "policy_digest": self._policy.digest if decision is None else decision.policy_digest,
            "input_digest": outcome.input_digest,
            "runner_key_thumbprint": request.encryption_key.thumbprint if request else None,
            "pop_key_thumbprint": request.pop_key.thumbprint if request else None,
            "evidence_digests": outcome.evidence_digests,
            "identity": None if outcome.evidence is None else dict(outcome.evidence.identity),
            "submods": {s.label: s.status for s in outcome.submods},
            "expires_at": None if outcome.expires_at is None else outcome.expires_at.isoformat(),
            "input": None
            if outcome.policy_input is None
            else masked(
                outcome.policy_input,
                (*self._mask, *(decision.mask if decision is not None else ())),
                self._mask_key,
            ),
        }


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
