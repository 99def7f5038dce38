"""Attestation results after they were issued (issue 19, issue 27): their status, an admin's
revocation, re-deciding every active result when the attestation policy may have changed, and
revoking the results whose evidence named a GPU or RIM signer OCSP has since revoked. Each
revocation is one ``attestation_revoked`` record; the shared store makes it every worker's and
replica's at once. Issuing a result is the attestation plan (``attest.py``).

A revocation takes effect before its record is written (a log that does not answer must not
keep a revoked result usable), so the store entry says the record is owed (``record_due``)
until it is written. Whoever revoked writes it; if that one stops first (a crash, the log
down), the next re-decision after ``RECORD_GRACE`` writes it (``_write_owed``), and a
re-decision that finds a record owed but not yet due is not done: ``redecide.py`` runs it
again until every record is written (docs/decisions.md, "Revocations are recorded after
they take effect")."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import Any

from broker.attestation.service import VerifiedEvidence
from broker.attestation.stored import (
    ACTIVE,
    AttestationEntry,
    AttestationStore,
    claim_record,
    record_written,
    revoke,
    revoked_sightings,
    used_by,
)
from broker.audit.log import DecisionLog
from broker.core.errors import BrokerError, ErrorCode, NotFound, UpstreamError
from broker.core.records import RecordType
from broker.policy.engine import PolicyEngine

log = logging.getLogger(__name__)
SWEEP_INTERVAL = timedelta(seconds=30)  # a revoked device's results are looked for once per this


class RecordsOwed(UpstreamError):
    """Revocation records another writer still has time to write: look again later."""

    def __init__(self, owed: int) -> None:
        super().__init__(
            f"{owed} revocation record(s) not written yet by whoever revoked them",
            code=ErrorCode.AUDIT_LOG_UNAVAILABLE,
        )


class AttestationResults:
    def __init__(
        self, *, store: AttestationStore, audit: DecisionLog, policy: PolicyEngine
    ) -> None:
        self.store = store
        self._audit = audit
        self._policy = policy
        self._swept: dict[str, datetime] = {}  # revoked device/RIM -> when results were swept

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
        change, at start-up and again until a failed run succeeds (``redecide.py``).

        Revoked results whose record is overdue get it written here (``trigger`` ``record``).

        Returns the number revoked here. Raises: UpstreamError (store or policy down, or
        ``RecordsOwed``: records not due yet, so this run is not done)."""
        revoked = owed = 0
        for entry in await self.store.unexpired(now):
            await asyncio.sleep(0)  # thousands of results: let requests run between decisions
            if entry.status != ACTIVE:
                owed += await self._write_owed(entry, now)
                continue
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
        if owed:
            raise RecordsOwed(owed)
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
            for entry in await self.store.unexpired(now):
                if entry.status != ACTIVE:
                    continue
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

    async def _write_owed(self, entry: AttestationEntry, now: datetime) -> int:
        """Write a revoked result's record its revoker did not write: 0 when none is owed or it
        is written here, 1 when its revoker may still write it (not due yet) or another
        process just took it over."""
        if entry.record_due is None:
            return 0
        if entry.record_due > now or not await claim_record(self.store, entry.jti, now):
            return 1
        await self._log_revocation(entry.jti, entry, now, who="broker", trigger="record")
        return 0

    async def _log_revocation(
        self, jti: str, entry: AttestationEntry, now: datetime, *, who: str, **facts: Any
    ) -> None:
        """The ``attestation_revoked`` record, then the store told it is written."""
        await self._audit.append_entry(
            {
                "type": RecordType.ATTESTATION_REVOKED,
                "jti": jti,
                "time": now.isoformat(),
                "who": who,
                "reason": entry.reason,
                **facts,
            }
        )
        try:
            await record_written(self.store, jti, now)
        except BrokerError as exc:  # written, not noted: a later run may write it once more
            log.warning("revocation of %s recorded; noting that failed: %s", jti, exc.message)
