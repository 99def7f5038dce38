"""The identity policy's answer as the broker reads it (issue 32): a SPIFFE ID, or none.

``data.broker.identity`` answers ``allow``, ``reasons`` and ``spiffe_path``; the workload
certificate's one URI SAN is ``spiffe://<trust domain>/<spiffe_path>``. One reading, shared by
the two places that need it, so that they cannot drift apart:

* ``POST /v1/identity`` (``decisions/identity.py``), which issues a certificate for the ID;
* ``broker policy replay`` (``cli/policy.py``), which re-decides a logged ``identity`` record
  with a candidate policy and reports a changed ID as a changed decision.

Fail closed: a deny, or an allow whose path is not a SPIFFE ID path (missing, empty, a ``..``
segment, a wildcard), is no identity. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.crypto.svid import spiffe_id
from broker.policy.engine import Decision


@dataclass(frozen=True)
class Assignment:
    """The SPIFFE ID a decision gives (``None``: none) and its reasons."""

    spiffe_id: str | None
    reasons: tuple[str, ...]

    @property
    def allowed(self) -> bool:
        return self.spiffe_id is not None


def assignment(decision: Decision, trust_domain: str) -> Assignment:
    """The SPIFFE ID ``decision`` gives in ``trust_domain``.

    Returns:
        The ID with the policy's reasons; for a deny, none with the policy's reasons; for an
        allow whose ``spiffe_path`` is not a SPIFFE ID path, none with that one reason.
    """
    if not decision.allowed:
        return Assignment(None, decision.reasons)
    try:
        return Assignment(spiffe_id(trust_domain, decision.spiffe_path or ""), decision.reasons)
    except ValueError as exc:
        return Assignment(None, (f"the identity policy's spiffe_path: {exc}",))
