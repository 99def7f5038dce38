"""Raw hardware evidence the broker verifies itself (issue 33): Intel TDX quotes with DCAP
collateral (``raw/tdx.py``) and AMD SEV-SNP attestation reports with the VCEK/VLEK chain
(``raw/snp.py``), as Confidential Containers guests send them over the KBS protocol.

Every verifier answers one :class:`VerifiedRawEvidence` or raises ``AttestationError`` with a
stable code; nothing else leaves it. The ``tee`` mapping is the policy input's ``tee`` section
in the same shape the token verifiers produce (``attestation/claims.py``: technology,
debug, tcb_status, measurements, …) with ``verifier: "local"``, so one policy reads every kind.
The report data is the 64 bytes the hardware signed; the caller compares it with the binding
it expects (the KBS facade: hash of JCS of ``tee-pubkey``, nonce, additional evidence).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

REPORT_DATA_BYTES = 64


@dataclass(frozen=True)
class VerifiedRawEvidence:
    """Evidence whose signature, chain and collateral verified at ``verified_at``."""

    technology: str  # "tdx" | "sev-snp" | "sample"
    report_data: bytes  # exactly as signed (64 bytes on TDX and SNP)
    tee: Mapping[str, Any]  # the policy input's ``tee`` section
    claims: Mapping[str, Any] = field(default_factory=dict)  # parsed fields, for ``claims[…]``
    verified_at: datetime | None = None
    # the launch field the host binds init-data into, as signed: ("mrconfigid", 48 bytes) on
    # TDX, ("host_data", 32 bytes) on SEV-SNP; None where there is none (sample)
    init_data_field: tuple[str, bytes] | None = None


def unsigned_sections() -> dict[str, Any]:
    """The ``tee`` members raw evidence has no value for, in the token verifiers' shape
    (``claims.ita_tee``) with empty values: one policy reads every kind, and a rule on one of
    them (a Confidential Space requirement) finds an empty value, never a missing field."""
    return {
        "issuer": "",
        "secure_boot": False,  # no quote or report says anything of the guest's firmware boot
        "software": {"name": "", "version": "", "support": []},
        "workload": {
            "image_reference": "",
            "image_digest": "",
            "image_id": "",
            "restart_policy": "",
            "service_accounts": [],
        },
        "platform": {
            "project_id": "",
            "project_number": "",
            "zone": "",
            "instance_id": "",
            "instance_name": "",
        },
        "tcb_status": "",
        "advisory_ids": [],
    }


class RawVerifier(Protocol):
    """One hardware kind. ``tee_names`` are the KBS ``tee`` values it answers for."""

    tee_names: tuple[str, ...]

    async def verify(
        self, primary_evidence: Mapping[str, Any], *, now: datetime
    ) -> VerifiedRawEvidence:
        """Verify the guest's ``primary_evidence`` object (the KBS ``tee-evidence`` member,
        already JSON-parsed and size-bounded); the caller checks the report data binding."""
        ...
