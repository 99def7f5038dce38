"""HPKE (RFC 9180) for releases and query encryption, through ``cryptography``'s HPKE.

Two suites, base mode, single shot (``enc || ciphertext``):

* ``X25519``: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-256-GCM.
* ``MLKEM768-X25519``: the ML-KEM-768 + X25519 hybrid KEM, HKDF-SHA256, AES-256-GCM
  (post-quantum confidentiality for keys that must stay secret for years).

HPKE key JWKs: X25519 keys are ordinary OKP JWKs; hybrid keys are
``{"kty": "HPKE", "kem": "MLKEM768-X25519", "pk": base64url(ML-KEM public (1184) || X25519 (32))}``.
The ``info`` string binds the context (key name, version, decision id) the way a JWE protected
header does: a ciphertext made for one release does not open as another.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519

X25519 = "X25519"
HYBRID = "MLKEM768-X25519"
MLKEM768_PUBLIC_BYTES = 1184
MLKEM_SEED_BYTES = 64
X25519_BYTES = 32
SUITES = {
    X25519: hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM),
    HYBRID: hpke.Suite(hpke.KEM.MLKEM768_X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.AES_256_GCM),
}
SUITE_NAMES = {
    X25519: "DHKEM(X25519,HKDF-SHA256)/HKDF-SHA256/AES-256-GCM",
    HYBRID: "MLKEM768-X25519/HKDF-SHA256/AES-256-GCM",
}
HpkePublicKey = x25519.X25519PublicKey | hpke.MLKEM768X25519PublicKey
HpkePrivateKey = x25519.X25519PrivateKey | hpke.MLKEM768X25519PrivateKey


class HpkeError(ValueError):
    """An HPKE message did not open, or a key is malformed."""


def kem_of(key: HpkePublicKey | HpkePrivateKey) -> str:
    if isinstance(key, x25519.X25519PublicKey | x25519.X25519PrivateKey):
        return X25519
    return HYBRID


def context_info(fields: Mapping[str, Any]) -> bytes:
    """Canonical JSON of the binding context, the HPKE ``info``."""
    return json.dumps(dict(fields), sort_keys=True, separators=(",", ":")).encode()


def seal(plaintext: bytes, public_key: HpkePublicKey, info: bytes) -> bytes:
    return SUITES[kem_of(public_key)].encrypt(plaintext, public_key, info=info)


def open_(ciphertext: bytes, private_key: HpkePrivateKey, info: bytes) -> bytes:
    """Decrypt ``enc || ciphertext``.

    Raises:
        HpkeError: when it does not authenticate (wrong key, wrong info, tampering).
    """
    try:
        return SUITES[kem_of(private_key)].decrypt(ciphertext, private_key, info=info)
    except (InvalidTag, ValueError) as exc:
        raise HpkeError("HPKE message does not open with this key and context") from exc


def public_from_raw(kem: str, raw: bytes) -> HpkePublicKey:
    """A public key from its raw encoding (X25519: 32 bytes; hybrid: 1184 + 32 bytes).

    Raises:
        HpkeError: for a wrong length or a key that does not parse.
    """
    try:
        if kem == X25519 and len(raw) == X25519_BYTES:
            return x25519.X25519PublicKey.from_public_bytes(raw)
        if kem == HYBRID and len(raw) == MLKEM768_PUBLIC_BYTES + X25519_BYTES:
            return hpke.MLKEM768X25519PublicKey(
                mlkem.MLKEM768PublicKey.from_public_bytes(raw[:MLKEM768_PUBLIC_BYTES]),
                x25519.X25519PublicKey.from_public_bytes(raw[MLKEM768_PUBLIC_BYTES:]),
            )
    except ValueError as exc:
        raise HpkeError("HPKE public key does not parse") from exc
    raise HpkeError(f"HPKE public key has the wrong length for {kem}")


def private_from_secret(kem: str, secret: bytes) -> HpkePrivateKey:
    """A private key from what the broker stores and releases for query keys.

    Raises:
        HpkeError: for a wrong length.
    """
    if kem == X25519 and len(secret) == X25519_BYTES:
        return x25519.X25519PrivateKey.from_private_bytes(secret)
    if kem == HYBRID and len(secret) == MLKEM_SEED_BYTES + X25519_BYTES:
        return hpke.MLKEM768X25519PrivateKey(
            mlkem.MLKEM768PrivateKey.from_seed_bytes(secret[:MLKEM_SEED_BYTES]),
            x25519.X25519PrivateKey.from_private_bytes(secret[MLKEM_SEED_BYTES:]),
        )
    raise HpkeError(f"HPKE private key has the wrong length for {kem}")


def new_hybrid_key() -> tuple[hpke.MLKEM768X25519PrivateKey, bytes]:
    """A fresh hybrid key pair and its raw public encoding (for runners)."""
    post_quantum, classic = mlkem.MLKEM768PrivateKey.generate(), x25519.X25519PrivateKey.generate()
    raw = post_quantum.public_key().public_bytes_raw() + classic.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return hpke.MLKEM768X25519PrivateKey(post_quantum, classic), raw
