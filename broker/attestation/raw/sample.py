"""The ``sample`` evidence of guest-components' sample attester (``attestation-agent/attester/
src/sample``): ``{"svn": "1", "report_data": "<standard base64 of the report data>"}``, as a guest
without a TEE sends it (it falls back to it silently). Nothing about it is signed: it proves
nothing, and the KBS facade registers this verifier only while the development switch
``[kbs] allow_sample_evidence`` is on (docs/kbs.md); otherwise ``sample`` is refused with its
own code.

Steps (Trustee's ``deps/verifier/src/sample`` reads the same two members):

1. the evidence is an object with exactly ``svn`` and ``report_data``, both strings;
2. ``svn`` is short and printable (it is shown to the policy);
3. ``report_data`` is standard base64 of at most 64 bytes (the guest sends the bare digest of
   its runtime data, 32 to 64 bytes), padded with zeros to 64 as a TDX or SNP report holds it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from broker.attestation.raw import REPORT_DATA_BYTES, VerifiedRawEvidence, unsigned_sections
from broker.core.errors import AttestationError, ErrorCode

SAMPLE_TEE = "sample"
MAX_SVN_CHARS = 32
MEMBERS = frozenset({"svn", "report_data"})


class SampleVerifier:
    """``RawVerifier`` for ``sample`` (no signature: a development switch enables it)."""

    tee_names: tuple[str, ...] = (SAMPLE_TEE,)

    async def verify(
        self, primary_evidence: Mapping[str, Any], *, now: datetime
    ) -> VerifiedRawEvidence:
        """Steps 1 to 3 above.

        Raises:
            AttestationError: ``evidence_malformed`` naming the member.
        """
        if not isinstance(primary_evidence, Mapping) or set(primary_evidence) != MEMBERS:
            raise _malformed("sample evidence is an object of exactly svn and report_data")
        svn, encoded = primary_evidence["svn"], primary_evidence["report_data"]
        if not isinstance(svn, str) or not svn.isprintable() or len(svn) > MAX_SVN_CHARS:
            raise _malformed(f"sample svn is a printable string of at most {MAX_SVN_CHARS}")
        if not isinstance(encoded, str):
            raise _malformed("sample report_data is a base64 string")
        try:
            report_data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _malformed("sample report_data is not standard base64") from exc
        if len(report_data) > REPORT_DATA_BYTES:
            raise _malformed(f"sample report_data is longer than {REPORT_DATA_BYTES} bytes")
        return VerifiedRawEvidence(
            technology=SAMPLE_TEE,
            report_data=report_data.ljust(REPORT_DATA_BYTES, b"\0"),
            tee={
                **unsigned_sections(),
                "verifier": "local",
                "technology": SAMPLE_TEE,
                "debug": False,  # as Trustee's sample verifier says; nothing is verified
                "measurements": {"svn": svn},
            },
            claims={"svn": svn, "report_data": encoded},
            verified_at=now,
        )


def _malformed(message: str) -> AttestationError:
    return AttestationError(message, code=ErrorCode.EVIDENCE_MALFORMED)
