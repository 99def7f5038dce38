"""Policy evaluation, one way for every plan: canonical input → digest → evaluate → mask.

The input is encoded once (canonical JSON): those bytes are digested for the record and are the
very bytes the engine reads, so the recorded ``input_digest`` is the digest of what decided.
Progress is kept in an ``Evaluation`` before the engine is asked, so that a failing or buggy
engine still leaves the input and its digest in the record. In the record the input is masked
(``[audit] mask`` and the policy's own ``mask`` rule, keyed by the log's mask key) so that
``broker policy replay`` can decide it again without reading masked values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from broker.audit.mask import masked
from broker.core.encoding import Encoded, canonical
from broker.core.errors import PolicyDenied
from broker.policy.engine import Decision, PolicyEngine


@dataclass
class Evaluation:
    """What one evaluation got to: its input and digest first, then the engine's decision."""

    policy_input: dict[str, Any] | None = None
    input_digest: str | None = None
    decision: Decision | None = None
    encoded: bytes | None = None  # canonical(policy_input): what was digested and evaluated


class PolicyGate:
    """The policy engine in force, as every plan asks it and records its answer."""

    def __init__(self, engine: PolicyEngine, *, mask: tuple[str, ...], mask_key: bytes) -> None:
        self.engine = engine
        self._mask = mask
        self._mask_key = mask_key

    async def allow(
        self,
        evaluation: Evaluation,
        policy_input: dict[str, Any],
        *,
        decision_id: str,
        encoded: bytes | None = None,
    ) -> Decision:
        """Evaluate ``policy_input``, keeping its progress in ``evaluation``. ``encoded``: its
        canonical JSON when the caller made it already (``canonical(policy_input)``, byte for
        byte: a release on a result splices the stored claims' encoding, encoded once).

        Returns:
            The decision, which allows.

        Raises:
            PolicyDenied: the policy does not allow it (its reasons, sorted).
            UpstreamError: the engine did not answer (``policy_unavailable``).
        """
        if encoded is None:  # digested, and the very bytes the policy reads
            encoded = canonical(policy_input)
        evaluation.input_digest = "sha256:" + hashlib.sha256(encoded).hexdigest()
        evaluation.policy_input, evaluation.encoded = policy_input, encoded
        evaluation.decision = decision = await self.engine.evaluate(policy_input, encoded=encoded)
        if not decision.allowed:
            raise PolicyDenied(decision.reasons, decision_id)
        return decision

    @property
    def mask_key(self) -> bytes:
        return self._mask_key

    def masks(self, evaluation: Evaluation) -> tuple[str, ...]:
        """The pointers masked in ``evaluation``'s recorded input: ``[audit] mask`` and the
        policy's own ``mask`` rule."""
        decision = evaluation.decision
        return (*self._mask, *(decision.mask if decision is not None else ()))

    def record(
        self, evaluation: Evaluation, *, masked_input: Encoded | None = None
    ) -> dict[str, Any]:
        """The record's members for ``evaluation``: reasons, policy and input digests, input
        (``masked_input``: that input masked and encoded by the caller, who made it from parts
        encoded once: ``canonical(masked(input, self.masks(evaluation), self.mask_key))``)."""
        decision = evaluation.decision
        return {
            "reasons": [] if decision is None else list(decision.reasons),
            # the digest of the engine that decided (a reload during the key unwrap must not
            # attribute this decision to its successor); no decision: the policy in force
            "policy_digest": self.engine.digest if decision is None else decision.policy_digest,
            "input_digest": evaluation.input_digest,
            # the policy input, masked, so that `broker policy replay` can re-decide it
            "input": masked_input
            if masked_input is not None
            else None
            if evaluation.policy_input is None
            else masked(evaluation.policy_input, self.masks(evaluation), self._mask_key),
        }
