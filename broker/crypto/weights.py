"""Streaming segmented AEAD for model weights (format ``BRKW1``).

A weights file is encrypted under a per-file key derived from the DEK, in fixed-size segments,
so multi-gigabyte files stream through constant memory and every segment is authenticated
before it is used.

Layout::

    header  = b"BRKW1\\0" || u16 len(kid) || kid (UTF-8, "<key>#<version>")
              || salt (16) || nonce_prefix (7) || u32 segment_size
    segment = AES-256-GCM(file_key, nonce_prefix || u32 index || last_flag, plaintext, aad=header)

* ``file_key = HKDF-SHA256(DEK, salt, info = b"broker-weights/v1\\0" || kid)``: a fresh key per
  file, so random 7-byte nonce prefixes never collide under one key.
* The segment index in the nonce stops reordering; the last-segment flag stops truncation
  (STREAM construction, Hoang-Reyhanitabar-Rogaway-Vizár 2015); the header as AAD binds the
  key id and parameters to every segment.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"BRKW1\0"
SALT_BYTES = 16
PREFIX_BYTES = 7
TAG_BYTES = 16
DEFAULT_SEGMENT = 1024 * 1024
MAX_SEGMENT = 64 * 1024 * 1024
MAX_KID_BYTES = 512
MAX_SEGMENTS = 2**32 - 1


class WeightsFormatError(ValueError):
    """The file is not a valid BRKW1 file for this key, or it was modified."""


def _file_key(dek: bytes, salt: bytes, kid: str) -> AESGCM:
    hkdf = HKDF(hashes.SHA256(), 32, salt, b"broker-weights/v1\0" + kid.encode())
    return AESGCM(hkdf.derive(dek))


def _nonce(prefix: bytes, index: int, last: bool) -> bytes:
    return prefix + struct.pack(">IB", index, 1 if last else 0)


def encrypt_stream(
    dek: bytes, kid: str, source: BinaryIO, sink: BinaryIO, *, segment_size: int = DEFAULT_SEGMENT
) -> None:
    """Encrypt ``source`` to ``sink`` under ``dek`` for key id ``kid``."""
    if not 1 <= segment_size <= MAX_SEGMENT:
        raise ValueError("segment_size out of range")
    kid_bytes = kid.encode()
    salt, prefix = os.urandom(SALT_BYTES), os.urandom(PREFIX_BYTES)
    header = (
        MAGIC
        + struct.pack(">H", len(kid_bytes))
        + kid_bytes
        + salt
        + prefix
        + struct.pack(">I", segment_size)
    )
    aead = _file_key(dek, salt, kid)
    sink.write(header)
    index = 0
    chunk = source.read(segment_size)
    while True:
        following = source.read(segment_size) if len(chunk) == segment_size else b""
        last = not following
        sink.write(aead.encrypt(_nonce(prefix, index, last), chunk, header))
        if last:
            return
        index += 1
        if index > MAX_SEGMENTS:
            raise ValueError("file too large for this segment size")
        chunk = following


def read_kid(source: BinaryIO) -> tuple[str, bytes]:
    """Read the header; return the key id and the header bytes.

    Raises:
        WeightsFormatError: when the header is malformed.
    """
    magic = source.read(len(MAGIC))
    if magic != MAGIC:
        raise WeightsFormatError("not a BRKW1 weights file")
    (kid_len,) = struct.unpack(">H", _exact(source, 2))
    if kid_len > MAX_KID_BYTES:
        raise WeightsFormatError("key id too long")
    kid_bytes = _exact(source, kid_len)
    rest = _exact(source, SALT_BYTES + PREFIX_BYTES + 4)
    try:
        kid = kid_bytes.decode()
    except UnicodeDecodeError as exc:
        raise WeightsFormatError("key id is not UTF-8") from exc
    return kid, magic + struct.pack(">H", kid_len) + kid_bytes + rest


def decrypt_stream(dek: bytes, expected_kid: str, source: BinaryIO, sink: BinaryIO) -> None:
    """Decrypt a BRKW1 stream; nothing unauthenticated is written to ``sink``.

    Raises:
        WeightsFormatError: on a wrong key id, a wrong key, or any modification, reordering
            or truncation.
    """
    kid, header = read_kid(source)
    if kid != expected_kid:
        raise WeightsFormatError(f"file is for key {kid!r}, not {expected_kid!r}")
    tail = header[-(SALT_BYTES + PREFIX_BYTES + 4) :]
    salt, prefix = tail[:SALT_BYTES], tail[SALT_BYTES : SALT_BYTES + PREFIX_BYTES]
    (segment_size,) = struct.unpack(">I", tail[-4:])
    if not 1 <= segment_size <= MAX_SEGMENT:
        raise WeightsFormatError("segment size out of range")
    aead = _file_key(dek, salt, kid)
    sealed_size = segment_size + TAG_BYTES
    index = 0
    chunk = source.read(sealed_size)
    while True:
        following = source.read(sealed_size) if len(chunk) == sealed_size else b""
        last = not following
        try:
            sink.write(aead.decrypt(_nonce(prefix, index, last), chunk, header))
        except InvalidTag as exc:
            raise WeightsFormatError(f"segment {index} does not authenticate") from exc
        if last:
            return
        index += 1
        chunk = following


def _exact(source: BinaryIO, size: int) -> bytes:
    data = source.read(size)
    if len(data) != size:
        raise WeightsFormatError("file is truncated")
    return data
