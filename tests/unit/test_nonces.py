"""Stateless challenges: MAC'd, expiring, spent once; handing one out stores nothing."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError, ErrorCode, UpstreamError
from broker.stores.nonces import ChallengeCodec, MemorySpentNonces, StatelessNonceStore
from tests.vectors.tokens import NOW

TTL = timedelta(seconds=120)


async def store(
    tmp_path: Path, capacity: int = 10
) -> tuple[StatelessNonceStore, MemorySpentNonces]:
    spent = MemorySpentNonces(capacity=capacity)
    nonces = StatelessNonceStore(spent, key_path=tmp_path / "challenge.key", ttl=TTL)
    await nonces.open()
    return nonces, spent


async def test_nonce_is_32_bytes_with_expiry_and_fits_confidential_space(tmp_path: Path) -> None:
    nonces, spent = await store(tmp_path)
    first, second = await nonces.issue(NOW), await nonces.issue(NOW)
    assert len(b64url_decode(first.nonce)) == 32
    assert len(first.nonce) <= 74  # Confidential Space's oldest documented nonce limit
    assert first.nonce != second.nonce
    assert first.expires_at - NOW <= TTL + timedelta(seconds=1)
    assert len(spent) == 0  # handing challenges out stores nothing


async def test_challenge_flood_stores_nothing(tmp_path: Path) -> None:
    nonces, spent = await store(tmp_path, capacity=2)
    for _ in range(10_000):
        await nonces.issue(NOW)
    assert len(spent) == 0
    await nonces.consume((await nonces.issue(NOW)).nonce, NOW)  # nobody is locked out


async def test_nonce_replay_rejected(tmp_path: Path) -> None:
    nonces, _ = await store(tmp_path)
    issued = await nonces.issue(NOW)
    await nonces.consume(issued.nonce, NOW)
    with pytest.raises(AttestationError) as caught:
        await nonces.consume(issued.nonce, NOW + timedelta(seconds=1))
    assert caught.value.code is ErrorCode.NONCE_REUSED


@pytest.mark.parametrize("forged", ["never-issued", "A" * 43, "A" * 10_000, "", "!!!"])
async def test_unknown_nonce_rejected(tmp_path: Path, forged: str) -> None:
    nonces, _ = await store(tmp_path)
    with pytest.raises(AttestationError) as caught:
        await nonces.consume(forged, NOW)
    assert caught.value.code is ErrorCode.NONCE_UNKNOWN


async def test_forged_challenge_with_a_later_expiry_rejected(tmp_path: Path) -> None:
    """Changing any byte (the expiry, the random part, the key id) breaks the MAC."""
    nonces, _ = await store(tmp_path)
    raw = bytearray(b64url_decode((await nonces.issue(NOW)).nonce))
    for position in (0, 5, 17, 31):
        changed = bytearray(raw)
        changed[position] ^= 0x01
        with pytest.raises(AttestationError) as caught:
            await nonces.consume(b64url_encode(bytes(changed)), NOW)
        assert caught.value.code is ErrorCode.NONCE_UNKNOWN


async def test_challenge_from_another_key_rejected(tmp_path: Path) -> None:
    ours, _ = await store(tmp_path / "a")
    theirs, _ = await store(tmp_path / "b")
    with pytest.raises(AttestationError) as caught:
        await ours.consume((await theirs.issue(NOW)).nonce, NOW)
    assert caught.value.code is ErrorCode.NONCE_UNKNOWN


async def test_expired_nonce_rejected(tmp_path: Path) -> None:
    nonces, _ = await store(tmp_path)
    issued = await nonces.issue(NOW)
    with pytest.raises(AttestationError) as caught:
        await nonces.consume(issued.nonce, issued.expires_at)
    assert caught.value.code is ErrorCode.NONCE_UNKNOWN


async def test_spent_store_is_bounded_and_frees_expired_entries(tmp_path: Path) -> None:
    nonces, spent = await store(tmp_path, capacity=2)
    await nonces.consume((await nonces.issue(NOW)).nonce, NOW)
    await nonces.consume((await nonces.issue(NOW)).nonce, NOW)
    with pytest.raises(UpstreamError) as caught:
        await nonces.consume((await nonces.issue(NOW)).nonce, NOW)
    assert caught.value.code is ErrorCode.NONCE_STORE_FULL
    later = NOW + TTL + timedelta(seconds=2)
    await nonces.consume((await nonces.issue(later)).nonce, later)
    assert len(spent) == 1


def test_another_process_with_the_same_key_accepts_the_challenge() -> None:
    """Workers and replicas share the key: any of them verifies what another handed out."""
    key = bytes(range(32))
    nonce = ChallengeCodec(key, TTL).issue(NOW).nonce
    assert ChallengeCodec(key, TTL).verify(nonce, NOW) > NOW
    with pytest.raises(AttestationError):
        ChallengeCodec(bytes(32), TTL).verify(nonce, NOW)


async def test_verifying_a_challenge_spends_nothing(tmp_path: Path) -> None:
    """Issue 27: checking the MAC touches no store; only ``spend_challenge`` (called once the
    evidence carrying it verified) does, and only once."""
    nonces, spent = await store(tmp_path, capacity=1)
    issued = await nonces.issue(NOW)
    for _ in range(100):  # junk releases carrying this fresh challenge
        challenge = nonces.verify_challenge(issued.nonce, NOW)
    assert len(spent) == 0
    await nonces.spend_challenge(challenge, NOW)
    with pytest.raises(AttestationError) as caught:
        await nonces.spend_challenge(nonces.verify_challenge(issued.nonce, NOW), NOW)
    assert caught.value.code is ErrorCode.NONCE_REUSED


async def test_a_dpop_jti_flood_cannot_fill_the_challenge_space(tmp_path: Path) -> None:
    jtis = MemorySpentNonces(capacity=2)
    spent = MemorySpentNonces(capacity=2)
    nonces = StatelessNonceStore(spent, key_path=tmp_path / "k", ttl=TTL, jtis=jtis)
    await nonces.open()
    for jti in ("dpop:t:1", "dpop:t:2"):
        await nonces.spend_jti(jti, NOW + timedelta(seconds=65), NOW)
    with pytest.raises(UpstreamError) as caught:
        await nonces.spend_jti("dpop:t:3", NOW + timedelta(seconds=65), NOW)
    assert caught.value.code is ErrorCode.NONCE_STORE_FULL
    await nonces.consume((await nonces.issue(NOW)).nonce, NOW)  # challenges unaffected
    await nonces.consume((await nonces.issue(NOW)).nonce, NOW)
    with pytest.raises(UpstreamError):  # and the challenges' bound holds for them alone
        await nonces.consume((await nonces.issue(NOW)).nonce, NOW)
    assert (len(spent), len(jtis)) == (2, 2)


async def test_a_jti_that_equals_a_nonce_is_another_value(tmp_path: Path) -> None:
    """One namespace each: a proof's jti chosen equal to a challenge spends nothing of it."""
    nonces, _ = await store(tmp_path)
    issued = await nonces.issue(NOW)
    await nonces.spend_jti(issued.nonce, issued.expires_at, NOW)
    await nonces.consume(issued.nonce, NOW)
    with pytest.raises(AttestationError) as caught:
        await nonces.spend_jti(issued.nonce, issued.expires_at, NOW)
    assert caught.value.code is ErrorCode.NONCE_REUSED
