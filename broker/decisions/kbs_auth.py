"""``POST /kbs/v0/auth``: a Confidential Containers guest's handshake, the first of the three KBS
plans (docs/kbs.md; ``kbs_attest.py``, ``kbs_resource.py``). The kernel runs it (``kernel.py``:
shielded, total, one ``kbs_auth`` record durable before the answer).

Order:

0. the body: kbs-types ``Request`` (``kbs_request.parse_auth``): the version exactly ``0.4.0``
   (else 401 in Trustee's words, which guests match), a known ``tee``;
1. the ``tee`` has a verifier here (``sample`` only while ``[kbs] allow_sample_evidence``:
   ``kbs_sample_refused`` otherwise; any other without one: ``kbs_tee_unsupported``);
2. a stateless challenge (``stores/nonces.py``) and a session cookie binding it and the ``tee``
   (``kbs_session.py``); nothing is stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.attestation.raw import RawVerifier
from broker.audit.log import Appended
from broker.core.errors import AttestationError, ErrorCode
from broker.core.jsonsafe import loads_bounded
from broker.core.records import RecordType
from broker.decisions.kbs_request import HASH_ALGORITHM, AuthRequest, KbsArrival, parse_auth, shown
from broker.decisions.kbs_session import KbsSession, SessionCodec
from broker.decisions.kernel import Case, Family, Plan
from broker.kbs.wire import SAMPLE_TEES
from broker.stores.nonces import NonceStore

RECORD_TYPE = RecordType.KBS_AUTH


@dataclass(frozen=True)
class Handshake:
    """What ``/auth`` answers: the challenge, and the cookie that opens the session."""

    nonce: str
    cookie: str
    max_age: int  # seconds the cookie lives
    log_index: int = -1

    @property
    def challenge(self) -> dict[str, Any]:
        """kbs-types ``Challenge``: the report data is hashed with SHA-384 (the guest's
        default, named so that a guest that negotiates needs no guess)."""
        return {"nonce": self.nonce, "extra-params": {"selected-hash-algorithm": HASH_ALGORITHM}}


@dataclass
class AuthFacts:
    session: KbsSession | None = None


def verifier_for(verifiers: Mapping[str, RawVerifier], tee: str) -> RawVerifier:
    """The verifier registered for a guest's ``tee`` (``api/kbs_services.py`` registers
    ``sample`` only while the development switch is on).

    Raises:
        AttestationError: ``kbs_sample_refused``, ``kbs_tee_unsupported``.
    """
    verifier = verifiers.get(tee)
    if verifier is not None:
        return verifier
    if tee in SAMPLE_TEES:  # "sampledevice" too: what a guest with no TEE sends
        raise AttestationError(
            "sample evidence proves nothing and is refused here ([kbs] allow_sample_evidence "
            "is a development switch); a guest without a TEE falls back to it",
            code=ErrorCode.KBS_SAMPLE_REFUSED,
        )
    raise AttestationError(
        f"no verifier for tee {tee!r} on this broker", code=ErrorCode.KBS_TEE_UNSUPPORTED
    )


def peeked(arrival: KbsArrival, name: str) -> str | None:
    """A top-level string member of a body that did not parse as a request, as a record may
    show it (``kbs_request.shown``), or ``None``."""
    try:
        body = loads_bounded(arrival.body or b"")
    except ValueError:
        return None
    return shown(body.get(name)) if isinstance(body, dict) else None


AuthCase = Case[KbsArrival, AuthRequest, AuthFacts]


@dataclass(kw_only=True, eq=False)
class KbsAuthPlan(Plan[KbsArrival, AuthRequest, AuthFacts, Handshake]):
    """A guest's handshake (steps 0 to 2 above)."""

    record_type = RECORD_TYPE
    family = Family.ATTEST
    codec: SessionCodec
    nonces: NonceStore
    verifiers: Mapping[str, RawVerifier]

    def facts(self) -> AuthFacts:
        return AuthFacts()

    def parse(self, unverified: KbsArrival) -> AuthRequest:
        return parse_auth(unverified)

    async def decide(self, case: AuthCase, request: AuthRequest) -> Handshake:
        verifier_for(self.verifiers, request.tee)
        challenge = await self.nonces.issue(case.now)
        cookie, case.facts.session = self.codec.issue(request.tee, challenge.nonce, case.now)
        return Handshake(challenge.nonce, cookie, int(self.codec.ttl.total_seconds()))

    async def placed(self, case: AuthCase, answer: Handshake, appended: Appended) -> Handshake:
        return dataclasses.replace(answer, log_index=appended.index)

    def body(self, case: AuthCase) -> dict[str, Any]:
        request, session = case.request, case.facts.session
        return {
            "kbs": {
                "protocol": request.version if request else peeked(case.unverified, "version"),
                "tee": request.tee if request else peeked(case.unverified, "tee"),
                "session": None if session is None else session.id_hash,
                "session_expires_at": None if session is None else session.expires_at.isoformat(),
            }
        }
