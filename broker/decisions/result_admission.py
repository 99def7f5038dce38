"""What every request made on an attestation result passes first (issue 19, issue 32): the EAR
under DPoP admitted, once, the same way for a release (``attested_release.py``) and for a
workload certificate (``identity.py``).

1. the EAR: this broker's result key, ``iss``/``aud``, times (``ear.verify_ear``; once per
   worker and token while its key holds, its times at every request: ``attested_cache.py``);
2. the DPoP proof: its key is the EAR's ``cnf.jwk`` (checked before anything else of it), then
   ``htm``, ``htu`` (one of ``[server] public_urls`` + the route, never the request's ``Host``),
   ``iat``, ``ath`` of this EAR, the server's ``DPoP-Nonce`` (when required)
   (``dpop.verify_dpop_proof``);
3. the stored attestation: known, unexpired, not revoked (the shared store, read on every
   request: every worker and replica sees a revocation at once), and the one the result was
   signed for (matched once per stored entry: ``attested_cache.prepare``);
4. the proof's ``jti`` spent in the shared store (a replayed proof: ``dpop_proof_reused``);
   over the network (Redis, PostgreSQL) asked together with step 3, its errors reported after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.ear import PresentedEar
from broker.attestation.stored import REVOKED, AttestationEntry, AttestationStore
from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.dpop import (
    FUTURE_LEEWAY,
    MAX_PROOF_AGE,
    DpopError,
    DpopProof,
    verify_dpop_proof,
)
from broker.decisions.attested_cache import PreparedAttestation, ResultCache, prepare
from broker.decisions.attested_request import Presented, presented_token
from broker.stores.nonces import NonceStore

ResultKeys = Callable[[], Mapping[str, ec.EllipticCurvePublicKey]]


@dataclass
class Admitted:
    """What admitting a result learned, in order (a record names whatever was reached)."""

    ear: PresentedEar | None = None
    proof: DpopProof | None = None
    entry: AttestationEntry | None = None
    prepared: PreparedAttestation | None = None  # the entry, matched to the result: reused


def _untimed(stage: str) -> None:
    """No lap: ``Server-Timing`` is off."""


@dataclass(kw_only=True, eq=False)
class ResultAdmission:
    """The EAR under DPoP, admitted (steps 1 to 4): a plan on a result inherits it."""

    issuer: str  # the audience results are made for: this broker's
    result_keys: ResultKeys
    store: AttestationStore
    nonces: NonceStore
    public_urls: Sequence[str] = ()
    require_nonce: bool = True
    # the stores answer over the network (Redis, PostgreSQL): the entry is read and the proof's
    # jti spent at once, two round trips in the time of one (SQLite's thread: measured slower)
    networked_store: bool = False
    # results this worker verified, and the entries prepared on them (attested_cache.py)
    results: ResultCache = field(default_factory=ResultCache)

    def urls_for(self, route: str) -> tuple[str, ...]:
        """What a proof's ``htu`` must name: a ``[server] public_urls`` entry and ``route``
        (none configured, none accepted)."""
        return tuple(url.rstrip("/") + route for url in self.public_urls)

    def server_nonce(self, now: datetime) -> str:
        """The ``DPoP-Nonce`` every answer carries (the next proof's)."""
        return self.nonces.server_nonce(now)

    async def admit(
        self,
        admitted: Admitted,
        presented: Presented,
        *,
        urls: Sequence[str],
        now: datetime,
        lap: Callable[[str], None] = _untimed,
        check: Callable[[PreparedAttestation], None] | None = None,
    ) -> PreparedAttestation:
        """Steps 1 to 4, each one's finding kept in ``admitted`` as it is made; ``check`` (the
        plan's own test of the prepared entry) runs before the proof is spent.

        Raises:
            BrokerError: the step's own code (``attestation_revoked``, ``dpop_*``, …).
        """
        token = presented_token(presented.authorization)
        held = self.results.verify(token, keys=self.result_keys(), audience=self.issuer, now=now)
        admitted.ear = ear = held.ear
        lap("ear")
        admitted.proof = checked = verify_dpop_proof(
            presented.proof,
            method="POST",
            url=urls,
            now=now,
            access_token=token,
            nonce_valid=(lambda n: self.nonces.server_nonce_valid(n, now))
            if self.require_nonce
            else None,
            bound_to=ear.pop_thumbprint,
        )
        lap("proof")
        # the stored entry, and the proof's jti spent: at once over the network; else the entry
        # first, then the spend (no task for what needs no wait); errors in the same order
        spent: BaseException | None = None
        if self.networked_store:
            read, spending = await asyncio.gather(
                self.store.get(ear.jti, now), self._spend(ear, checked, now), return_exceptions=True
            )
            if isinstance(read, BaseException):
                raise read
            entry = read
            spent = spending if isinstance(spending, BaseException) else None
        else:
            entry = await self.store.get(ear.jti, now)
        if entry is None:
            raise AttestationError(
                "this attestation result is unknown here or expired; attest again",
                code=ErrorCode.ATTESTATION_UNKNOWN,
            )
        admitted.entry = entry
        if entry.status == REVOKED:
            raise AttestationError(
                f"this attestation result was revoked: {entry.reason}",
                code=ErrorCode.ATTESTATION_REVOKED,
                reason=entry.reason,
            )
        prepared = held.prepared_for(entry)
        if prepared is None:  # first use of this entry here (or it changed): checked in full
            held.prepared = prepared = prepare(ear, entry)
        admitted.prepared = prepared
        if check is not None:
            check(prepared)
        if not self.networked_store:
            await self._spend(ear, checked, now)
        elif spent is not None:
            raise spent
        lap("store")
        return prepared

    async def _spend(self, ear: PresentedEar, proof: DpopProof, now: datetime) -> None:
        """Step 4: the proof's ``jti`` spent (good once, in the store every worker and replica
        shares).

        Raises:
            DpopError: ``dpop_proof_reused``; UpstreamError: the store's.
        """
        try:
            await self.nonces.spend_jti(
                f"dpop:{ear.pop_thumbprint}:{proof.jti}",
                proof.issued_at + MAX_PROOF_AGE + FUTURE_LEEWAY,
                now,
            )
        except AttestationError as exc:
            if exc.code is not ErrorCode.NONCE_REUSED:
                raise
            raise DpopError(
                "this DPoP proof was already used; sign a new one per request",
                code=ErrorCode.DPOP_PROOF_REUSED,
            ) from exc
