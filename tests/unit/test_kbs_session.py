"""The KBS session cookie (``decisions/kbs_session.py``): random, MAC'd under a key derived from
the challenge key, carrying the guest's tee, its expiry and a digest of the nonce handed out
with it; records and stores name a session only by a hash of the cookie."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.decisions.kbs_session import SessionCodec, session_hash

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
CODEC = SessionCodec(b"k" * 32, timedelta(seconds=300))


def _code(cookie: str | None, codec: SessionCodec = CODEC, now: datetime = NOW) -> ErrorCode:
    with pytest.raises(AttestationError) as caught:
        codec.open(cookie, now)
    return caught.value.code


def test_a_cookie_opens_to_its_tee_and_expiry_and_is_named_by_its_hash() -> None:
    cookie, issued = CODEC.issue("tdx", "nonce-1", NOW)
    opened = CODEC.open(cookie, NOW + timedelta(seconds=299))
    assert (opened.tee, opened.expires_at) == ("tdx", NOW + timedelta(seconds=300))
    assert opened == issued
    assert opened.id_hash == session_hash(cookie) != cookie
    CODEC.check_nonce(opened, "nonce-1")
    assert CODEC.issue("tdx", "nonce-1", NOW)[0] != cookie  # random: never the same twice


def test_forged_cookie_rejected() -> None:
    cookie, _ = CODEC.issue("sample", "n", NOW)
    raw = bytearray(b64url_decode(cookie))
    for position in (1, 18, 21, 30, len(raw) - 1):  # random, expiry, tee, nonce digest, MAC
        changed = bytearray(raw)
        changed[position] ^= 0x01
        assert _code(b64url_encode(bytes(changed))) is ErrorCode.KBS_SESSION_INVALID


def test_cookie_of_another_broker_rejected() -> None:
    cookie, _ = SessionCodec(b"o" * 32, timedelta(seconds=300)).issue("tdx", "n", NOW)
    assert _code(cookie) is ErrorCode.KBS_SESSION_INVALID


@pytest.mark.parametrize("cookie", [None, "", "AAAA", "!" * 72, "A" * 10_000])
def test_absent_or_malformed_cookie_rejected(cookie: str | None) -> None:
    assert _code(cookie) is ErrorCode.KBS_SESSION_INVALID


def test_expired_session_rejected() -> None:
    cookie, _ = CODEC.issue("snp", "n", NOW)
    assert _code(cookie, now=NOW + timedelta(seconds=300)) is ErrorCode.KBS_SESSION_EXPIRED


def test_nonce_of_another_session_rejected() -> None:
    _, session = CODEC.issue("tdx", "mine", NOW)
    with pytest.raises(AttestationError) as caught:
        CODEC.check_nonce(session, "another session's")
    assert caught.value.code is ErrorCode.KBS_SESSION_INVALID
