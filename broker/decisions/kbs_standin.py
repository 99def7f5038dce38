"""TEMPORARY STAND-IN, deleted when the issue-33 wire work (worktree wt33j) is merged: the three
names the KBS facade uses from ``broker/crypto/kbs_jwe.py`` (``seal_for_guest``) and
``broker/kbs/wire.py`` (``expected_report_data``, ``error_body``), with their signatures, so the
facade runs end to end before they land. Minimal on purpose: EC P-256/P-384 and RSA keys only,
and the JWE made from ``crypto/jwe.py``'s own primitives. Do not build on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import aes_key_wrap

from broker.core.encoding import b64url_encode
from broker.crypto import jwe
from broker.crypto.jwk import parse_runner_key, public_jwk

ERROR_TYPE_PREFIX = "https://github.com/confidential-containers/kbs/errors/"
HASHES = {"sha256": hashlib.sha256, "sha384": hashlib.sha384, "sha512": hashlib.sha512}


def expected_report_data(
    tee_pubkey: Mapping[str, Any], nonce: str, additional_evidence: str, hash_alg: str
) -> bytes:
    """hash(JCS({"tee-pubkey", "nonce", "additional-evidence"})), padded to 64 bytes."""
    material = {
        "additional-evidence": additional_evidence,
        "nonce": nonce,
        "tee-pubkey": tee_pubkey,
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return HASHES[hash_alg](text.encode("utf-8")).digest().ljust(64, b"\0")


TRUSTEE_ERRORS = frozenset(
    {"AttestationError", "InvalidRequestPath", "JweError", "PluginNotFound", "PolicyDeny"}
    | {"PluginInternalError", "TokenNotFound", "TokenVerifierError"}
)


def error_body(name: str, detail: str) -> bytes:
    """Trustee's ``ErrorInformation``.

    Raises:
        ValueError: ``name`` is not an error Trustee answers.
    """
    if name not in TRUSTEE_ERRORS:
        raise ValueError(f"{name!r} is not an error Trustee answers")
    return json.dumps({"type": ERROR_TYPE_PREFIX + name, "detail": detail}).encode("utf-8")


def seal_for_guest(
    plaintext: bytes, tee_pubkey: Mapping[str, Any], *, context: Mapping[str, str | int]
) -> dict[str, str]:
    """A flattened JWE whose protected header is written as the guest re-serialises it."""
    recipient = parse_runner_key(dict(tee_pubkey))
    cek = AESGCM.generate_key(bit_length=256)
    header: dict[str, Any] = dict(context)
    if isinstance(recipient.key, rsa.RSAPublicKey):
        alg = jwe.RSA_ALG
        encrypted_key = recipient.key.encrypt(cek, jwe._oaep())
    else:
        alg = jwe.ECDH_ALG
        ephemeral, shared = jwe._ecdh_ephemeral(recipient.key)  # type: ignore[arg-type]
        header["epk"] = public_jwk(ephemeral)
        encrypted_key = aes_key_wrap(jwe._concat_kdf(shared, alg), cek)
    rest = json.dumps(header, sort_keys=True, separators=(",", ":"))[1:]
    text = json.dumps({"alg": alg, "enc": jwe.ENC}, separators=(",", ":"))[:-1]
    protected = b64url_encode((text + ("," + rest if rest != "}" else "}")).encode("ascii"))
    iv = os.urandom(jwe.IV_BYTES)
    sealed = AESGCM(cek).encrypt(iv, plaintext, protected.encode("ascii"))
    return {
        "protected": protected,
        "encrypted_key": b64url_encode(encrypted_key),
        "iv": b64url_encode(iv),
        "ciphertext": b64url_encode(sealed[: -jwe.TAG_BYTES]),
        "tag": b64url_encode(sealed[-jwe.TAG_BYTES :]),
    }
