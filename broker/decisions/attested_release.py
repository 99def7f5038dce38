"""``POST /v1/release`` on an attestation result: ``Authorization: DPoP <EAR>`` with a ``DPoP``
proof (RFC 9449) and a list of keys; no evidence is verified again (issue 19). The plan the
kernel runs (``kernel.py``: shielded, total, one record durable before the answer).

Order, for every request whose body parsed:

0. the ``Host`` header is a host[:port] (``host_invalid`` otherwise; it is used for nothing
   else); the body's shape (``keys``: 1..``MAX_KEYS`` names, optionally with versions; ``wrap``)
   (``attested_request.py``);
1. to 4. the EAR under DPoP admitted: its signature and times, the DPoP proof (``htu``: one of
   ``[server] public_urls`` + ``/v1/release``), the stored attestation, the proof's ``jti``
   spent (``result_admission.py``, shared with the workload certificates of ``identity.py``);
5. per key: resolve the version, run the **current** release policy on the attestation's
   stored input with this request's facts, unwrap the DEK and wrap it to the EAR's encryption
   key with the release id, key version and policy digest in the AAD; a key's failure is that
   key's, the others are still decided;
6. one ``attested_release`` record (the attestation's jti and log index, the proof's jti, per
   key: version, result, reasons, policy digest, masked input). Its top-level ``result`` is
   ``allow`` when every key was released, ``partial`` when some were and some were not, else
   ``deny`` (or ``error`` when a failure was the broker's).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from broker.attestation.ear import PresentedEar
from broker.audit.log import Appended
from broker.audit.outcomes import overall
from broker.core.encoding import Encoded, canonical_members
from broker.core.errors import BrokerError, InternalFailure, PolicyDenied
from broker.core.records import RecordType
from broker.crypto.jwk import RunnerKey
from broker.crypto.wrap import check_wrap_mode, key_id
from broker.decisions.attested_cache import PreparedAttestation
from broker.decisions.attested_request import (
    RELEASE_PATH,
    AttestedRequest,
    KeyAsk,
    Unverified,
    check_host,
    parse_attested_request,
)
from broker.decisions.kernel import Case, Plan, code_of, outcome_of
from broker.decisions.policy import Evaluation, PolicyGate
from broker.decisions.result_admission import Admitted, ResultAdmission
from broker.decisions.wrapping import request_facts, wrap_for_runner
from broker.keys.service import KeyService
from broker.keys.store.base import KeyVersionRecord

log = logging.getLogger(__name__)
RECORD_TYPE = RecordType.ATTESTED_RELEASE
# What ``Server-Timing`` names, in this order, when ``[server] server_timing`` is on: the DPoP
# proof, the EAR, the attestation store (entry read, proof jti spent), the release policy, the
# key (version and DEK), the wrap, building the record, the durable append (docs/configuration.md)
TIMED_STAGES = ("proof", "ear", "store", "policy", "unwrap", "wrap", "record", "log")


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
    log_index: int = -1
    leaf_hash: bytes = b""
    stages: tuple[tuple[str, float], ...] = ()  # (stage, seconds) laps, when timed


@dataclass
class KeyOnResult:
    """One key asked on the result: what its part of the record says."""

    ask: KeyAsk
    record: KeyVersionRecord | None = None
    evaluation: Evaluation = field(default_factory=Evaluation)
    wrapped: str | None = None
    error: BrokerError | None = None


@dataclass
class AttestedFacts(Admitted):
    """What the record says, learned as the release proceeds."""

    encryption_key: RunnerKey | None = None
    keys: list[KeyOnResult] = field(default_factory=list)


AttestedCase = Case[Unverified, AttestedRequest, AttestedFacts]


@dataclass(kw_only=True, eq=False)
class AttestedReleasePlan(
    Plan[Unverified, AttestedRequest, AttestedFacts, AttestedRelease], ResultAdmission
):
    """Keys released on an attestation result and its proof of possession (steps 0 to 5)."""

    record_type = RECORD_TYPE
    keys: KeyService
    policy: PolicyGate
    timed: bool = False  # stages lapped for Server-Timing ([server] server_timing)

    @cached_property
    def release_urls(self) -> tuple[str, ...]:
        """What a proof's ``htu`` must name: a ``[server] public_urls`` entry and this route
        (none configured, none accepted)."""
        return self.urls_for(RELEASE_PATH)

    def facts(self) -> AttestedFacts:
        return AttestedFacts()

    def parse(self, unverified: Unverified) -> AttestedRequest:
        body, presented = unverified
        check_host(presented.host)
        return parse_attested_request(body)

    async def decide(self, case: AttestedCase, request: AttestedRequest) -> AttestedRelease:
        ear = await self._admit(case, request)
        for ask in request.keys:
            case.facts.keys.append(await self._decide_key(case, request, ask))
        return AttestedRelease(
            release_id=case.decision_id,
            attestation=ear.jti,
            wrap=request.wrap,
            keys=tuple(_answer(k) for k in case.facts.keys),
        )

    def _lap(self, case: AttestedCase) -> Callable[[str], None]:
        return case.watch.lap if self.timed else _untimed

    async def _admit(self, case: AttestedCase, request: AttestedRequest) -> PresentedEar:
        """Steps 1 to 4 (``result_admission.py``); the wrap mode checked against the result's
        encryption key before the proof is spent."""
        facts = case.facts

        def wrap_fits(prepared: PreparedAttestation) -> None:
            facts.encryption_key = prepared.encryption_key
            check_wrap_mode(request.wrap, prepared.encryption_key)

        await self.admit(
            facts,
            case.unverified[1],
            urls=self.release_urls,
            now=case.now,
            lap=self._lap(case),
            check=wrap_fits,
        )
        assert facts.ear is not None  # noqa: S101 - admit set it or raised
        return facts.ear

    async def _decide_key(
        self, case: AttestedCase, request: AttestedRequest, ask: KeyAsk
    ) -> KeyOnResult:
        """Step 5 for one key; its failure is this key's, the others are still decided."""
        key = KeyOnResult(ask)
        prepared = case.facts.prepared
        if prepared is None:
            raise RuntimeError("a key decided before its attestation was admitted")
        encryption_key = prepared.encryption_key
        lap = self._lap(case)
        try:
            key.record = record = await self.keys.resolve(ask.key, ask.version)
            custody = self.keys.check_release(record, request.wrap, encryption_key)
            lap("unwrap")  # the key: its version (and next, its DEK)
            policy_input, encoded = prepared.stored.release_input(
                request_facts(record, encryption_key), prepared.attestation, case.now
            )
            decision = await self.policy.allow(
                key.evaluation, policy_input, decision_id=case.decision_id, encoded=encoded
            )
            lap("policy")
            key.wrapped = await wrap_for_runner(
                self.keys,
                record,
                custody,
                encryption_key,
                decision_id=case.decision_id,
                mode=request.wrap,
                policy_digest=decision.policy_digest,
                lap=lap,
            )
        except BrokerError as exc:
            key.error = exc
        return key

    async def placed(
        self, case: AttestedCase, answer: AttestedRelease, appended: Appended
    ) -> AttestedRelease:
        return dataclasses.replace(
            answer,
            log_index=appended.index,
            leaf_hash=appended.leaf_hash,
            stages=tuple(case.watch.stages) if self.timed else (),
        )

    def withdraw(self, case: AttestedCase) -> None:
        for key in case.facts.keys:  # wrapped but never sent: the record must not say allow
            if key.wrapped is not None:
                key.wrapped, key.error = None, case.error

    def result(self, case: AttestedCase) -> str:
        results = [outcome_of(k.error) for k in case.facts.keys]
        return outcome_of(case.error) if case.error is not None or not results else overall(results)

    def tally(self, case: AttestedCase) -> Iterable[tuple[str, str]]:
        counted = []
        for key in case.facts.keys:  # a key the request's error cut short (withdrawn, or never
            error = key.error or (case.error if key.wrapped is None else None)  # reached) has it
            counted.append((outcome_of(error), code_of(error)))
        if case.error is not None and not counted:
            counted.append((outcome_of(case.error), code_of(case.error)))
        return counted

    def refusal(self, case: AttestedCase) -> BrokerError | None:
        """Nothing released: the request's error, or the first key's; ``details["keys"]`` says
        each key's code."""
        keys = case.facts.keys
        if case.error is None and any(k.wrapped is not None for k in keys):
            return None
        error = case.error or next((k.error for k in keys if k.error is not None), None)
        error = error or InternalFailure("internal error")
        error.details["release_id"] = case.decision_id
        if keys:
            error.details["keys"] = [_key_summary(k) for k in keys]
        return error

    def body(self, case: AttestedCase) -> dict[str, Any]:
        request, facts = case.request, case.facts
        entry, ear, proof = facts.entry, facts.ear, facts.proof
        return {
            "attestation": {
                "jti": None if ear is None else ear.jti,
                "log_index": None if entry is None else entry.log_index,
            },
            "dpop_jti": None if proof is None else proof.jti,
            "pop_key_thumbprint": None if ear is None else ear.pop_thumbprint,
            "runner_key_thumbprint": None
            if facts.encryption_key is None
            else facts.encryption_key.thumbprint,
            "wrap": None if request is None else request.wrap,
            # who asked: the attestation's identity, once its stored entry matched the signed
            # result (OCSF's actor, `audit query --image/--project`)
            "identity": None if facts.prepared is None else dict(facts.prepared.identity),
            "asked": []
            if request is None
            else [{"key": a.key, "version": a.version} for a in request.keys],
            "keys": self._keys_record(facts),
        }

    def _keys_record(self, facts: AttestedFacts) -> Encoded:
        """Each key's part of the record, encoded: its input's stored claims spliced from
        their encoding (made once per attestation), never encoded again per release."""
        parts = [b"{" + canonical_members(self._key_record(k, facts)) + b"}" for k in facts.keys]
        return Encoded(b"[" + b",".join(parts) + b"]")

    def _key_record(self, key: KeyOnResult, facts: AttestedFacts) -> dict[str, Any]:
        record, error, evaluation = key.record, key.error, key.evaluation
        masked_input, masks = None, self.policy.masks(evaluation)
        if not masks and evaluation.encoded is not None:  # nothing masked: the evaluated bytes
            masked_input = Encoded(evaluation.encoded)
        elif evaluation.policy_input is not None and facts.prepared is not None:
            masked_input = Encoded(
                facts.prepared.stored.masked_encoding(
                    evaluation.policy_input, masks, self.policy.mask_key
                )
            )
        return {
            "key": key.ask.key,
            "version": key.ask.version if record is None else record.version,
            "kid": None if record is None else key_id(record.name, record.version),
            "result": outcome_of(error),
            "code": error.code.value if error else None,
            "message": error.message if error else None,
            **self.policy.record(evaluation, masked_input=masked_input),
        }


def _untimed(stage: str) -> None:
    """No lap: ``Server-Timing`` is off."""


def _key_summary(key: KeyOnResult) -> dict[str, Any]:
    summary: dict[str, Any] = {"key": key.ask.key, "code": code_of(key.error)}
    if isinstance(key.error, PolicyDenied):
        summary["reasons"] = key.error.details.get("reasons", [])
    return summary


def _answer(key: KeyOnResult) -> ReleasedOnResult | RefusedOnResult:
    decision = key.evaluation.decision
    if key.wrapped is not None and key.record is not None and decision is not None:
        return ReleasedOnResult(
            key=key.record.name,
            version=key.record.version,
            wrapped_key=key.wrapped,
            algorithm=key.record.algorithm.value,
            policy_digest=decision.policy_digest,
        )
    error = key.error or InternalFailure("internal error")
    return RefusedOnResult(key.ask.key, None if key.record is None else key.record.version, error)
