"""Signed checkpoints of the decision log, in the C2SP formats.

* ``tlog-checkpoint`` body: the origin line, the tree size in decimal, the root hash in standard
  base64, each followed by a newline.
* ``signed-note``: the body, an empty line, then one signature line per signer:
  ``— <key name> <base64(key hash[4] || signature)>``, where the key hash is the first four bytes
  of SHA-256(key name || "\\n" || 0x01 || Ed25519 public key) and the signature is Ed25519 over
  the body. Auditors pin the verifier key ``<name>+<hex key hash>+<base64(0x01 || public key)>``
  (``broker audit key``).

The signed-note format has a reference implementation in Go (``golang.org/x/mod/sumdb/note``);
``make test`` checks our checkpoints with it (tests/integration/test_log_go_reference.py).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.core.errors import ConfigError
from broker.crypto.keyfiles import private_key_file

ALG_ED25519 = b"\x01"
SIGNATURE_PREFIX = "\u2014 "  # em dash and a space
MAX_NOTE_BYTES = 64 * 1024


class NoteError(ValueError):
    """A note or checkpoint that does not parse or does not verify."""


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes

    def body(self) -> str:
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"


def key_hash(name: str, public_raw: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + ALG_ED25519 + public_raw).digest()[:4]


def _check_name(name: str) -> str:
    if not name or any(c.isspace() or c == "+" for c in name):
        raise ConfigError("audit.origin", "a note key name has no spaces and no '+'")
    return name


class NoteSigner:
    """Signs notes with an Ed25519 key under a key name (the log's origin)."""

    def __init__(self, name: str, key: ed25519.Ed25519PrivateKey) -> None:
        self.name = _check_name(name)
        self._key = key
        self.public_raw = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def from_pem(cls, name: str, path: Path) -> NoteSigner:
        """Raises: ConfigError naming ``audit.signing_key``."""
        key = private_key_file(path, "audit.signing_key")
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError("audit.signing_key", "must be an Ed25519 private key")
        return cls(name, key)

    def verifier_key(self) -> str:
        """``<name>+<hex key hash>+<base64(0x01 || public key)>``."""
        return verifier_key_text(self.name, self.public_raw)

    def sign(self, body: str) -> str:
        """The signed note: body, empty line, one signature line."""
        return note_with_signature(body, self.name, self.public_raw, self._key.sign(body.encode()))

    async def sign_note(self, body: str) -> str:
        return self.sign(body)


def note_with_signature(body: str, name: str, public_raw: bytes, signature: bytes) -> str:
    """Assemble a signed note from a body and an Ed25519 signature over it."""
    if not body.endswith("\n"):
        raise ValueError("a note body ends with a newline")
    blob = base64.b64encode(key_hash(name, public_raw) + signature).decode()
    return f"{body}\n{SIGNATURE_PREFIX}{name} {blob}\n"


def verifier_key_text(name: str, public_raw: bytes) -> str:
    """``<name>+<hex key hash>+<base64(0x01 || public key)>``."""
    encoded = base64.b64encode(ALG_ED25519 + public_raw).decode()
    return f"{name}+{key_hash(name, public_raw).hex()}+{encoded}"


class CheckpointSigner(Protocol):
    """What signs checkpoints: a local Ed25519 key or a Cloud KMS EC_SIGN_ED25519 version."""

    name: str
    public_raw: bytes

    def verifier_key(self) -> str: ...

    async def sign_note(self, body: str) -> str: ...


@dataclass(frozen=True)
class NoteVerifier:
    name: str
    hash: bytes
    public: ed25519.Ed25519PublicKey

    @classmethod
    def parse(cls, text: str) -> NoteVerifier:
        """From ``<name>+<hex hash>+<base64 key>``.

        Raises:
            NoteError: not such a key, or its hash does not match its name and key.
        """
        name, expected, public = parse_key_text(text, ALG_ED25519, key_hash)
        return cls(name, expected, public)

    def open(self, note: str) -> str:
        """The note's body, if a signature line by this key verifies.

        Raises:
            NoteError: malformed, no signature by this key, or it does not verify.
        """
        if len(note) > MAX_NOTE_BYTES or not note.endswith("\n"):
            raise NoteError("not a signed note")
        split = note.rfind("\n\n")
        if split < 0:
            raise NoteError("a signed note has an empty line before its signatures")
        body, signatures = note[: split + 1], note[split + 2 :]
        for line in signatures.splitlines():
            if not line.startswith(SIGNATURE_PREFIX):
                raise NoteError("malformed signature line")
            name, _, blob = line[len(SIGNATURE_PREFIX) :].partition(" ")
            if name != self.name:
                continue
            try:
                raw = base64.b64decode(blob, validate=True)
            except ValueError as exc:
                raise NoteError("signature is not base64") from exc
            if raw[:4] != self.hash:
                continue
            try:
                self.public.verify(raw[4:], body.encode())
            except InvalidSignature as exc:
                raise NoteError("the signature does not verify") from exc
            return body
        raise NoteError(f"no signature by {self.name}")


def parse_key_text(
    text: str, algorithm: bytes, key_id: Callable[[str, bytes], bytes]
) -> tuple[str, bytes, ed25519.Ed25519PublicKey]:
    """``<name>+<hex key id>+<base64(algorithm || Ed25519 public key)>`` (signed-note verifier
    keys use algorithm 0x01, cosignature/v1 witness keys 0x04).

    Raises:
        NoteError: not such a key, or its id does not match its name and key.
    """
    parts = text.strip().split("+", 2)  # the base64 key may contain "+" itself
    if len(parts) != 3:
        raise NoteError("a key is <name>+<key id>+<key>")
    name, digest, encoded = parts
    try:
        raw = base64.b64decode(encoded, validate=True)
        expected = bytes.fromhex(digest)
    except ValueError as exc:
        raise NoteError("the key's id or key is not encoded right") from exc
    if len(raw) != 33 or raw[:1] != algorithm:
        raise NoteError(f"only Ed25519 keys of algorithm {algorithm.hex()} are supported here")
    if key_id(name, raw[1:]) != expected:
        raise NoteError("the key's id does not match its name and key")
    return name, expected, ed25519.Ed25519PublicKey.from_public_bytes(raw[1:])


def parse_checkpoint(body: str, *, origin: str | None = None) -> Checkpoint:
    """Raises: NoteError when the body is not a checkpoint (or of another origin)."""
    lines = body.split("\n")
    if len(lines) < 4 or lines[-1] != "":
        raise NoteError("a checkpoint has origin, size and root lines")
    name, size_text, root_text = lines[:3]
    if origin is not None and name != origin:
        raise NoteError(f"checkpoint of origin {name!r}, expected {origin!r}")
    if not size_text.isdigit() or (size_text.startswith("0") and size_text != "0"):
        raise NoteError("the tree size is not a decimal number")
    try:
        root = base64.b64decode(root_text, validate=True)
    except ValueError as exc:
        raise NoteError("the root hash is not base64") from exc
    if len(root) != 32:
        raise NoteError("the root hash is not 32 bytes")
    return Checkpoint(origin=name, size=int(size_text), root=root)
