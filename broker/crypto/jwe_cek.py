"""Release wrap ``jwe-cek``: a standard compact JWE whose content-encryption key *is* the DEK.

Made for DEKs an HSM keeps (``pkcs11:…&x-hsm-rewrap=true``, docs/keys.md): the token can wrap
a key it holds to an RSA public key (``C_WrapKey``, ``CKM_RSA_PKCS_OAEP``) and encrypt with it
(``C_Encrypt``, ``CKM_AES_GCM``), but it cannot make the usual JWE, whose *plaintext* is the DEK
(that needs ``C_WrapKey`` with AES-GCM, which SoftHSM2 refuses: ``CKR_MECHANISM_INVALID``).

So the JWE's parts are:

* ``encrypted_key`` = RSA-OAEP(runner key, DEK) — ``alg`` ``RSA-OAEP-256`` (made in software, or
  by a token that accepts SHA-256 OAEP parameters) or ``RSA-OAEP`` (SHA-1/MGF1-SHA1, RFC 7518
  §4.3: what SoftHSM2 2.6 makes; OAEP's security does not rest on the hash's collision resistance);
* ``enc`` ``A256GCM`` under the DEK, 96-bit IV, AAD = the ASCII base64url protected header;
* plaintext = the release statement, canonical JSON of ``{"decision_id", "key", "version",
  "wrap": "broker-release/v1+cek"[, "policy_digest"]}``; the protected header carries
  ``cty = "broker-release+cek"``, ``kid = "<key>#<version>"``, ``decision_id`` (and
  ``policy_digest``).

The runner decrypts ``encrypted_key`` with its RSA key, and the content with the result: the
content authenticating under it, with a statement naming this release, is what shows that the
recovered key is the DEK of this key version and this decision. The DEK keys only this one
AES-GCM message per release (a random IV each); weights are encrypted under HKDF-derived file
keys (crypto/weights.py), never under the DEK itself, so the two uses do not share a key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from broker.core.encoding import b64url_encode, canonical
from broker.crypto.jwe import ENC, IV_BYTES, TAG_BYTES, JweError, split_compact

CEK_CTY = "broker-release+cek"
STATEMENT_WRAP = "broker-release/v1+cek"
RSA_OAEP = "RSA-OAEP"  # SHA-1, MGF1-SHA1 (RFC 7518 §4.3)
RSA_OAEP_256 = "RSA-OAEP-256"  # SHA-256, MGF1-SHA256
DEK_BYTES = 32
# seal(plaintext, aad) -> (iv, ciphertext || tag): AES-256-GCM under the DEK, wherever it is
Sealer = Callable[[bytes, bytes], tuple[bytes, bytes]]


@dataclass(frozen=True)
class CekRelease:
    """What a ``jwe-cek`` release binds: the key version and the decision (and policy)."""

    key: str
    version: int
    decision_id: str
    policy_digest: str | None = None

    def header(self) -> dict[str, Any]:
        members: dict[str, Any] = {
            "kid": f"{self.key}#{self.version}",
            "decision_id": self.decision_id,
            "cty": CEK_CTY,
        }
        if self.policy_digest is not None:
            members["policy_digest"] = self.policy_digest
        return members

    def statement(self) -> bytes:
        members: dict[str, Any] = {
            "decision_id": self.decision_id,
            "key": self.key,
            "version": self.version,
            "wrap": STATEMENT_WRAP,
        }
        if self.policy_digest is not None:
            members["policy_digest"] = self.policy_digest
        return canonical(members)


def oaep(alg: str) -> padding.OAEP:
    """The OAEP parameters of a JWE ``alg`` (``RSA-OAEP`` or ``RSA-OAEP-256``)."""
    digest: hashes.HashAlgorithm = hashes.SHA256() if alg == RSA_OAEP_256 else hashes.SHA1()  # noqa: S303 - RFC 7518 §4.3
    return padding.OAEP(mgf=padding.MGF1(digest), algorithm=digest, label=None)


def assemble(release: CekRelease, *, alg: str, encrypted_key: bytes, seal: Sealer) -> str:
    """The compact JWE of a release whose DEK was wrapped (``encrypted_key``) and is used to
    ``seal`` by whoever holds it (the HSM, or ``encrypt`` below)."""
    protected = {**release.header(), "alg": alg, "enc": ENC}
    encoded_header = b64url_encode(json.dumps(protected, separators=(",", ":")).encode())
    iv, sealed = seal(release.statement(), encoded_header.encode("ascii"))
    if len(iv) != IV_BYTES or len(sealed) < TAG_BYTES:
        raise ValueError("the sealer returned a malformed AES-GCM message")
    ciphertext, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
    parts = [encrypted_key, iv, ciphertext, tag]
    return ".".join([encoded_header, *(b64url_encode(part) for part in parts)])


def encrypt(dek: bytes, recipient: rsa.RSAPublicKey, release: CekRelease) -> str:
    """The same JWE made in software, for a DEK the broker holds (``RSA-OAEP-256``)."""
    if len(dek) != DEK_BYTES:
        raise ValueError("wrap jwe-cek carries AES-256 DEKs only")

    def seal(plaintext: bytes, aad: bytes) -> tuple[bytes, bytes]:
        iv = os.urandom(IV_BYTES)
        return iv, AESGCM(dek).encrypt(iv, plaintext, aad)

    encrypted_key = recipient.encrypt(dek, oaep(RSA_OAEP_256))
    return assemble(release, alg=RSA_OAEP_256, encrypted_key=encrypted_key, seal=seal)


def open_release(token: str, private_key: rsa.RSAPrivateKey, expected: CekRelease) -> bytes:
    """The runner's side: recover the DEK from a ``jwe-cek`` JWE made for ``expected``.

    1. five base64url parts; header ``enc`` A256GCM, ``alg`` RSA-OAEP or RSA-OAEP-256, ``cty``
       ``broker-release+cek``, no ``crit``;
    2. the header's ``kid``, ``decision_id`` and ``policy_digest`` are the expected release's;
    3. RSA-OAEP decrypts ``encrypted_key`` to 32 bytes (the DEK);
    4. the content authenticates under it with the protected header as AAD, and is the
       expected release statement.

    Raises:
        JweError: naming the step that failed.
    """
    header, parts = split_compact(token)
    alg = header.get("alg")
    if header.get("enc") != ENC or alg not in (RSA_OAEP, RSA_OAEP_256) or "crit" in header:
        raise JweError("unsupported jwe-cek header")
    if header.get("cty") != CEK_CTY:
        raise JweError("this JWE is not a jwe-cek release (cty)")
    wanted = expected.header()
    for member in ("kid", "decision_id", "policy_digest"):
        if header.get(member) != wanted.get(member):
            raise JweError(f"wrapped key header names another {member}")
    encrypted_key, iv, ciphertext, tag = parts
    try:
        dek = private_key.decrypt(encrypted_key, oaep(str(alg)))
    except ValueError as exc:
        raise JweError("JWE key does not unwrap with this private key") from exc
    if len(dek) != DEK_BYTES or len(iv) != IV_BYTES:
        raise JweError("jwe-cek key or IV has the wrong length")
    try:
        aad = token.split(".", maxsplit=1)[0].encode("ascii")
        statement = AESGCM(dek).decrypt(iv, ciphertext + tag, aad)
    except (InvalidTag, ValueError) as exc:
        raise JweError("JWE content does not authenticate under the recovered key") from exc
    if statement != expected.statement():
        raise JweError("the release statement names another release")
    return dek
