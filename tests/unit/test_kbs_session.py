"""The KBS session cookie (``decisions/kbs_session.py``): random, MAC'd under a key derived from
the challenge key, carrying the guest's tee, its expiry and a digest of the nonce handed out
with it; records and stores name a session only by a hash of the cookie."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode
from broker.decisions.kbs_session import MAC_BYTES, TEE_NUMBERS, SessionCodec, session_hash
from broker.kbs.wire import TEE_NAMES

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


def test_the_tee_numbers_are_pinned() -> None:
    """A cookie names its tee by number: renumbering would make a cookie issued by an older
    version (or a replica not yet upgraded) open to another tee. Only additions are allowed."""
    assert TEE_NUMBERS == {
        "az-snp-vtpm": 0,
        "az-tdx-vtpm": 1,
        "cca": 2,
        "csv": 3,
        "hygondcu": 4,
        "nvidia": 5,
        "nvidia-dpu": 6,
        "sample": 7,
        "sampledevice": 8,
        "se": 9,
        "sgx": 10,
        "snp": 11,
        "tdx": 12,
        "tpm": 13,
    }
    assert set(TEE_NUMBERS) == TEE_NAMES  # every tee a guest may name has its number
    cookie, _ = CODEC.issue("tdx", "n", NOW)
    assert b64url_decode(cookie)[21] == 12
    for tee in TEE_NAMES:
        assert CODEC.open(CODEC.issue(tee, "n", NOW)[0], NOW).tee == tee


def test_a_cookie_naming_no_known_tee_number_rejected() -> None:
    body = bytearray(b64url_decode(CODEC.issue("tdx", "n", NOW)[0])[:-MAC_BYTES])
    body[21] = max(TEE_NUMBERS.values()) + 1
    forged = bytes(body) + CODEC._mac(bytes(body))  # a cookie MAC'd by the codec itself
    assert _code(b64url_encode(forged)) is ErrorCode.KBS_SESSION_INVALID
