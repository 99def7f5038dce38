"""Encodings every layer shares: strict unpadded base64url and canonical JSON."""

from __future__ import annotations

import base64
import binascii
import json
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
    return json.dumps(
        record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8", "backslashreplace")
