"""Encodings every layer shares: strict unpadded base64url and canonical JSON."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def b64url_decode(text: str) -> bytes:
    """Decode unpadded base64url strictly: the alphabet, the length, and the canonical form.

    The last character of a base64 string carries unused bits; a decoder that ignores them
    lets several strings decode to the same bytes (RFC 4648 §3.5). Those are refused, as PyJWT
    refuses them in signatures: one signed token has exactly one spelling, so digests and
    replay checks over token strings cannot be sidestepped.

    Raises:
        ValueError: on characters outside the base64url alphabet, a bad length, or a
            non-canonical final character.
    """
    if "=" in text or "+" in text or "/" in text:
        raise ValueError("not unpadded base64url")
    try:
        decoded = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError("not base64url") from exc
    if b64url_encode(decoded) != text:
        raise ValueError("not canonical base64url")
    return decoded


def b64url_encode(data: bytes) -> str:
    """Unpadded base64url."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def canonical(record: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces, UTF-8.

    A lone surrogate (JSON allows ``"\\ud800"``; Python keeps it in the str) cannot be UTF-8;
    ``backslashreplace`` writes it back as the same JSON escape, so the line stays valid UTF-8,
    parses to the same value, and re-canonicalises to the same bytes.
    """
    return _CANONICAL.encode(record).encode("utf-8", "backslashreplace")


# ``json.dumps`` with these options builds this encoder on every call (~1 µs, paid ~20 times per
# release); it holds only its options, so one serves every call and thread.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


@dataclass(frozen=True, slots=True)
class Encoded:
    """A value already written as canonical JSON (``canonical(value)``, byte for byte): a member
    that holds one is spliced where it stands, not encoded again (``canonical_members``)."""

    text: bytes


def canonical_members(members: Mapping[str, Any]) -> bytes:
    """``canonical(members)`` without its braces (b"" when empty), each ``Encoded`` value's
    text spliced in: runs of other members are encoded together, in the sorted order
    ``canonical`` writes them (issue 31: a record holding an attestation's claims does not
    encode them again per release).

    Raises:
        TypeError, ValueError: as ``canonical`` (a value JSON cannot hold); a key not a str.
    """
    out: list[bytes] = []
    run: dict[str, Any] = {}
    for name in sorted(members):
        if not isinstance(name, str):
            raise TypeError("record members are named by strings")
        value = members[name]
        if not isinstance(value, Encoded):
            run[name] = value
            continue
        if run:
            out.append(canonical(run)[1:-1])
            run = {}
        out.append(canonical(name) + b":" + value.text)
    if run:
        out.append(canonical(run)[1:-1])
    return b",".join(out)
