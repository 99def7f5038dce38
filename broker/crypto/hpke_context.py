"""HPKE (RFC 9180) base-mode contexts with the secret exporter, for query/answer encryption.

Why our own: ``cryptography``'s HPKE (used for single-shot seal/open in ``broker.crypto.hpke``)
offers no context and no ``Export``; RFC 9458 §4.4 response keys need ``Export``. pyhpke has an
exporter but not the ML-KEM-768+X25519 hybrid. This module builds the key schedule (§5.1) and
the two KEMs from ``cryptography`` primitives (X25519, ML-KEM-768, HKDF, SHA3-256, AES-GCM):

* DHKEM(X25519, HKDF-SHA256), KEM id 0x0020 (§4.1, §7.1);
* MLKEM768-X25519 (X-Wing, draft-connolly-cfrg-xwing-kem), KEM id 0x647a: the hybrid that
  ``cryptography`` calls ``KEM.MLKEM768_X25519``;

always with HKDF-SHA256 (0x0001) and AES-256-GCM (0x0002). Checked in
``tests/unit/test_hpke_context.py``: messages sealed here open with ``cryptography``'s HPKE and
the other way round, for both KEMs (the KEM and key schedule are therefore the reference's), and
exported secrets equal pyhpke's for X25519.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from broker.crypto import hpke
from broker.crypto.hpke import HpkeError

KEM_IDS = {hpke.X25519: 0x0020, hpke.HYBRID: 0x647A}
KDF_HKDF_SHA256 = 0x0001
AEAD_AES_256_GCM = 0x0002
NK, NN, NH = 32, 12, 32
ENC_BYTES = {hpke.X25519: 32, hpke.HYBRID: 1088 + 32}
XWING_LABEL = b"\\.//^\\"
MODE_BASE = 0


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    return hmac.new(salt or bytes(NH), ikm, hashlib.sha256).digest()


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def _labeled_extract(suite_id: bytes, salt: bytes, label: bytes, ikm: bytes) -> bytes:
    return hkdf_extract(salt, b"HPKE-v1" + suite_id + label + ikm)


def _labeled_expand(suite_id: bytes, prk: bytes, label: bytes, info: bytes, length: int) -> bytes:
    return hkdf_expand(
        prk, struct.pack(">H", length) + b"HPKE-v1" + suite_id + label + info, length
    )


def _raw(key: x25519.X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# --- KEMs ------------------------------------------------------------------------------------


def _dhkem_shared(dh: bytes, kem_context: bytes) -> bytes:
    suite = b"KEM" + struct.pack(">H", KEM_IDS[hpke.X25519])
    prk = _labeled_extract(suite, b"", b"eae_prk", dh)
    return _labeled_expand(suite, prk, b"shared_secret", kem_context, NH)


def _xwing_combine(ss_m: bytes, ss_x: bytes, ct_x: bytes, pk_x: bytes) -> bytes:
    return hashlib.sha3_256(ss_m + ss_x + ct_x + pk_x + XWING_LABEL).digest()


def _encap(kem: str, public_raw: bytes) -> tuple[bytes, bytes]:
    """(shared secret, enc) for the recipient's raw public key."""
    try:
        if kem == hpke.X25519 and len(public_raw) == hpke.X25519_BYTES:
            ephemeral = x25519.X25519PrivateKey.generate()
            enc = _raw(ephemeral.public_key())
            dh = ephemeral.exchange(x25519.X25519PublicKey.from_public_bytes(public_raw))
            return _dhkem_shared(dh, enc + public_raw), enc
        if kem == hpke.HYBRID and len(public_raw) == hpke.MLKEM768_PUBLIC_BYTES + 32:
            pk_m = mlkem.MLKEM768PublicKey.from_public_bytes(
                public_raw[: hpke.MLKEM768_PUBLIC_BYTES]
            )
            pk_x = public_raw[hpke.MLKEM768_PUBLIC_BYTES :]
            ephemeral = x25519.X25519PrivateKey.generate()
            ct_x = _raw(ephemeral.public_key())
            ss_x = ephemeral.exchange(x25519.X25519PublicKey.from_public_bytes(pk_x))
            ss_m, ct_m = pk_m.encapsulate()
            return _xwing_combine(ss_m, ss_x, ct_x, pk_x), ct_m + ct_x
    except ValueError as exc:  # a small-order X25519 key, a malformed ML-KEM key
        raise HpkeError("the public key is not usable") from exc
    raise HpkeError(f"a {kem} public key has another size")


def _decap(kem: str, secret: bytes, enc: bytes) -> bytes:
    try:
        if kem == hpke.X25519 and len(secret) == hpke.X25519_BYTES:
            sk = x25519.X25519PrivateKey.from_private_bytes(secret)
            pk_e = x25519.X25519PublicKey.from_public_bytes(enc)
            return _dhkem_shared(sk.exchange(pk_e), enc + _raw(sk.public_key()))
        if kem == hpke.HYBRID and len(secret) == hpke.MLKEM_SEED_BYTES + hpke.X25519_BYTES:
            sk_m = mlkem.MLKEM768PrivateKey.from_seed_bytes(secret[: hpke.MLKEM_SEED_BYTES])
            sk_x = x25519.X25519PrivateKey.from_private_bytes(secret[hpke.MLKEM_SEED_BYTES :])
            ct_m, ct_x = enc[:1088], enc[1088:]
            ss_m = sk_m.decapsulate(ct_m)
            ss_x = sk_x.exchange(x25519.X25519PublicKey.from_public_bytes(ct_x))
            return _xwing_combine(ss_m, ss_x, ct_x, _raw(sk_x.public_key()))
    except ValueError as exc:
        raise HpkeError("the encapsulated key does not decapsulate") from exc
    raise HpkeError(f"a {kem} private key has another size")


# --- contexts --------------------------------------------------------------------------------


@dataclass
class Context:
    """An HPKE context (§5.2, §5.3): seal/open with a sequence number, and Export."""

    key: bytes = field(repr=False)
    base_nonce: bytes = field(repr=False)
    exporter_secret: bytes = field(repr=False)
    suite_id: bytes
    enc: bytes
    sequence: int = 0

    def _nonce(self) -> bytes:
        counter = self.sequence.to_bytes(NN, "big")
        self.sequence += 1
        return bytes(a ^ b for a, b in zip(self.base_nonce, counter, strict=True))

    def seal(self, aad: bytes, plaintext: bytes) -> bytes:
        return AESGCM(self.key).encrypt(self._nonce(), plaintext, aad)

    def open(self, aad: bytes, ciphertext: bytes) -> bytes:
        try:
            return AESGCM(self.key).decrypt(self._nonce(), ciphertext, aad)
        except InvalidTag as exc:
            raise HpkeError("the message does not open in this context") from exc

    def export(self, exporter_context: bytes, length: int) -> bytes:
        return _labeled_expand(
            self.suite_id, self.exporter_secret, b"sec", exporter_context, length
        )


def _schedule(kem: str, shared_secret: bytes, info: bytes, enc: bytes) -> Context:
    suite_id = b"HPKE" + struct.pack(">HHH", KEM_IDS[kem], KDF_HKDF_SHA256, AEAD_AES_256_GCM)
    psk_id_hash = _labeled_extract(suite_id, b"", b"psk_id_hash", b"")
    info_hash = _labeled_extract(suite_id, b"", b"info_hash", info)
    context = bytes([MODE_BASE]) + psk_id_hash + info_hash
    secret = _labeled_extract(suite_id, shared_secret, b"secret", b"")
    return Context(
        key=_labeled_expand(suite_id, secret, b"key", context, NK),
        base_nonce=_labeled_expand(suite_id, secret, b"base_nonce", context, NN),
        exporter_secret=_labeled_expand(suite_id, secret, b"exp", context, NH),
        suite_id=suite_id,
        enc=enc,
    )


def setup_sender(kem: str, public_raw: bytes, info: bytes) -> Context:
    """SetupBaseS: a fresh encapsulation to a raw public key (``hpke.public_from_raw``'s
    encoding); ``context.enc`` goes to the recipient.

    Raises:
        HpkeError: for a key of the wrong size or an unusable one.
    """
    shared, enc = _encap(kem, public_raw)
    return _schedule(kem, shared, info, enc)


def setup_recipient(kem: str, secret: bytes, enc: bytes, info: bytes) -> Context:
    """SetupBaseR with the private key as the broker stores and releases it
    (``hpke.private_from_secret``'s encoding).

    Raises:
        HpkeError: for an ``enc`` of the wrong size or one that does not decapsulate.
    """
    if kem not in ENC_BYTES or len(enc) != ENC_BYTES[kem]:
        raise HpkeError("the encapsulated key has the wrong size")
    return _schedule(kem, _decap(kem, secret, enc), info, enc)
