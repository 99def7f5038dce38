"""Our HPKE contexts (``broker.crypto.hpke_context``) against two reference implementations on
generated inputs: ``cryptography``'s HPKE (single-shot, both KEMs, both directions) and pyhpke
(contexts, AAD, several messages and exported secrets, X25519)."""

from __future__ import annotations

import os
import random

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519
from pyhpke import AEADId, CipherSuite, KDFId, KEMId

from broker.crypto import hpke
from broker.crypto.hpke import HpkeError
from broker.crypto.hpke_context import setup_recipient, setup_sender


def key_pair(kem: str) -> tuple[bytes, bytes]:
    """(secret as the broker stores it, raw public key)."""
    x_secret = os.urandom(32)
    x_public = (
        x25519.X25519PrivateKey.from_private_bytes(x_secret)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    if kem == hpke.X25519:
        return x_secret, x_public
    seed = os.urandom(64)
    m_public = mlkem.MLKEM768PrivateKey.from_seed_bytes(seed).public_key().public_bytes_raw()
    return seed + x_secret, m_public + x_public


@pytest.mark.parametrize("kem", [hpke.X25519, hpke.HYBRID])
def test_both_directions_agree_with_cryptography(kem: str) -> None:
    rng = random.Random(kem)
    suite = hpke.SUITES[kem]
    for _ in range(40):
        secret, public = key_pair(kem)
        info, message = rng.randbytes(rng.randrange(64)), rng.randbytes(rng.randrange(300))
        ours = setup_sender(kem, public, info)
        sealed = ours.enc + ours.seal(b"", message)
        private = hpke.private_from_secret(kem, secret)
        assert suite.decrypt(sealed, private, info=info) == message
        theirs = suite.encrypt(message, hpke.public_from_raw(kem, public), info=info)
        size = len(ours.enc)
        opened = setup_recipient(kem, secret, theirs[:size], info).open(b"", theirs[size:])
        assert opened == message
        with pytest.raises(HpkeError):
            setup_recipient(kem, secret, theirs[:size], info + b"x").open(b"", theirs[size:])


def test_contexts_and_exports_agree_with_pyhpke() -> None:
    suite = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES256_GCM)
    rng = random.Random(9180)
    for _ in range(40):
        secret, public = key_pair(hpke.X25519)
        info = rng.randbytes(rng.randrange(40))
        ours = setup_sender(hpke.X25519, public, info)
        reference = suite.create_recipient_context(
            ours.enc, suite.kem.deserialize_private_key(secret), info=info
        )
        for _ in range(3):  # the sequence number advances alike
            aad, message = rng.randbytes(rng.randrange(20)), rng.randbytes(rng.randrange(100))
            assert reference.open(ours.seal(aad, message), aad=aad) == message
        label, length = rng.randbytes(rng.randrange(30)), rng.choice([12, 32, 64])
        assert ours.export(label, length) == reference.export(label, length)
        enc, sender = suite.create_sender_context(
            suite.kem.deserialize_public_key(public), info=info
        )
        mine = setup_recipient(hpke.X25519, secret, enc, info)
        assert mine.open(b"a", sender.seal(b"m", aad=b"a")) == b"m"
        assert mine.export(b"x", 32) == sender.export(b"x", 32)


def test_malformed_inputs_are_refused() -> None:
    secret, public = key_pair(hpke.HYBRID)
    with pytest.raises(HpkeError):
        setup_sender(hpke.HYBRID, public[:-1], b"")
    with pytest.raises(HpkeError):
        setup_recipient(hpke.HYBRID, secret, b"\0" * 100, b"")
    with pytest.raises(HpkeError):  # a small-order X25519 point
        setup_sender(hpke.X25519, bytes(32), b"")
