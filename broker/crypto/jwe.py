"""Compact JWE (RFC 7516) for wrapping a released key to a runner's ephemeral key.

Two key-management algorithms, one content encryption:

* ``ECDH-ES+A256KW`` (RFC 7518 §4.6) for EC P-256/P-384 and OKP X25519 (RFC 8037) runner keys:
  ephemeral-static ECDH, Concat KDF (NIST SP 800-56A) with SHA-256, AES-256 key wrap of the CEK.
* ``RSA-OAEP-256`` (RFC 7518 §4.3) for RSA runner keys.
* ``A256GCM`` for the content; the AAD is the ASCII base64url of the protected header, so every
  header member (``kid``, the decision id) is authenticated with the key.

Both sides live here: the broker encrypts, the runner SDK decrypts. The tests cross-check both
directions against jwcrypto, an independent implementation.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hpke
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

from broker.core.encoding import b64url_decode, b64url_encode
from broker.crypto.jwk import EC_CURVES, RunnerKey, RunnerPublicKeyObject, public_jwk

ECDH_ALG = "ECDH-ES+A256KW"
RSA_ALG = "RSA-OAEP-256"
ENC = "A256GCM"
CEK_BYTES = 32
IV_BYTES = 12
TAG_BYTES = 16
RunnerPrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | x25519.X25519PrivateKey


class JweError(ValueError):
    """A JWE could not be decrypted (wrong key, tampering, or a malformed message)."""


@dataclass(frozen=True)
class DecryptedJwe:
    protected_header: Mapping[str, Any]
    plaintext: bytes


def algorithm_for(key: RunnerPublicKeyObject) -> str:
    """The JWE ``alg`` the broker uses for a runner key type."""
    return RSA_ALG if isinstance(key, rsa.RSAPublicKey) else ECDH_ALG


def encrypt(plaintext: bytes, recipient: RunnerKey, header: Mapping[str, Any]) -> str:
    """Encrypt ``plaintext`` to ``recipient`` as a compact JWE.

    Args:
        plaintext: the bytes to protect (a raw DEK).
        recipient: the runner's validated public key.
        header: extra protected header members (bound as AAD); must not set alg/enc/epk.
    """
    alg = algorithm_for(recipient.key)
    protected: dict[str, Any] = {**header, "alg": alg, "enc": ENC}
    cek = AESGCM.generate_key(bit_length=256)
    if isinstance(recipient.key, rsa.RSAPublicKey):
        encrypted_key = recipient.key.encrypt(cek, _oaep())
    elif isinstance(recipient.key, hpke.MLKEM768X25519PublicKey):
        raise TypeError("hybrid ML-KEM keys are wrapped with HPKE, not JWE")
    else:
        ephemeral, shared = _ecdh_ephemeral(recipient.key)
        protected["epk"] = public_jwk(ephemeral)
        encrypted_key = aes_key_wrap(concat_kdf(shared, alg), cek)
    encoded_header = b64url_encode(json.dumps(protected, separators=(",", ":")).encode())
    iv = os.urandom(IV_BYTES)
    sealed = AESGCM(cek).encrypt(iv, plaintext, encoded_header.encode("ascii"))
    ciphertext, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
    parts = [encrypted_key, iv, ciphertext, tag]
    return ".".join([encoded_header, *(b64url_encode(part) for part in parts)])


def decrypt(token: str, private_key: RunnerPrivateKey) -> DecryptedJwe:
    """Decrypt a compact JWE made by ``encrypt`` (or any RFC 7516 peer using our algorithms).

    Raises:
        JweError: when the message is malformed, uses another algorithm, or fails to decrypt.
    """
    header, (encrypted_key, iv, ciphertext, tag) = split_compact(token)
    if header.get("enc") != ENC or "crit" in header:
        raise JweError("unsupported JWE header")
    cek = _recover_cek(header, encrypted_key, private_key)
    protected = token.split(".", 1)[0].encode("ascii")
    try:
        plaintext = AESGCM(cek).decrypt(iv, ciphertext + tag, protected)
    except (InvalidTag, ValueError) as exc:
        raise JweError("JWE content does not authenticate") from exc
    return DecryptedJwe(protected_header=header, plaintext=plaintext)


def split_compact(token: str) -> tuple[Mapping[str, Any], tuple[bytes, bytes, bytes, bytes]]:
    """A compact JWE's protected header (a JSON object) and its four other parts, decoded.

    Raises:
        JweError: not five parts, not base64url, or a header that is not a JSON object.
    """
    parts = token.split(".")
    if len(parts) != 5:
        raise JweError("not a compact JWE (five parts)")
    try:
        header = json.loads(b64url_decode(parts[0]))
        encrypted_key, iv, ciphertext, tag = (b64url_decode(p) for p in parts[1:])
    except (ValueError, UnicodeDecodeError) as exc:
        raise JweError("JWE parts are not base64url") from exc
    if not isinstance(header, dict):
        raise JweError("JWE header is not an object")
    return header, (encrypted_key, iv, ciphertext, tag)


def _recover_cek(header: Mapping[str, Any], encrypted_key: bytes, key: RunnerPrivateKey) -> bytes:
    alg = header.get("alg")
    try:
        if alg == RSA_ALG and isinstance(key, rsa.RSAPrivateKey):
            return key.decrypt(encrypted_key, _oaep())
        if alg == ECDH_ALG and not isinstance(key, rsa.RSAPrivateKey):
            shared = _ecdh_static(key, header.get("epk"))
            return aes_key_unwrap(concat_kdf(shared, ECDH_ALG), encrypted_key)
    except (ValueError, InvalidUnwrap) as exc:
        raise JweError("JWE key does not unwrap with this private key") from exc
    raise JweError(f"JWE alg {alg!r} does not fit this private key")


def _oaep() -> padding.OAEP:
    return padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)


def concat_kdf(shared: bytes, alg: str) -> bytes:
    """RFC 7518 §4.6.2: Concat KDF (SHA-256), AlgorithmID = alg, empty apu/apv, keydatalen 256
    (also the KBS facade's, crypto/kbs_jwe.py)."""

    def field(value: bytes) -> bytes:
        return struct.pack(">I", len(value)) + value

    other_info = field(alg.encode()) + field(b"") + field(b"") + struct.pack(">I", 256)
    return ConcatKDFHash(hashes.SHA256(), CEK_BYTES, other_info).derive(shared)


def _ecdh_ephemeral(
    recipient: ec.EllipticCurvePublicKey | x25519.X25519PublicKey,
) -> tuple[RunnerPublicKeyObject, bytes]:
    if isinstance(recipient, x25519.X25519PublicKey):
        x_ephemeral = x25519.X25519PrivateKey.generate()
        return x_ephemeral.public_key(), x_ephemeral.exchange(recipient)
    ec_ephemeral = ec.generate_private_key(recipient.curve)
    return ec_ephemeral.public_key(), ec_ephemeral.exchange(ec.ECDH(), recipient)


def _ecdh_static(key: ec.EllipticCurvePrivateKey | x25519.X25519PrivateKey, epk: Any) -> bytes:
    if not isinstance(epk, dict):
        raise ValueError("JWE header lacks epk")  # noqa: TRY004 - becomes JweError
    if isinstance(key, x25519.X25519PrivateKey):
        if epk.get("kty") != "OKP" or epk.get("crv") != "X25519":
            raise ValueError("epk does not match an X25519 key")
        peer = x25519.X25519PublicKey.from_public_bytes(b64url_decode(str(epk.get("x"))))
        return key.exchange(peer)
    crv = epk.get("crv")
    if epk.get("kty") != "EC" or crv not in EC_CURVES:
        raise ValueError("epk is not a supported EC key")
    curve, _ = EC_CURVES[crv]
    if curve.name != key.curve.name:
        raise ValueError("epk curve differs from the private key's curve")
    point = b"\x04" + b64url_decode(str(epk.get("x"))) + b64url_decode(str(epk.get("y")))
    peer_ec = ec.EllipticCurvePublicKey.from_encoded_point(curve, point)
    return key.exchange(ec.ECDH(), peer_ec)
