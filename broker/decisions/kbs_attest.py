"""``POST /kbs/v0/attest``: a guest's raw evidence verified and answered with a token bound to its
``tee-pubkey`` (docs/kbs.md). The kernel runs it (``kernel.py``: shielded, total, one
``kbs_attest`` record durable before the answer).

Order:

0. the body: kbs-types ``Attestation`` (``kbs_request.parse_attest``), the ``tee-pubkey`` a key
   the guest can be answered to;
1. the session cookie: made here, unexpired (``kbs_session.py``), and the nonce answered is the
   one handed out with it; that nonce is a challenge this broker made, unexpired (a MAC);
2. the evidence, by the verifier registered for the session's ``tee`` (``sample`` only with
   the development switch: ``kbs_sample_refused``);
3. its report data is the binding the guest must have made of this very key, nonce and
   additional evidence (``expected_report_data``: SHA-384 of the JCS of ``tee-pubkey``,
   ``nonce``, ``additional-evidence``, padded to 64 bytes); another is
   ``kbs_report_data_mismatch``; the init-data sent, if any, digests to the evidence's
   MRCONFIGID / HOST_DATA (``kbs/init_data.py``), else ``kbs_init_data_mismatch``;
4. only then the nonce spent, once, in the shared spent-nonce store (``nonce_reused``);
5. the attestation policy (``data.broker.attest``) on the input built like every evidence
   kind's (``tee`` from the verifier; ``claims.kbs`` the protocol facts, ``init_data`` only
   as verified in 3);
6. the token (``attestation/kbs_token.py``) signed, its attestation stored for releases and
   re-decisions (``stores/attestations.py``, keyed by the ``tee-pubkey``'s thumbprint); once
   the record is durable, the session stored under the cookie's hash
   (``stores/kbs_sessions.py``): a cookie is usable only after its decision is in the log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from broker.attestation.claims import SCHEMA
from broker.attestation.ear import Submod, compact, signing_input, status_of, worst_status
from broker.attestation.kbs_token import kbs_token_claims
from broker.attestation.raw import REPORT_DATA_BYTES, RawVerifier, VerifiedRawEvidence
from broker.attestation.service import evidence_digests
from broker.attestation.stored import AttestationEntry, AttestationStore, note_log_index
from broker.audit.log import Appended
from broker.core.errors import AttestationError, ErrorCode
from broker.core.protocol import ATTEST_KIND
from broker.core.records import RecordType
from broker.decisions.attest import VERIFIER_BUILD
from broker.decisions.kbs_auth import verifier_for
from broker.decisions.kbs_request import HASH_ALGORITHM, AttestRequest, KbsArrival, parse_attest
from broker.decisions.kbs_session import KbsSession, SessionCodec
from broker.decisions.kernel import Case, Family, Plan
from broker.decisions.policy import Evaluation, PolicyGate
from broker.kbs.init_data import VerifiedInitData, bind_init_data
from broker.kbs.wire import PROTOCOL_VERSION, expected_report_data
from broker.signers.results import ResultSigner
from broker.stores.kbs_sessions import AttestedSession, KbsSessionStore
from broker.stores.nonces import NonceStore

log = logging.getLogger(__name__)
HARDWARE = frozenset({"tdx", "sev-snp"})  # technologies whose evidence a vendor key signs

RECORD_TYPE = RecordType.KBS_ATTEST


@dataclass(frozen=True)
class KbsAttested:
    token: str
    jti: str
    expires_at: datetime
    log_index: int = -1


@dataclass
class KbsAttestFacts:
    session: KbsSession | None = None
    evidence: VerifiedRawEvidence | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)
    submods: list[Submod] = field(default_factory=list)
    expires_at: datetime | None = None
    init_data: VerifiedInitData | None = None


KbsAttestCase = Case[KbsArrival, AttestRequest, KbsAttestFacts]


def kbs_attest_input(
    request: AttestRequest,
    session: KbsSession,
    evidence: VerifiedRawEvidence,
    init_data: VerifiedInitData | None,
    now: datetime,
) -> dict[str, Any]:
    """The attestation policy's input for a KBS guest: the shape of every evidence kind's
    (``claims.build_attest_input``), ``tee`` as the verifier normalised it, the parsed
    evidence under ``claims.<tee>`` and the protocol's facts under ``claims.kbs``: its
    ``init_data`` only as the evidence bound it (else null)."""
    return {
        "schema": SCHEMA,
        "request": {
            "kind": ATTEST_KIND,
            "runner_key_thumbprint": request.tee_pubkey.thumbprint,
        },
        "tee": dict(evidence.tee),
        "gpus": [],
        "claims": {
            "kbs": {
                "protocol": PROTOCOL_VERSION,
                "tee": session.tee,
                "init_data": None if init_data is None else init_data.as_claims(),
                "additional_evidence_digest": "sha256:"
                + hashlib.sha256(request.additional_evidence.encode("utf-8")).hexdigest(),
            },
            session.tee: dict(evidence.claims),
        },
        "time": now.isoformat(),
    }


def _init_data_record(
    request: AttestRequest | None, verified: VerifiedInitData | None
) -> dict[str, Any] | None:
    """What the record says of the init-data: the digest sent, and the field that bound it
    (``None``: not bound, refused or unbindable: ``sample``)."""
    if request is None or request.unverified_init_data is None:
        return None
    sent = request.unverified_init_data
    return {
        "algorithm": sent.algorithm,
        "digest": sent.digest.hex(),
        "bound_to": None if verified is None else verified.field,
    }


def judged_until(evidence: VerifiedRawEvidence) -> datetime | None:
    """When what the verifier judged the evidence with expires, if it says (TDX: the
    collateral's ``nextUpdate``, ``claims.collateral_next_update``): a token never outlives it."""
    text = evidence.claims.get("collateral_next_update")
    try:
        return datetime.fromisoformat(text) if isinstance(text, str) else None
    except ValueError:
        return None


def kbs_appraisal(evidence: VerifiedRawEvidence, policy_digest: str) -> list[Submod]:
    """``cpu0``'s AR4SI vector: evidence bound to this request (2), hardware a vendor signs (2;
    ``sample``: 96, nothing is signed), not debug (2, else 96)."""
    vector = {
        "instance-identity": 2,
        "hardware": 2 if evidence.technology in HARDWARE else 96,
        "configuration": 2 if evidence.tee.get("debug") is False else 96,
    }
    tier = worst_status(status_of(value) for value in vector.values())
    return [Submod("cpu0", tier, vector, [policy_digest])]


@dataclass(kw_only=True, eq=False)
class KbsAttestPlan(Plan[KbsArrival, AttestRequest, KbsAttestFacts, KbsAttested]):
    """A guest's attestation (steps 0 to 6 above)."""

    record_type = RECORD_TYPE
    family = Family.ATTEST
    codec: SessionCodec
    nonces: NonceStore
    verifiers: Mapping[str, RawVerifier]
    policy: PolicyGate
    signer: ResultSigner
    store: AttestationStore
    sessions: KbsSessionStore
    issuer: str  # the token's iss and aud: this broker's audience
    token_ttl: timedelta

    def facts(self) -> KbsAttestFacts:
        return KbsAttestFacts()

    def parse(self, unverified: KbsArrival) -> AttestRequest:
        return parse_attest(unverified)

    async def decide(self, case: KbsAttestCase, request: AttestRequest) -> KbsAttested:
        facts, now = case.facts, case.now
        facts.session = session = self.codec.open(case.unverified.cookie, now)
        self.codec.check_nonce(session, request.nonce)
        challenge = self.nonces.verify_challenge(request.nonce, now)
        verifier = verifier_for(self.verifiers, session.tee)
        facts.evidence = evidence = await verifier.verify(request.unverified_evidence, now=now)
        expected = expected_report_data(
            request.tee_pubkey.jwk, request.nonce, request.additional_evidence, HASH_ALGORITHM
        )
        if not hmac.compare_digest(evidence.report_data, expected.ljust(REPORT_DATA_BYTES, b"\0")):
            raise AttestationError(
                "the evidence's report data does not bind this tee-pubkey, nonce and "
                "additional evidence",
                code=ErrorCode.KBS_REPORT_DATA_MISMATCH,
            )
        facts.init_data = init_data = bind_init_data(
            request.unverified_init_data, evidence.init_data_field
        )
        await self.nonces.spend_challenge(challenge, now)  # authentic evidence: spent now
        policy_input = kbs_attest_input(request, session, evidence, init_data, now)
        decision = await self.policy.allow(
            facts.evaluation, policy_input, decision_id=case.decision_id
        )
        facts.submods = kbs_appraisal(evidence, decision.policy_digest)
        claims = kbs_token_claims(
            issuer=self.issuer,
            jti=case.decision_id,
            now=now,
            ttl=self.token_ttl,
            not_after=judged_until(evidence),
            nonce=request.nonce,
            verifier_build=VERIFIER_BUILD,
            submods=facts.submods,
            tee_pubkey=request.tee_pubkey.jwk,
            tee=session.tee,
            protocol=PROTOCOL_VERSION,
            policy_digest=decision.policy_digest,
            evidence_digests=evidence_digests({session.tee: request.unverified_evidence}),
            input_digest=facts.evaluation.input_digest,
        )
        facts.expires_at = expires_at = datetime.fromtimestamp(claims["exp"], UTC)
        text = signing_input(claims, kid=self.signer.kid)
        token = compact(text, await self.signer.sign(text.encode("ascii")))
        await self.store.put(  # usable only with the token, which leaves only once logged
            AttestationEntry(
                jti=case.decision_id,
                expires_at=expires_at,
                pop_thumbprint=request.tee_pubkey.thumbprint,
                policy_input=policy_input,
            )
        )
        return KbsAttested(token, case.decision_id, expires_at)

    async def placed(
        self, case: KbsAttestCase, answer: KbsAttested, appended: Appended
    ) -> KbsAttested:
        session = case.facts.session
        assert session is not None  # noqa: S101 - decide opened it or raised
        try:  # the record is durable: the cookie may now stand for the token
            await self.sessions.put(
                AttestedSession(
                    session.id_hash, answer.token, min(session.expires_at, answer.expires_at)
                ),
                case.now,
            )
            await note_log_index(self.store, answer.jti, appended.index, case.now)
        except Exception:  # the allow is durable and leaves; the cookie then needs a new handshake
            log.warning("kbs attestation %s: its session was not stored", answer.jti, exc_info=True)
        return dataclasses.replace(answer, log_index=appended.index)

    def body(self, case: KbsAttestCase) -> dict[str, Any]:
        request, facts = case.request, case.facts
        session, evidence = facts.session or self._named_session(case), facts.evidence
        return {
            "kbs": {
                "protocol": PROTOCOL_VERSION,
                "tee": None if session is None else session.tee,
                "session": None if session is None else session.id_hash,
                "init_data": _init_data_record(request, facts.init_data),
                # when the verifier judged the evidence (its collateral's time, if it says)
                "evidence_verified_at": None
                if evidence is None or evidence.verified_at is None
                else evidence.verified_at.isoformat(),
            },
            "jti": case.decision_id,
            **self.policy.record(facts.evaluation),
            "runner_key_thumbprint": None if request is None else request.tee_pubkey.thumbprint,
            "evidence_digests": {}
            if request is None or session is None
            else evidence_digests({session.tee: request.unverified_evidence}),
            "identity": None
            if evidence is None or session is None
            else {
                "attestation": case.decision_id,
                "tee": session.tee,
                "technology": evidence.technology,
            },
            "submods": {s.label: s.status for s in facts.submods},
            "expires_at": None if facts.expires_at is None else facts.expires_at.isoformat(),
        }

    def _named_session(self, case: KbsAttestCase) -> KbsSession | None:
        """The session a refused request's cookie opens to, for its record (a body that did not
        parse still names its guest's session), or ``None``."""
        try:
            return self.codec.open(case.unverified.cookie, case.now)
        except AttestationError:
            return None

    def minimal(self, case: KbsAttestCase) -> dict[str, Any]:
        return {"jti": case.decision_id}
