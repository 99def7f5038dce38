"""What a key version's secret and public half are: AES-256 DEKs, and HPKE key pairs for query
keys (RFC 9180: DHKEM(X25519), or the ML-KEM-768 + X25519 hybrid)."""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519

from broker.core.errors import ErrorCode, InputError, UpstreamError
from broker.core.protocol import Algorithm
from broker.keys.store.base import Purpose

DEK_BYTES = 32


def new_material(
    purpose: Purpose, material: bytes | None, algorithm: Algorithm | None
) -> tuple[Algorithm, bytes, bytes]:
    """(algorithm, secret to wrap, public key) for a new version.

    Query keys are HPKE key pairs (RFC 9180): DHKEM(X25519), or the ML-KEM-768 + X25519 hybrid
    (the default) whose secret is the ML-KEM seed (64 bytes) followed by the X25519 key.

    Raises:
        InputError: for an algorithm that does not fit the purpose.
    """
    if purpose is not Purpose.QUERY:
        return aes_algorithm(purpose, algorithm), material or os.urandom(DEK_BYTES), b""
    chosen = algorithm or Algorithm.HPKE_MLKEM768_X25519
    classic = x25519.X25519PrivateKey.generate()
    classic_public = classic.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    if chosen is Algorithm.HPKE_X25519:
        return chosen, classic.private_bytes_raw(), classic_public
    if chosen is not Algorithm.HPKE_MLKEM768_X25519:
        raise InputError("query keys are HPKE-X25519 or HPKE-MLKEM768-X25519")
    post_quantum = mlkem.MLKEM768PrivateKey.generate()
    secret = post_quantum.private_bytes_raw() + classic.private_bytes_raw()
    return chosen, secret, post_quantum.public_key().public_bytes_raw() + classic_public


def query_public_of(algorithm: Algorithm, secret: bytes) -> bytes:
    """The raw public half of a query key's stored secret (``new_material``'s layout).

    Raises:
        UpstreamError: ``key_record_invalid`` for a secret of the wrong length.
    """
    lengths = {Algorithm.HPKE_X25519: 32, Algorithm.HPKE_MLKEM768_X25519: 64 + 32}
    if lengths.get(algorithm) != len(secret):
        raise UpstreamError(
            "a query key's secret does not fit its algorithm", code=ErrorCode.KEY_RECORD_INVALID
        )
    classic = x25519.X25519PrivateKey.from_private_bytes(secret[-32:]).public_key()
    classic_public = classic.public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    if algorithm is Algorithm.HPKE_X25519:
        return classic_public
    post_quantum = mlkem.MLKEM768PrivateKey.from_seed_bytes(secret[:64])
    return post_quantum.public_key().public_bytes_raw() + classic_public


def aes_algorithm(purpose: Purpose, algorithm: Algorithm | None) -> Algorithm:
    """Model-weights and generic keys are AES-256.

    Raises:
        InputError: for another algorithm.
    """
    if algorithm not in (None, Algorithm.AES_256):
        raise InputError(f"{purpose.value} keys are AES-256")
    return Algorithm.AES_256


def check_imported(purpose: Purpose, material: bytes) -> None:
    """Key material an owner brings: a 32-byte AES-256 key, never a query key (the broker makes
    those: their public half is published).

    Raises:
        InputError: ``key_material_invalid`` unless 32 bytes; ``bad_request`` for a query key.
    """
    if len(material) != DEK_BYTES:
        raise InputError(
            "the key material must be 32 bytes (AES-256)", code=ErrorCode.KEY_MATERIAL_INVALID
        )
    if purpose is Purpose.QUERY:
        raise InputError("query keys are made by the broker; import model-weights or generic")
