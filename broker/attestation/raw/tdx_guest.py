"""The TDX evidence object Confidential Containers guests send (KBS ``tee-evidence``
``primary_evidence`` for ``tee: "tdx"``). Pure; nothing verified.

guest-components ``attestation-agent/attester/src/tdx/mod.rs`` (``TdxEvidence``, serde):
``{"cc_eventlog": <standard base64> | null, "quote": <standard base64>}``; guests of 2024
(guest-components before ``read_eventlog``) also send ``aa_eventlog`` (the AA event log as
text). Trustee's verifier (``deps/verifier/src/tdx/mod.rs``) reads the same struct and, like
serde, ignores other members; so does this parser (a newer guest must not be locked out by a
member it adds), but it bounds their number and checks the types and sizes of those it reads.

The event log is carried, not replayed: its SHA-384 is kept for the claims; RTMRs are what the
quote signs and what the policy sees.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.attestation.raw.tdx_quote import MAX_QUOTE_BYTES
from broker.core.errors import AttestationError, ErrorCode

MAX_MEMBERS = 16
MAX_EVENTLOG_BYTES = 1024 * 1024  # a CCEL with the AA log is tens of KiB
MAX_AA_EVENTLOG_CHARS = 1024 * 1024


@dataclass(frozen=True)
class TdxGuestEvidence:
    quote: bytes
    cc_eventlog: bytes | None  # CCEL (+ AAEL), as the guest sent it
    aa_eventlog: str | None  # 2024 guests only


def _malformed(problem: str) -> AttestationError:
    return AttestationError(f"TDX evidence: {problem}", code=ErrorCode.EVIDENCE_MALFORMED)


def parse_tdx_evidence(unverified: Mapping[str, Any]) -> TdxGuestEvidence:
    """Read a guest's TDX evidence object.

    Raises:
        AttestationError: ``evidence_malformed`` (not an object, too many members, ``quote``
            missing or not base64, an event log of the wrong type or too large).
    """
    if not isinstance(unverified, Mapping):
        raise _malformed("not a JSON object")
    if len(unverified) > MAX_MEMBERS:
        raise _malformed(f"more than {MAX_MEMBERS} members")
    quote_text = unverified.get("quote")
    if not isinstance(quote_text, str) or not quote_text:
        raise _malformed('"quote" must be a non-empty base64 string')
    if len(quote_text) > (MAX_QUOTE_BYTES * 4) // 3 + 4:
        raise _malformed(f'"quote" is larger than {MAX_QUOTE_BYTES} bytes')
    eventlog = unverified.get("cc_eventlog")
    if eventlog is not None and not isinstance(eventlog, str):
        raise _malformed('"cc_eventlog" must be a base64 string or null')
    if eventlog is not None and len(eventlog) > (MAX_EVENTLOG_BYTES * 4) // 3 + 4:
        raise _malformed(f'"cc_eventlog" is larger than {MAX_EVENTLOG_BYTES} bytes')
    aa_eventlog = unverified.get("aa_eventlog")
    if aa_eventlog is not None and not isinstance(aa_eventlog, str):
        raise _malformed('"aa_eventlog" must be a string or null')
    if aa_eventlog is not None and len(aa_eventlog) > MAX_AA_EVENTLOG_CHARS:
        raise _malformed(f'"aa_eventlog" is longer than {MAX_AA_EVENTLOG_CHARS} characters')
    return TdxGuestEvidence(
        quote=_base64(quote_text, "quote"),
        cc_eventlog=_base64(eventlog, "cc_eventlog") if eventlog else None,
        aa_eventlog=aa_eventlog,
    )


def _base64(text: str, name: str) -> bytes:
    """Standard base64 with padding, as the guest's ``STANDARD`` engine writes it."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _malformed(f'"{name}" is not standard base64') from exc
