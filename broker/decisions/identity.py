"""``POST /v1/identity``: a workload certificate (SPIFFE X.509-SVID) on an attestation result
(issue 32). The plan the kernel runs (``kernel.py``: shielded, total, one record durable before
the answer).

Order, for every request whose body parsed:

0. the ``Host`` header is a host[:port]; the body is ``{"csr": PEM or base64 DER}``;
1. to 4. the EAR under DPoP admitted: signature and times, the DPoP proof (``htu``: one of
   ``[server] public_urls`` + ``/v1/identity``), the stored attestation (known, unexpired, not
   revoked), the proof's ``jti`` spent (``result_admission.py``, as a release on a result);
5. the CSR: a PKCS#10 request whose signature verifies, for an EC P-256 key that is not the
   result's proof-of-possession key (``crypto/svid.py``);
6. the **current** identity policy (``data.broker.identity``) on the attestation's stored input:
   allowed, with a SPIFFE ID path; the CSR may name no URI but that very SPIFFE ID
   (``identity_not_allowed``); nothing else it asks for is copied;
7. the CA's chain valid now (``identity_ca_unavailable``); the leaf built to the X.509-SVID
   profile, valid from ``NOT_BEFORE_BACKDATE`` ago (a peer's clock a little behind ours; never
   before the CA) until the first of: now + ``[identity] max_lifetime_seconds``, the result's
   expiry, the CA's expiry; signed by the CA's key and verified with its certificate before
   anything else (``identity_ca_unavailable``);
8. the leaf listed on its result in the shared attestation store (serial, SPIFFE ID, SHA-256,
   expiry: ``GET /v1/attestations/{jti}`` answers them, so a peer can tell it from a leaf the
   CA key signed elsewhere), in the update that reads the result's status again: a result
   revoked or expired meanwhile gets none; a store that does not answer, none (503);
9. one ``identity`` record (the attestation's jti and log index, the proof's jti, the SPIFFE
   ID, serial, SHA-256, expiry, the policy's digest, reasons and masked input): what ``broker
   policy replay`` re-decides (``policy/identity.py`` reads the policy's answer for both).

A leaf listed in step 8 whose record the log then does not take is never answered (the kernel
withdraws it): it stays listed, harmless, as no one holds it (docs/decisions.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.claims import SCHEMA
from broker.attestation.issued import IssuedCertificate
from broker.attestation.stored import REVOKED, note_certificate
from broker.audit.log import Appended
from broker.core.errors import AttestationError, ErrorCode, InputError, PolicyDenied
from broker.core.protocol import IDENTITY_KIND
from broker.core.records import RecordType
from broker.crypto.jwk import public_jwk, thumbprint
from broker.crypto.svid import (
    NOT_BEFORE_BACKDATE,
    LeafProfile,
    csr_key,
    csr_names,
    leaf_tbs,
    load_csr,
    new_serial,
    pem,
)
from broker.decisions.attested_request import Unverified, check_host
from broker.decisions.kernel import Case, Family, Plan
from broker.decisions.policy import Evaluation, PolicyGate
from broker.decisions.result_admission import Admitted, ResultAdmission
from broker.policy.identity import assignment
from broker.signers.identity_ca import IdentityCa

RECORD_TYPE = RecordType.IDENTITY
IDENTITY_PATH = "/v1/identity"  # the route a proof's htu names, after a configured public URL
IDENTITY_FIELDS = ("csr",)


class IdentityDenied(PolicyDenied):
    """The identity policy gives this attestation no SPIFFE ID (403)."""

    default_code = ErrorCode.IDENTITY_DENIED

    def __init__(self, reasons: list[str] | tuple[str, ...], decision_id: str) -> None:
        super().__init__(reasons, decision_id)
        self.message = "the identity policy gives this attestation no workload identity"


class IdentityNotAllowed(PolicyDenied):
    """The CSR names a SPIFFE ID other than the one the policy gives (403)."""

    default_code = ErrorCode.IDENTITY_NOT_ALLOWED


@dataclass(frozen=True)
class IdentityRequest:
    csr: str


@dataclass(frozen=True)
class IssuedIdentity:
    spiffe_id: str
    certificates: tuple[x509.Certificate, ...]  # the leaf, then the intermediates
    serial: int
    not_after: datetime
    attestation: str  # the EAR's jti
    policy_digest: str
    log_index: int = -1


@dataclass
class IdentityFacts(Admitted):
    csr_key: ec.EllipticCurvePublicKey | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)
    spiffe_id: str | None = None
    # the broker's reasons for a deny the policy did not give (a path that is no SPIFFE ID)
    refused: tuple[str, ...] = ()
    profile: LeafProfile | None = None
    sha256: str | None = None  # the signed leaf's DER, hex
    issued: bool = False


IdentityCase = Case[Unverified, IdentityRequest, IdentityFacts]


@dataclass(kw_only=True, eq=False)
class IdentityPlan(
    Plan[Unverified, IdentityRequest, IdentityFacts, IssuedIdentity], ResultAdmission
):
    """A workload certificate on an attestation result and its proof of possession."""

    record_type = RECORD_TYPE
    family = Family.ATTEST  # counted with the results it is issued on (broker_attest_*)
    ca: IdentityCa
    policy: PolicyGate

    @cached_property
    def identity_urls(self) -> tuple[str, ...]:
        return self.urls_for(IDENTITY_PATH)

    def facts(self) -> IdentityFacts:
        return IdentityFacts()

    def parse(self, unverified: Unverified) -> IdentityRequest:
        body, presented = unverified
        check_host(presented.host)
        csr = body.get("csr")
        if not isinstance(csr, str) or not csr:
            raise InputError("csr must be a PKCS#10 request: PEM, or base64 of its DER")
        return IdentityRequest(csr)

    async def decide(self, case: IdentityCase, request: IdentityRequest) -> IssuedIdentity:
        facts, now = case.facts, case.now
        prepared = await self.admit(facts, case.unverified[1], urls=self.identity_urls, now=now)
        ear = facts.ear
        assert ear is not None  # noqa: S101 - admit set it or raised
        csr = load_csr(request.csr)
        facts.csr_key = key = csr_key(csr, ear.pop_thumbprint)
        policy_input = {
            "schema": SCHEMA,
            "request": {
                "kind": IDENTITY_KIND,
                "trust_domain": self.ca.trust_domain,
                "attestation": dict(prepared.attestation),
                "csr_key_thumbprint": thumbprint(public_jwk(key)),
            },
            "tee": prepared.stored.tee,
            "gpus": prepared.stored.gpus,
            "claims": prepared.stored.claims,
            "time": now.isoformat(),
        }
        try:
            decision = await self.policy.allow(
                facts.evaluation, policy_input, decision_id=case.decision_id
            )
        except PolicyDenied as exc:
            raise IdentityDenied(exc.details.get("reasons", []), case.decision_id) from exc
        given = assignment(decision, self.ca.trust_domain)  # as `broker policy replay` reads it
        if given.spiffe_id is None:  # allowed, but its spiffe_path is no SPIFFE ID path
            facts.refused = given.reasons
            raise IdentityDenied(given.reasons, case.decision_id)
        facts.spiffe_id = named = given.spiffe_id
        asked = [name for name in csr_names(csr) if name != named]
        if asked:
            refused = IdentityNotAllowed([f"the CSR asks for {asked[0][:200]}"], case.decision_id)
            refused.message = (
                f"the CSR names another identity than {named}; this attestation holds only that one"
            )
            raise refused
        return await self._issued(facts, key, named, decision.policy_digest, now)

    async def _issued(
        self,
        facts: IdentityFacts,
        key: ec.EllipticCurvePublicKey,
        named: str,
        policy_digest: str,
        now: datetime,
    ) -> IssuedIdentity:
        """Steps 7 and 8: the leaf made, signed, verified and listed on its result."""
        ear = facts.ear
        assert ear is not None  # noqa: S101 - admitted before
        self.ca.check_valid(now)
        # whole seconds, as X.509 keeps them (floored: never past the EAR nor the CA)
        not_after = min(now + self.ca.max_lifetime, ear.expires_at, self.ca.valid_until)
        facts.profile = profile = LeafProfile(
            spiffe_id=named,
            not_before=max(now - NOT_BEFORE_BACKDATE, self.ca.valid_from).replace(microsecond=0),
            not_after=not_after.replace(microsecond=0),
            serial=new_serial(),
            attestation_jti=ear.jti,
            policy_digest=policy_digest,
        )
        leaf = await self.ca.sign(leaf_tbs(profile, key, self.ca.issuer))
        facts.sha256 = leaf.fingerprint(hashes.SHA256()).hex()
        await self._listed(ear.jti, profile, facts.sha256, now)
        facts.issued = True
        return IssuedIdentity(
            spiffe_id=named,
            certificates=(leaf, *self.ca.intermediates),
            serial=profile.serial,
            not_after=profile.not_after,
            attestation=ear.jti,
            policy_digest=policy_digest,
        )

    async def _listed(self, jti: str, profile: LeafProfile, sha256: str, now: datetime) -> None:
        """Step 8: the leaf listed on its result, which is still active.

        Raises:
            AttestationError: ``attestation_revoked``, ``attestation_unknown`` (meanwhile).
            UpstreamError: the store's (``nonce_store_unavailable``,
                ``attestation_store_mismatch``).
        """
        listed = IssuedCertificate(
            serial=format(profile.serial, "x"),
            spiffe_id=profile.spiffe_id,
            sha256=sha256,
            not_after=profile.not_after,
        )
        entry = await note_certificate(self.store, jti, listed, now)
        if entry is None:
            raise AttestationError(
                "this attestation result expired while its certificate was made; attest again",
                code=ErrorCode.ATTESTATION_UNKNOWN,
            )
        if entry.status == REVOKED:
            raise AttestationError(
                f"this attestation result was revoked: {entry.reason}",
                code=ErrorCode.ATTESTATION_REVOKED,
                reason=entry.reason,
            )

    async def placed(
        self, case: IdentityCase, answer: IssuedIdentity, appended: Appended
    ) -> IssuedIdentity:
        return dataclasses.replace(answer, log_index=appended.index)

    def withdraw(self, case: IdentityCase) -> None:
        case.facts.issued = False  # signed but never sent: the record must not say allow

    def body(self, case: IdentityCase) -> dict[str, Any]:
        facts = case.facts
        ear, entry, proof, profile = facts.ear, facts.entry, facts.proof, facts.profile
        issued = profile if facts.issued else None
        decided = self.policy.record(facts.evaluation)
        if facts.refused:  # the reasons the runner was given, not the policy's allow
            decided["reasons"] = list(facts.refused)
        return {
            "attestation": {
                "jti": None if ear is None else ear.jti,
                "log_index": None if entry is None else entry.log_index,
            },
            "dpop_jti": None if proof is None else proof.jti,
            "pop_key_thumbprint": None if ear is None else ear.pop_thumbprint,
            "identity": None if facts.prepared is None else dict(facts.prepared.identity),
            "trust_domain": self.ca.trust_domain,
            "spiffe_id": facts.spiffe_id,
            "csr_key_thumbprint": None
            if facts.csr_key is None
            else thumbprint(public_jwk(facts.csr_key)),
            "serial": None if issued is None else format(issued.serial, "x"),
            "sha256": None if issued is None else facts.sha256,
            "not_after": None if issued is None else issued.not_after.isoformat(),
            **decided,
        }


def describe(issued: IssuedIdentity) -> dict[str, Any]:
    """The answer's members (``api/identity.py`` adds the log's origin)."""
    return {
        "spiffe_id": issued.spiffe_id,
        "certificates": pem(issued.certificates),
        "serial": format(issued.serial, "x"),
        "expires_at": issued.not_after.isoformat().replace("+00:00", "Z"),
        "attestation": issued.attestation,
        "policy_digest": issued.policy_digest,
        "log_index": issued.log_index,
    }
