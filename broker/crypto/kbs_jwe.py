"""The JWE answer a stock Confidential Containers guest decrypts (KBS protocol 0.4.0, issue 33).

The guest (guest-components ``attestation-agent/kbs_protocol/src/keypair.rs``,
``decrypt_response``) reads the answer, a flattened JWE JSON object, into ``kbs_types::Response``
(kbs-types 0.18), and authenticates the content with an AAD it *rebuilds*: the base64url of
``serde_json::to_string`` of the parsed ``ProtectedHeader`` (``generate_aad``), not the bytes it
received. It ignores the JWE ``aad`` member and never reads ``enc`` (AES-256-GCM always). So the
header is sent exactly as that re-serialisation writes it, whichever way the guest was built:

* ``alg`` and ``enc`` first (the struct's fields), then every other member (the flattened
  ``Map``) sorted by name, nested objects (``epk``) sorted too, no whitespace. A guest built with
  serde_json's default maps (``BTreeMap``) sorts; one whose build unifies serde_json's
  ``preserve_order`` (its ``all-attesters`` and Azure vTPM attesters pull
  azure-guest-attestation-sdk, which enables it) keeps the received order. Sorted is the one
  order both reproduce.
* Member values are ASCII strings and integers only: serde_json and Python's json write those
  identically; a float, a non-ASCII or control character could be re-written differently.

Key management, as ``unwrap_cek`` and ``deps/crypto/src/rust/{ec,rsa}.rs`` undo it (and as
Trustee's ``kbs/src/jwe/mod.rs`` makes it):

* EC P-256 or P-521 ``tee-pubkey`` with ``alg`` ``ECDH-ES+A256KW``: an ephemeral key on the
  same curve (``epk`` = ``{"crv","kty","x","y"}``, coordinates of exactly 32 or 66 bytes),
  Concat KDF over SHA-256 with AlgorithmID ``ECDH-ES+A256KW``, empty PartyUInfo and
  PartyVInfo, 256 bits (``crypto/jwe.py concat_kdf``), AES-256 key wrap of the CEK;
* RSA ``tee-pubkey`` with ``alg`` ``RSA-OAEP-256``: RSAES-OAEP, SHA-256 and MGF1-SHA-256;
* content: AES-256-GCM, 96-bit IV, 128-bit tag.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import aes_key_wrap

from broker.core.encoding import b64url_encode, canonical
from broker.core.errors import ErrorCode, InputError
from broker.crypto.jwe import CEK_BYTES, ECDH_ALG, ENC, IV_BYTES, RSA_ALG, TAG_BYTES, concat_kdf
from broker.crypto.jwe_cek import oaep
from broker.crypto.jwk import PRIVATE_MEMBERS, KeyMembersError, ec_public_key, rsa_public_key

# The curves the guest makes keys on (keypair.rs TeeKeyAlgorithm; deps/crypto ec::Curve).
TEE_CURVES: dict[str, tuple[ec.EllipticCurve, int]] = {
    "P-256": (ec.SECP256R1(), 32),
    "P-521": (ec.SECP521R1(), 66),
}
# The guest makes 2048-bit RSA keys (deps/crypto RSA_PUBKEY_LENGTH); larger ones are refused
# above 4096 bits so that one request cannot cost an 8192-bit encryption.
MIN_TEE_RSA_BITS = 2048
MAX_TEE_RSA_BITS = 4096
MAX_TEE_MEMBER_CHARS = 1024  # base64url of a 4096-bit modulus: 683
# Context members: a name, not one JOSE gives a meaning to (RFC 7515 §4.1, RFC 7516 §4.1,
# RFC 7518 §4.6.1, §4.7.1, §4.8.1); a value an ASCII string or a 64-bit integer.
MEMBER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
RESERVED_MEMBERS = frozenset(
    {"alg", "enc", "zip", "epk", "apu", "apv", "crit", "jku", "jwk", "x5u", "x5c", "x5t"}
    | {"x5t#S256", "iv", "tag", "p2s", "p2c"}
)
PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]{0,512}")
MAX_CONTEXT_MEMBERS = 16
INT64 = range(-(2**63), 2**63)


@dataclass(frozen=True)
class TeePublicKey:
    """A guest's validated ``tee-pubkey``.

    ``members`` are the ones ``kbs_types::TeePubKey`` keeps (EC: ``kty``, ``crv``, ``alg``,
    ``x``, ``y``; RSA: ``kty``, ``alg``, ``n``, ``e``): what the guest hashes into its report
    data and what Trustee's tokens carry; any other member the guest might send is dropped.
    """

    members: Mapping[str, str]
    key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey


def parse_tee_pubkey(unverified_jwk: Any) -> TeePublicKey:
    """Validate a guest's ``tee-pubkey`` (a public JWK with ``alg``).

    Raises:
        InputError: ``tee_pubkey_unsupported`` (a kty, crv or alg stock guests do not use,
            ``RSA1_5`` included), ``tee_pubkey_invalid`` (not an object, private members,
            members missing, too long, not base64url, a point off the curve, an RSA modulus
            outside 2048..4096 bits or a bad exponent).
    """
    if not isinstance(unverified_jwk, dict):
        raise _invalid("tee-pubkey must be a JWK object")
    if PRIVATE_MEMBERS.intersection(unverified_jwk):
        raise _invalid("tee-pubkey contains private key members")
    kty, alg = unverified_jwk.get("kty"), unverified_jwk.get("alg")
    try:
        if kty == "EC" and alg == ECDH_ALG:
            return _parse_ec(unverified_jwk)
        if kty == "RSA" and alg == RSA_ALG:
            return _parse_rsa(unverified_jwk)
    except KeyMembersError as exc:
        raise _invalid(f"tee-pubkey {exc}") from exc
    except ValueError as exc:
        raise _invalid("tee-pubkey members are not base64url") from exc
    raise InputError(
        f"tee-pubkey must be EC P-256/P-521 with alg {ECDH_ALG} or RSA with alg {RSA_ALG}",
        code=ErrorCode.TEE_PUBKEY_UNSUPPORTED,
    )


def _invalid(message: str) -> InputError:
    return InputError(message, code=ErrorCode.TEE_PUBKEY_INVALID)


def _member(jwk: Mapping[str, Any], name: str) -> str:
    value = jwk.get(name)
    if not isinstance(value, str) or not value:
        raise _invalid(f"tee-pubkey member {name!r} is missing")
    if len(value) > MAX_TEE_MEMBER_CHARS:
        raise _invalid(f"tee-pubkey member {name!r} is too long")
    return value


def _parse_ec(jwk: Mapping[str, Any]) -> TeePublicKey:
    crv = jwk.get("crv")
    if crv not in TEE_CURVES:
        raise InputError(
            "tee-pubkey EC curve must be P-256 or P-521", code=ErrorCode.TEE_PUBKEY_UNSUPPORTED
        )
    curve, size = TEE_CURVES[crv]
    x, y = _member(jwk, "x"), _member(jwk, "y")
    members = {"alg": ECDH_ALG, "crv": crv, "kty": "EC", "x": x, "y": y}
    return TeePublicKey(members, ec_public_key(curve, size, x, y))


def _parse_rsa(jwk: Mapping[str, Any]) -> TeePublicKey:
    n, e = _member(jwk, "n"), _member(jwk, "e")
    key = rsa_public_key(n, e, MIN_TEE_RSA_BITS, MAX_TEE_RSA_BITS)
    return TeePublicKey({"alg": RSA_ALG, "e": e, "kty": "RSA", "n": n}, key)


def check_context(context: Mapping[str, Any]) -> dict[str, str | int]:
    """The context members as the header will carry them, or a refusal.

    Raises:
        InputError: ``kbs_header_member_invalid``: more than 16 members, a name that is not
            ``[A-Za-z][A-Za-z0-9_.-]{0,63}`` or is a JOSE header parameter, a value that is not
            printable ASCII (at most 512 characters) or an integer in the signed 64-bit range.
    """
    if len(context) > MAX_CONTEXT_MEMBERS:
        raise _bad_member(f"at most {MAX_CONTEXT_MEMBERS} context members")
    checked: dict[str, str | int] = {}
    for name, value in context.items():
        if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name):
            raise _bad_member(f"header member name {name!r} is not allowed")
        if name in RESERVED_MEMBERS:
            raise _bad_member(f"header member {name!r} is a JOSE parameter")
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise _bad_member(f"header member {name!r} must be an ASCII string or an integer")
        if isinstance(value, int) and value not in INT64:
            raise _bad_member(f"header member {name!r} is outside the 64-bit range")
        if isinstance(value, str) and not PRINTABLE_ASCII.fullmatch(value):
            raise _bad_member(f"header member {name!r} must be printable ASCII")
        checked[name] = value
    return checked


def _bad_member(message: str) -> InputError:
    return InputError(message, code=ErrorCode.KBS_HEADER_MEMBER_INVALID)


def protected_header(alg: str, members: Mapping[str, Any]) -> bytes:
    """The protected header as the guest re-serialises it: ``alg``, ``enc``, then ``members``
    sorted by name (nested objects sorted), no whitespace."""
    head = b'{"alg":' + json.dumps(alg).encode() + b',"enc":' + json.dumps(ENC).encode()
    return head + (b"," + canonical(dict(members))[1:] if members else b"}")


def seal_for_guest(
    plaintext: bytes, tee_pubkey: Mapping[str, Any], *, context: Mapping[str, str | int]
) -> dict[str, str]:
    """``plaintext`` encrypted to a guest's ``tee-pubkey`` as the flattened JWE JSON object
    ``{"protected", "encrypted_key", "iv", "ciphertext", "tag"}`` the guest decrypts.

    Args:
        plaintext: the resource (a key) to release.
        tee_pubkey: the guest's ``tee-pubkey`` JWK (from its attestation or our token).
        context: protected header members bound with the content (release id, key version,
            policy digest…): ASCII strings and integers.

    Raises:
        InputError: ``tee_pubkey_unsupported``, ``tee_pubkey_invalid``,
            ``kbs_header_member_invalid`` (``parse_tee_pubkey``, ``check_context``).
    """
    key = parse_tee_pubkey(tee_pubkey)
    members = check_context(context)
    return seal_fixed(
        plaintext, key, members, cek=os.urandom(CEK_BYTES), iv=os.urandom(IV_BYTES), ephemeral=None
    )


def seal_fixed(
    plaintext: bytes,
    key: TeePublicKey,
    members: Mapping[str, str | int],
    *,
    cek: bytes,
    iv: bytes,
    ephemeral: ec.EllipticCurvePrivateKey | None,
) -> dict[str, str]:
    """``seal_for_guest`` with its random inputs given (a fresh ``ephemeral`` EC key when None):
    the test vectors pin its output. ``members`` must have passed ``check_context``."""
    if len(cek) != CEK_BYTES or len(iv) != IV_BYTES:
        raise ValueError("the CEK is 32 bytes and the IV 12")
    header: dict[str, Any] = dict(members)
    if isinstance(key.key, rsa.RSAPublicKey):
        alg, encrypted_key = RSA_ALG, key.key.encrypt(cek, oaep(RSA_ALG))
    else:
        curve, size = TEE_CURVES[key.members["crv"]]
        ephemeral = ephemeral or ec.generate_private_key(curve)
        if ephemeral.curve.name != curve.name:
            raise ValueError("the ephemeral key is on another curve than the tee-pubkey")
        shared = ephemeral.exchange(ec.ECDH(), key.key)
        alg, encrypted_key = ECDH_ALG, aes_key_wrap(concat_kdf(shared, ECDH_ALG), cek)
        header["epk"] = _epk(ephemeral.public_key(), key.members["crv"], size)
    protected = b64url_encode(protected_header(alg, header))
    sealed = AESGCM(cek).encrypt(iv, plaintext, protected.encode("ascii"))
    return {
        "protected": protected,
        "encrypted_key": b64url_encode(encrypted_key),
        "iv": b64url_encode(iv),
        "ciphertext": b64url_encode(sealed[:-TAG_BYTES]),
        "tag": b64url_encode(sealed[-TAG_BYTES:]),
    }


def _epk(public: ec.EllipticCurvePublicKey, crv: str, size: int) -> dict[str, str]:
    numbers = public.public_numbers()
    return {
        "crv": crv,
        "kty": "EC",
        "x": b64url_encode(numbers.x.to_bytes(size, "big")),
        "y": b64url_encode(numbers.y.to_bytes(size, "big")),
    }
