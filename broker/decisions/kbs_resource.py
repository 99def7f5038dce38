"""``GET /kbs/v0/resource/<repository>/<type>/<tag>``: a broker key released to an attested guest,
sealed to its ``tee-pubkey`` (docs/kbs.md). The kernel runs it (``kernel.py``: shielded, total,
one ``kbs_resource`` record durable before the answer).

Order:

0. the path: three short names, no query (``kbs_request.parse_resource_path``; 404 otherwise);
1. the token: the session cookie's (made here, unexpired, its session attested: the token it
   holds in the shared store, ``stores/kbs_sessions.py``), else ``Authorization: Bearer``;
   verified as a KBS token this broker signed (``attestation/kbs_token.py``: our result key,
   times, issuer, the ``tee-pubkey`` it names);
2. its stored attestation: known, unexpired, not revoked, the one the token was signed for
   (``attested_cache.check_signed_entry``); the token verified and the entry checked once per
   worker (``kbs_cache.py``), the entry's status read at every request;
3. the path mapped to a key and version by ``[kbs.resources]`` (a path outside it: 404
   ``kbs_resource_not_found``, after the credentials, so that a stranger cannot probe the
   mapping), the version resolved;
4. the **current** release policy (``data.broker.release``) on the attestation's stored input
   with this request's facts, as a release on a result;
5. the DEK unwrapped by the key service and sealed to the ``tee-pubkey`` as the flattened JWE
   the guest decrypts (``seal_for_guest``), the release id, key id and policy digest in its
   protected header.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.claims import RequestFacts
from broker.attestation.kbs_token import PresentedKbsToken
from broker.attestation.stored import REVOKED, AttestationEntry, AttestationStore
from broker.audit.log import Appended
from broker.core.errors import AttestationError, BrokerError, ErrorCode, NotFound
from broker.core.records import RecordType
from broker.crypto.kbs_jwe import seal_for_guest
from broker.crypto.wrap import key_id
from broker.decisions.attested_cache import attestation_identity
from broker.decisions.kbs_cache import TokenCache, tee_thumbprint
from broker.decisions.kbs_request import KbsArrival, ResourcePath, parse_resource_path, shown
from broker.decisions.kbs_session import SessionCodec
from broker.decisions.kernel import Case, Plan
from broker.decisions.policy import Evaluation, PolicyGate
from broker.kbs.wire import PROTOCOL_VERSION
from broker.keys.service import KeyService
from broker.keys.store.base import KeyVersionRecord
from broker.stores.kbs_sessions import KbsSessionStore

Mapped = tuple[str, int | None]  # key name, version (None: the newest enabled)

RECORD_TYPE = RecordType.KBS_RESOURCE


@dataclass(frozen=True)
class KbsReleased:
    jwe: dict[str, str]  # the flattened JWE, sealed to the tee-pubkey
    log_index: int = -1


@dataclass
class ResourceFacts:
    credential: str | None = None  # "cookie" or "bearer"
    session: str | None = None  # the cookie's hash
    token: PresentedKbsToken | None = None
    entry: AttestationEntry | None = None
    mapped: Mapped | None = None
    record: KeyVersionRecord | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)


ResourceCase = Case[KbsArrival, ResourcePath, ResourceFacts]


@dataclass(kw_only=True, eq=False)
class KbsResourcePlan(Plan[KbsArrival, ResourcePath, ResourceFacts, KbsReleased]):
    """A resource released to an attested guest (steps 0 to 5 above)."""

    record_type = RECORD_TYPE
    codec: SessionCodec
    sessions: KbsSessionStore
    issuer: str
    result_keys: Callable[[], Mapping[str, ec.EllipticCurvePublicKey]]
    store: AttestationStore
    keys: KeyService
    policy: PolicyGate
    resources: Mapping[str, Mapped]
    tokens: TokenCache = field(default_factory=TokenCache)  # verified once per worker

    def facts(self) -> ResourceFacts:
        return ResourceFacts()

    def parse(self, unverified: KbsArrival) -> ResourcePath:
        return parse_resource_path(unverified.path, unverified.query)

    async def decide(self, case: ResourceCase, request: ResourcePath) -> KbsReleased:
        facts, now = case.facts, case.now
        presented = await self._presented(case)
        held = self.tokens.verify(presented, keys=self.result_keys(), audience=self.issuer, now=now)
        facts.token = token = held.token
        facts.entry = entry = await self._entry(token, case)
        stored = held.stored_input(entry)  # the one the token was signed for
        facts.mapped = mapped = self.resources.get(str(request))
        if mapped is None:
            raise NotFound(f"no resource {request} here", code=ErrorCode.KBS_RESOURCE_NOT_FOUND)
        facts.record = record = await self.keys.resolve(*mapped)
        policy_input, encoded = stored.release_input(
            RequestFacts(record.name, record.version, record.purpose.value, held.tee_thumbprint),
            {"jti": entry.jti, "expires_at": entry.expires_at.isoformat()},
            now,
        )
        decision = await self.policy.allow(
            facts.evaluation, policy_input, decision_id=case.decision_id, encoded=encoded
        )
        material = await self.keys.unwrap(record)
        sealed = seal_for_guest(
            material,
            token.tee_pubkey,
            context={
                "kid": key_id(record.name, record.version),
                "key_version": record.version,
                "policy_digest": decision.policy_digest,
                "release_id": case.decision_id,
            },
        )
        return KbsReleased(sealed)

    async def _presented(self, case: ResourceCase) -> str:
        """The token: the cookie's session's when it has one, else the Bearer token (Trustee's
        order); neither: the cookie's problem, or ``kbs_token_missing``.

        Raises:
            AttestationError: ``kbs_session_*``, ``kbs_token_missing``.
        """
        arrival, facts = case.unverified, case.facts
        scheme, _, bearer = (arrival.authorization or "").partition(" ")
        bearer = bearer.strip() if scheme.lower() == "bearer" else ""
        refused: BrokerError | None = None
        if arrival.cookie:
            try:
                return await self._cookie_token(arrival.cookie, case)
            except AttestationError as exc:
                refused = exc
        if bearer:
            facts.credential = "bearer"
            return bearer
        raise refused or AttestationError(
            "no kbs-session-id cookie and no Authorization: Bearer token",
            code=ErrorCode.KBS_TOKEN_MISSING,
        )

    async def _cookie_token(self, cookie: str, case: ResourceCase) -> str:
        """The token the cookie's attested session holds.

        Raises:
            AttestationError: ``kbs_session_invalid``, ``kbs_session_expired``,
                ``kbs_session_not_attested``.
        """
        session = self.codec.open(cookie, case.now)
        case.facts.session = session.id_hash
        attested = await self.sessions.get(session.id_hash, case.now)
        if attested is None:
            raise AttestationError(
                "this session has not attested (or its token expired); attest again",
                code=ErrorCode.KBS_SESSION_NOT_ATTESTED,
            )
        case.facts.credential = "cookie"
        return attested.token

    async def _entry(self, token: PresentedKbsToken, case: ResourceCase) -> AttestationEntry:
        entry = await self.store.get(token.jti, case.now)
        if entry is None:
            raise AttestationError(
                "this token's attestation is unknown here or expired; attest again",
                code=ErrorCode.ATTESTATION_UNKNOWN,
            )
        if entry.status == REVOKED:
            raise AttestationError(
                f"this token's attestation was revoked: {entry.reason}",
                code=ErrorCode.ATTESTATION_REVOKED,
            )
        return entry

    async def placed(
        self, case: ResourceCase, answer: KbsReleased, appended: Appended
    ) -> KbsReleased:
        return dataclasses.replace(answer, log_index=appended.index)

    def body(self, case: ResourceCase) -> dict[str, Any]:
        facts, token, entry, record = (
            case.facts,
            case.facts.token,
            case.facts.entry,
            case.facts.record,
        )
        mapped = facts.mapped
        return {
            "kbs": {
                "protocol": PROTOCOL_VERSION,
                "tee": None if token is None else token.tee,
                "session": facts.session,
                "credential": facts.credential,
                "path": str(case.request) if case.request else shown(case.unverified.path),
            },
            "attestation": {
                "jti": None if token is None else token.jti,
                "log_index": None if entry is None else entry.log_index,
            },
            "key": None if mapped is None else mapped[0],
            "version": (None if mapped is None else mapped[1])
            if record is None
            else record.version,
            "kid": None if record is None else key_id(record.name, record.version),
            **self.policy.record(facts.evaluation),
            "runner_key_thumbprint": None if token is None else tee_thumbprint(token.tee_pubkey),
            "identity": None if entry is None else attestation_identity(entry),
        }
