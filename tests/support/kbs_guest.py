"""A stock Confidential Containers guest's side of a KBS answer, written in Python from its code
and sharing none of ``broker/crypto/kbs_jwe.py``: the oracle of the unit tests and the vectors'
generator. ``tests/kbs_conformance`` is the same steps on the guest's own Rust crates.

* ``serde_header``: kbs-types 0.18 ``ProtectedHeader`` serialised by serde_json: the fields
  ``alg``, ``enc``, then the flattened ``other_fields`` map (a ``BTreeMap``: sorted; with
  serde_json's ``preserve_order``: an ``IndexMap``, in the order received), nested maps alike.
* ``open_as_guest``: guest-components ``keypair.rs decrypt_response``: ``unwrap_cek`` (RSA-OAEP
  with SHA-256; ECDH with the header's ``epk``, then ``rust/ec.rs``'s Concat KDF and AES-KW),
  the AAD rebuilt from the parsed header, AES-256-GCM with the detached tag; ``enc`` unread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import aes_key_unwrap, aes_key_wrap

GuestPrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
CURVE_NAMES = {"secp256r1": ("P-256", 32), "secp521r1": ("P-521", 66)}


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as received: its members in order, duplicates kept."""


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64u(text: str) -> bytes:
    if "=" in text:
        raise ValueError("URL_SAFE_NO_PAD refuses padding")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _map(pairs: list[tuple[str, Any]], preserve_order: bool) -> list[tuple[str, Any]]:
    """A serde_json ``Map`` built from the members: the last value of a name wins; a
    ``BTreeMap`` iterates sorted, an ``IndexMap`` where the name first came."""
    members: dict[str, Any] = {}
    for name, value in pairs:
        members[name] = value
    return list(members.items()) if preserve_order else sorted(members.items())


def _write(value: Any, preserve_order: bool) -> str:
    if isinstance(value, _Pairs):
        body = ",".join(
            f"{json.dumps(k, ensure_ascii=False)}:{_write(v, preserve_order)}"
            for k, v in _map(value, preserve_order)
        )
        return "{" + body + "}"
    if isinstance(value, list):
        return "[" + ",".join(_write(item, preserve_order) for item in value) + "]"
    if isinstance(value, float):
        raise ValueError("serde_json rewrites floats its own way; not modelled")
    return json.dumps(value, ensure_ascii=False)


def serde_header(header_json: bytes, *, preserve_order: bool = False) -> bytes:
    """The header text the guest's ``generate_aad`` encodes, from the header bytes received."""
    pairs = json.loads(header_json, object_pairs_hook=_Pairs)
    if not isinstance(pairs, _Pairs):
        raise ValueError("the protected header is not an object")
    fields = dict(pairs)
    if not isinstance(fields.get("alg"), str) or not isinstance(fields.get("enc"), str):
        raise ValueError("ProtectedHeader needs string alg and enc")
    others = _Pairs((k, v) for k, v in pairs if k not in ("alg", "enc"))
    text = '{"alg":' + json.dumps(fields["alg"], ensure_ascii=False)
    text += ',"enc":' + json.dumps(fields["enc"], ensure_ascii=False)
    rest = _write(others, preserve_order)[1:]
    return (text + ("," + rest if others else "}")).encode("utf-8")


def concat_kdf_sha256(z: bytes, alg: str = "ECDH-ES+A256KW") -> bytes:
    """NIST SP 800-56A Concat KDF, one round of SHA-256: counter 1, Z, then OtherInfo =
    len(alg) || alg || len(PartyUInfo)=0 || len(PartyVInfo)=0 || keydatalen 256 (rust/ec.rs)."""
    other = struct.pack(">I", len(alg)) + alg.encode() + struct.pack(">III", 0, 0, 256)
    return hashlib.sha256(struct.pack(">I", 1) + z + other).digest()


def open_as_guest(
    answer: Mapping[str, str], key: GuestPrivateKey, *, preserve_order: bool = False
) -> bytes:
    """The plaintext of a facade answer as the guest recovers it.

    Raises:
        ValueError, InvalidTag, InvalidUnwrap: where the guest fails too.
    """
    header = json.loads(unb64u(answer["protected"]))
    alg = header["alg"]
    wrapped = unb64u(answer["encrypted_key"])
    if alg == "RSA-OAEP-256" and isinstance(key, rsa.RSAPrivateKey):
        oaep = padding.OAEP(padding.MGF1(hashes.SHA256()), hashes.SHA256(), None)
        cek = key.decrypt(wrapped, oaep)
    elif alg == "ECDH-ES+A256KW" and isinstance(key, ec.EllipticCurvePrivateKey):
        epk, (crv, size) = header["epk"], CURVE_NAMES[key.curve.name]
        if epk["crv"] != crv:
            raise ValueError(f"Unmatched curve: {epk['crv']}")
        x, y = unb64u(epk["x"]), unb64u(epk["y"])
        if len(x) != size or len(y) != size:
            raise ValueError("invalid bytes length of coordinates")
        peer = ec.EllipticCurvePublicKey.from_encoded_point(key.curve, b"\x04" + x + y)
        cek = aes_key_unwrap(concat_kdf_sha256(key.exchange(ec.ECDH(), peer)), wrapped)
    else:
        raise ValueError(f"Unsupported algorithm or unmatched key: {alg}")
    protected = unb64u(answer["protected"])
    aad = b64u(serde_header(protected, preserve_order=preserve_order)).encode("ascii")
    sealed = unb64u(answer["ciphertext"]) + unb64u(answer["tag"])
    return AESGCM(cek).decrypt(unb64u(answer["iv"]), sealed, aad)


def textbook_seal(plaintext: bytes, tee: Mapping[str, str], header: Mapping[str, Any]) -> Any:
    """A textbook RFC 7516 server's answer: the header written in ``header``'s order (``epk``,
    an ephemeral key for an EC ``tee``, where ``header`` places it) and its own bytes as AAD."""
    cek, iv = os.urandom(32), os.urandom(12)
    members = dict(header)
    if tee["kty"] == "RSA":
        public = rsa.RSAPublicNumbers(_int(tee["e"]), _int(tee["n"])).public_key()
        oaep = padding.OAEP(padding.MGF1(hashes.SHA256()), hashes.SHA256(), None)
        wrapped = public.encrypt(cek, oaep)
    else:
        curve = {"P-256": ec.SECP256R1(), "P-521": ec.SECP521R1()}[tee["crv"]]
        point = b"\x04" + unb64u(tee["x"]) + unb64u(tee["y"])
        peer = ec.EllipticCurvePublicKey.from_encoded_point(curve, point)
        ephemeral = ec.generate_private_key(curve)
        members["epk"] = epk(ephemeral)
        wrapped = aes_key_wrap(concat_kdf_sha256(ephemeral.exchange(ec.ECDH(), peer)), cek)
    protected = b64u(json.dumps(members, separators=(",", ":")).encode())
    sealed = AESGCM(cek).encrypt(iv, plaintext, protected.encode("ascii"))
    return {
        "protected": protected,
        "encrypted_key": b64u(wrapped),
        "iv": b64u(iv),
        "ciphertext": b64u(sealed[:-16]),
        "tag": b64u(sealed[-16:]),
    }


def _int(text: str) -> int:
    return int.from_bytes(unb64u(text), "big")


def tee_pubkey(key: GuestPrivateKey) -> dict[str, str]:
    """What the guest sends as ``tee-pubkey`` (keypair.rs ``export_pubkey``; TeePubKey's order)."""
    if isinstance(key, rsa.RSAPrivateKey):
        numbers = key.public_key().public_numbers()
        return {"kty": "RSA", "alg": "RSA-OAEP-256", "n": _uint(numbers.n), "e": _uint(numbers.e)}
    crv, size = CURVE_NAMES[key.curve.name]
    point = key.public_key().public_numbers()
    return {
        "kty": "EC",
        "crv": crv,
        "alg": "ECDH-ES+A256KW",
        "x": b64u(point.x.to_bytes(size, "big")),
        "y": b64u(point.y.to_bytes(size, "big")),
    }


def epk(key: ec.EllipticCurvePrivateKey) -> dict[str, str]:
    """An ephemeral key as Trustee's ``kbs/src/jwe/mod.rs`` writes ``epk``."""
    public = {k: v for k, v in tee_pubkey(key).items() if k != "alg"}
    return dict(sorted(public.items()))


# kbs_types::TeePubKey: the members a typed key keeps, by kty (anything else is dropped)
TYPED_MEMBERS = {"EC": ("kty", "crv", "alg", "x", "y"), "RSA": ("kty", "alg", "n", "e")}


def report_data(tee: Mapping[str, str], nonce: str, evidence: str, hash_alg: str) -> bytes:
    """rcar_client.rs ``get_composite_evidence`` and the attesters' padding: the typed key's
    members, JSON with sorted keys and no whitespace (RFC 8785 for this ASCII-keyed,
    number-free object), hashed with the selected algorithm, zero-padded to 64 bytes."""
    typed = {name: tee[name] for name in TYPED_MEMBERS[tee["kty"]]}
    runtime = {"tee-pubkey": typed, "nonce": nonce, "additional-evidence": evidence}
    text = json.dumps(runtime, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.new(hash_alg.lower(), text.encode("utf-8")).digest()
    return digest + bytes(64 - len(digest))


def private_jwk(key: GuestPrivateKey) -> dict[str, str]:
    """The private JWK the Rust harness reads."""
    if isinstance(key, rsa.RSAPrivateKey):
        numbers = key.private_numbers()
        return {
            **tee_pubkey(key),
            "d": _uint(numbers.d),
            "p": _uint(numbers.p),
            "q": _uint(numbers.q),
        }
    size = CURVE_NAMES[key.curve.name][1]
    return {**tee_pubkey(key), "d": b64u(key.private_numbers().private_value.to_bytes(size, "big"))}


def _uint(value: int) -> str:
    return b64u(value.to_bytes((value.bit_length() + 7) // 8, "big"))
