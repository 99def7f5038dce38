"""A decision record names the policy that decided, not the one live when the record is written.

The release plan and the decision kernel are real (with a ``DecisionLog`` on disk); the
upstreams around them are small stand-ins whose one job is to let the test swap the policy while
the key unwrap is awaited.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from broker.attestation.pipeline import VerifiedEvidence
from broker.audit.log import DecisionLog
from broker.audit.records import iter_records
from broker.core.metrics import Metrics
from broker.core.protocol import Algorithm
from broker.crypto.jwk import public_jwk
from broker.decisions.kernel import Kernel
from broker.decisions.policy import PolicyGate
from broker.decisions.release import ReleasePlan
from broker.keys.store.base import KeyVersionRecord, Purpose, VersionState
from broker.policy.engine import Decision
from broker.stores.nonces import VerifiedChallenge

NOW = datetime(2026, 12, 1, tzinfo=UTC)
DECIDING, SUCCESSOR = "sha256:" + "a" * 64, "sha256:" + "b" * 64


class SwappingPolicy:
    """Allows under ``DECIDING``; the reload that follows makes ``SUCCESSOR`` live."""

    digest = DECIDING

    async def evaluate(
        self, policy_input: Mapping[str, Any], *, encoded: bytes | None = None
    ) -> Decision:
        return Decision(True, (), self.digest)


class Nonces:
    def verify_challenge(self, nonce: str, now: datetime) -> VerifiedChallenge:
        return VerifiedChallenge(nonce, now)

    async def spend_challenge(self, challenge: VerifiedChallenge, now: datetime) -> None:
        return None


class Verifier:
    async def verify(self, unverified: Any, **binding: Any) -> VerifiedEvidence:
        return VerifiedEvidence(tee={"verifier": "gca"}, raw_claims={}, identity={})


class KeysReloadingDuringUnwrap:
    def __init__(self, policy: SwappingPolicy) -> None:
        self.policy = policy

    async def resolve(self, name: str, version: int | None) -> KeyVersionRecord:
        return KeyVersionRecord(
            name=name,
            version=1,
            purpose=Purpose.GENERIC,
            state=VersionState.ENABLED,
            wrapped_dek=b"",
            kek_ref="test",
            created_at=NOW,
            algorithm=Algorithm.AES_256,
        )

    def check_release(self, record: KeyVersionRecord, mode: str, runner_key: object) -> None:
        """The DEK is not held by an HSM: released through ``unwrap``."""

    async def unwrap(self, record: KeyVersionRecord) -> bytes:
        await asyncio.sleep(0)  # the KEK round trip, during which a reload goes live
        self.policy.digest = SUCCESSOR
        return bytes(32)


async def test_reload_during_unwrap_does_not_reattribute_the_decision(tmp_path: Path) -> None:
    policy = SwappingPolicy()
    audit = DecisionLog(tmp_path / "decisions.log")
    await audit.open()
    plan = ReleasePlan(
        nonces=Nonces(),  # type: ignore[arg-type]
        verifier=Verifier(),  # type: ignore[arg-type]
        keys=KeysReloadingDuringUnwrap(policy),  # type: ignore[arg-type]
        policy=PolicyGate(policy, mask=(), mask_key=bytes(32)),
    )
    runner_key = public_jwk(ec.generate_private_key(ec.SECP256R1()).public_key())
    body = {"key": "models/llama", "nonce": "n" * 43, "evidence": {}, "runner_key": runner_key}
    released = await Kernel(audit, Metrics()).run(plan, body, now=NOW, request_id="r1")
    await audit.close()
    assert policy.digest == SUCCESSOR  # the swap happened before the record was written
    records = [r for _, r in iter_records((tmp_path / "decisions.log").read_bytes())]
    (record,) = [r for r in records if r.get("decision_id") == released.decision_id]
    assert record["result"] == "allow"
    assert record["policy_digest"] == DECIDING, json.dumps(record)
