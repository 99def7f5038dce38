from __future__ import annotations

from datetime import timedelta

import pytest

from broker.attestation.jose import b64url_decode
from broker.errors import AttestationError, ErrorCode, UpstreamError
from broker.nonces import MemoryNonceStore
from tests.vectors.tokens import NOW


def store(capacity: int = 10) -> MemoryNonceStore:
    return MemoryNonceStore(ttl=timedelta(seconds=120), capacity=capacity)


async def test_nonce_is_32_random_bytes_with_expiry() -> None:
    nonces = store()
    first, second = await nonces.issue(NOW), await nonces.issue(NOW)
    assert len(b64url_decode(first.nonce)) == 32
    assert first.nonce != second.nonce
    assert first.expires_at == NOW + timedelta(seconds=120)


async def test_nonce_replay_rejected() -> None:
    nonces = store()
    issued = await nonces.issue(NOW)
    await nonces.consume(issued.nonce, NOW)
    with pytest.raises(AttestationError) as caught:
        await nonces.consume(issued.nonce, NOW + timedelta(seconds=1))
    assert caught.value.code is ErrorCode.NONCE_REUSED


async def test_unknown_nonce_rejected() -> None:
    with pytest.raises(AttestationError) as caught:
        await store().consume("never-issued", NOW)
    assert caught.value.code is ErrorCode.NONCE_UNKNOWN


async def test_expired_nonce_rejected() -> None:
    nonces = store()
    issued = await nonces.issue(NOW)
    with pytest.raises(AttestationError) as caught:
        await nonces.consume(issued.nonce, NOW + timedelta(seconds=120))
    assert caught.value.code is ErrorCode.NONCE_UNKNOWN


async def test_store_is_bounded_and_frees_expired_entries() -> None:
    nonces = store(capacity=2)
    await nonces.issue(NOW)
    await nonces.issue(NOW)
    with pytest.raises(UpstreamError) as caught:
        await nonces.issue(NOW)
    assert caught.value.code is ErrorCode.NONCE_STORE_FULL
    await nonces.issue(NOW + timedelta(seconds=121))
    assert len(nonces) == 1
