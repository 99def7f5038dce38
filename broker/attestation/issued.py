"""The workload certificates (issue 32) issued on one attestation result, as its store entry
lists them: what ``GET /v1/attestations/{jti}`` answers as ``identities`` so that a peer can
tell a certificate this broker issued from one signed with the CA key elsewhere (the same jti
copied into a forged leaf is not enough: its SHA-256 is not listed). Pure data; the entry
(``stored.py``) holds them and ``stored.note_certificate`` adds one in the store's atomic
update, so every worker and replica lists the same certificates.

Bounded: the newest ``MAX_IDENTITIES``, expired ones dropped whenever one is added. Serials,
SPIFFE IDs and fingerprints are no secrets (every peer of the runner sees its certificate).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

MAX_IDENTITIES = 16  # certificates an entry lists: the newest (an older one drops off first)
MAX_SPIFFE_ID_CHARS = 2048  # SPIFFE ID §2.3
_SERIAL = re.compile(r"[0-9a-f]{1,40}")  # RFC 5280 §4.1.2.2: at most 20 octets
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class IssuedCertificate:
    """One leaf issued on the result: its serial (lower-case hex), SPIFFE ID, the SHA-256 of
    its DER (lower-case hex) and its expiry."""

    serial: str
    spiffe_id: str
    sha256: str
    not_after: datetime

    def stored(self) -> dict[str, Any]:
        """As the store keeps it (times as seconds, like the entry's)."""
        return {
            "serial": self.serial,
            "spiffe_id": self.spiffe_id,
            "sha256": self.sha256,
            "not_after": self.not_after.timestamp(),
        }

    def described(self) -> dict[str, str]:
        """As the status answer shows it (``not_after`` in RFC 3339)."""
        return {
            "serial": self.serial,
            "spiffe_id": self.spiffe_id,
            "sha256": self.sha256,
            "not_after": self.not_after.isoformat().replace("+00:00", "Z"),
        }


def with_certificate(
    listed: Sequence[IssuedCertificate], certificate: IssuedCertificate, now: datetime
) -> tuple[IssuedCertificate, ...]:
    """``listed`` without what expired by ``now``, then ``certificate``: the newest
    ``MAX_IDENTITIES``."""
    kept = [c for c in listed if c.not_after > now]
    return (*kept, certificate)[-MAX_IDENTITIES:]


def parse_identities(value: Any) -> tuple[IssuedCertificate, ...]:
    """An entry's ``identities`` member as a store holds it, each field checked (absent: none).

    Raises:
        TypeError, ValueError: naming what is in an unexpected form.
    """
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_IDENTITIES:
        raise ValueError(f"identities is not a list of at most {MAX_IDENTITIES}")
    return tuple(_certificate(item) for item in value)


def _certificate(item: Any) -> IssuedCertificate:
    if not isinstance(item, Mapping):
        raise TypeError("an identities item is not an object")
    serial, spiffe_id, sha256 = item.get("serial"), item.get("spiffe_id"), item.get("sha256")
    if not isinstance(serial, str) or not _SERIAL.fullmatch(serial):
        raise ValueError("an identities item's serial is not lower-case hex")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise ValueError("an identities item's sha256 is not a SHA-256 in lower-case hex")
    if (
        not isinstance(spiffe_id, str)
        or not spiffe_id.startswith("spiffe://")
        or len(spiffe_id) > MAX_SPIFFE_ID_CHARS
    ):
        raise ValueError("an identities item's spiffe_id is not a SPIFFE ID")
    seconds = item.get("not_after")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError("an identities item's not_after is not a number")
    try:
        not_after = datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError) as exc:
        raise ValueError("an identities item's not_after is out of range") from exc
    return IssuedCertificate(serial, spiffe_id, sha256, not_after)
