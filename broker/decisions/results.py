"""Attestation results after they were issued (issue 19, issue 27): their status, an admin's
revocation, re-deciding every active result when the attestation policy may have changed, and
revoking the results whose evidence named a GPU or RIM signer OCSP has since revoked. Each
revocation is one ``attestation_revoked`` record; the shared store makes it every worker's and
replica's at once. Issuing a result is the attestation plan (``attest.py``).

A revocation takes effect before its record is written (a log that does not answer must not
keep a revoked result usable), so the store entry holds the whole record (who, when, why) as
owed, in the same atomic update, until it is written; the store keeps the entry that long,
past its expiry if need be. Whoever revoked writes it. If the log does not take it, the
record is handed to the owed-record pass (``write_owed``, run every ``PASS_INTERVAL`` by each
process: ``owed.py``) and this process's pass is woken; if the revoker stops first (a crash),
any pass writes it once ``RECORD_GRACE`` has gone by. A record written so is the revoker's,
rebuilt from checked fields and marked ``written_late`` (docs/decisions.md, "Revocations are
recorded after they take effect"; "The attestation store's content is checked")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from broker.attestation.late import late_record
from broker.attestation.service import VerifiedEvidence
from broker.attestation.stored import (
    ACTIVE,
    AttestationEntry,
    AttestationStore,
    MalformedEntry,
    claim_record,
    hand_over,
    record_written,
    revoke,
    revoked_sightings,
    used_by,
)
from broker.audit.log import DecisionLog
from broker.core.errors import BrokerError, NotFound, UpstreamError
from broker.core.records import RecordType
from broker.policy.engine import PolicyEngine

log = logging.getLogger(__name__)
SWEEP_INTERVAL = timedelta(seconds=30)  # a revoked device's results are looked for once per this


class AttestationResults:
    def __init__(
        self, *, store: AttestationStore, audit: DecisionLog, policy: PolicyEngine
    ) -> None:
        self.store = store
        self._audit = audit
        self._policy = policy
        self._swept: dict[str, datetime] = {}  # revoked device/RIM -> when results were swept
        self._owed_listeners: list[Callable[[], None]] = []

    def on_owed(self, listener: Callable[[], None]) -> None:
        """``listener()`` whenever a record this process revoked could not be written (an
        owed-record pass soon)."""
        self._owed_listeners.append(listener)

    async def status(self, jti: str, now: datetime) -> AttestationEntry:
        """Raises: NotFound when unknown or expired; UpstreamError when the store is down."""
        entry = await self.store.get(jti, now)
        if entry is None:
            raise NotFound("no such attestation (unknown or expired)")
        return entry

    async def revoke(self, jti: str, *, reason: str, who: str, now: datetime) -> AttestationEntry:
        """Revoke in the shared store (every worker and replica refuses it from now on), then
        log who did it and why (the first revocation's reason stays; revoking again is logged
        with that reason too).

        Raises: NotFound, UpstreamError (the store; or the log, when the revocation is in
        effect and its record owed: an owed-record pass writes it)."""
        revocation = await revoke(self.store, jti, reason, now, who=who)
        if revocation is None:
            raise NotFound("no such attestation (unknown or expired)")
        if revocation.newly:
            await self._record(revocation.entry, now)
        else:  # nothing changed, so nothing is owed: this record only says who asked again
            await self._audit.append_entry(
                {
                    "type": RecordType.ATTESTATION_REVOKED,
                    "jti": jti,
                    "time": now.isoformat(),
                    "who": who,
                    "reason": revocation.entry.reason,
                }
            )
        return revocation.entry

    async def revalidate(self, *, who: str, now: datetime, trigger: str = "policy_change") -> int:
        """Re-decide every unexpired active attestation with the attestation policy now in
        force, on its stored input at ``now``; revoke (for every worker and replica, one record
        each, naming ``trigger``) those it no longer allows. Several workers re-deciding at
        once log each revocation once (the store says who revoked first). Run after each policy
        change, at start-up and again until a failed run succeeds (``redecide.py``). A record
        the log does not take is owed, not a failure: the revocation is in effect.

        Returns the number revoked here. Raises: UpstreamError (store or policy down)."""
        revoked = 0
        for entry in await self.store.unexpired(now):
            await asyncio.sleep(0)  # thousands of results: let requests run between decisions
            if entry.status != ACTIVE:
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
        return revoked

    async def write_owed(self, now: datetime) -> int:
        """One owed-record pass: write each revocation record owed and due at ``now`` (its
        revoker stopped, or handed it over), claimed first so that one process writes it, as
        its revoker made it, rebuilt from checked fields (``late.late_record``: never the
        store's content as is), plus ``written_late`` and ``written_at``. An entry in an
        unexpected form is logged and skipped. A record the log does not take is handed back
        and the pass stops: the next one tries again.

        Returns the number written here. Raises: UpstreamError (the store)."""
        written = 0
        for listed in await self.store.owed():
            if listed.record_due is None or listed.record_due > now:
                continue
            try:
                claimed = await claim_record(self.store, listed.jti, now)
            except MalformedEntry:  # rewritten since it was listed (logged): the others go on
                continue
            if claimed is None:  # not due any more, another process's, or written
                continue
            try:
                await self._write(claimed.jti, late_record(claimed, now), now)
            except UpstreamError as exc:
                log.warning(
                    "the revocation record owed for %s was not written; the next pass "
                    "tries again: %s",
                    claimed.jti,
                    exc.message,
                )
                break
            written += 1
        return written

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
        """Revoke; log it when this call revoked it (1), not when it already was (0). A record
        the log does not take is owed (a pass writes it); the revocation stands and counts."""
        revocation = await revoke(self.store, jti, reason, now, who=who, facts=facts)
        if revocation is None or not revocation.newly:
            return 0
        try:
            await self._record(revocation.entry, now)
        except UpstreamError as exc:
            log.warning("revoked %s; its record is owed, not written: %s", jti, exc.message)
        return 1

    async def _record(self, entry: AttestationEntry, now: datetime) -> None:
        """Its revoker writes the record the revocation left owed. One the log does not take
        is handed to the passes, and this process's pass woken.

        Raises: UpstreamError (the log)."""
        if entry.pending_record is None:  # not owed
            return
        try:
            await self._write(entry.jti, entry.pending_record, now)
        except UpstreamError:
            for listener in self._owed_listeners:
                listener()
            raise

    async def _write(self, jti: str, record: Mapping[str, Any], now: datetime) -> None:
        """Append ``record``, then clear what the entry owes; a caller cancelled in between
        cuts neither short (a record written and still owed would be written twice). The log
        not taking it: handed over (due at once), then raised.

        Raises: UpstreamError (the log)."""
        await asyncio.shield(self._append_then_clear(jti, record, now))

    async def _append_then_clear(self, jti: str, record: Mapping[str, Any], now: datetime) -> None:
        try:
            await self._audit.append_entry(record)
        except UpstreamError:
            with contextlib.suppress(BrokerError):  # the store down too: due when its grace ends
                await hand_over(self.store, jti, now)
            raise
        try:
            await record_written(self.store, jti, now)
        except BrokerError as exc:  # written, not noted: a later pass may write it once more
            log.warning("revocation of %s recorded; noting that failed: %s", jti, exc.message)
