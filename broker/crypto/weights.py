"""Streaming segmented AEAD for model weights (format ``BRKW1``, docs/weights-format.md).

A weights file is encrypted under a per-file key derived from the DEK, in fixed-size segments,
so multi-gigabyte files stream through constant memory, any segment can be decrypted on its own
(random access), and every segment is authenticated before it is used.

Layout::

    header  = b"BRKW1\\0" || u16 len(kid) || kid (UTF-8, "<key>#<version>")
              || salt (16) || nonce_prefix (7) || u32 segment_size
    segment = AES-256-GCM(file_key, nonce_prefix || u32 index || last_flag, plaintext, aad=header)

* ``file_key = HKDF-SHA256(DEK, salt, info = b"broker-weights/v1\\0" || kid)``: a fresh key per
  file, so random 7-byte nonce prefixes never collide under one key.
* The segment index in the nonce stops reordering; the last-segment flag stops truncation
  (STREAM construction, Hoang-Reyhanitabar-Rogaway-Vizár 2015); the header as AAD binds the
  key id and parameters to every segment.

``SealedFile`` is the parsed header plus the file size: it knows where segment ``i`` lies and
whether it is the final one, which is all random access needs. The pure functions here do no
I/O beyond the file objects they are handed; sources and the async paths live in
``broker.client.weights``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
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
MAX_HEADER_BYTES = len(MAGIC) + 2 + MAX_KID_BYTES + SALT_BYTES + PREFIX_BYTES + 4


class WeightsFormatError(ValueError):
    """The file is not a valid BRKW1 file for this key, or it was modified."""


def file_key(dek: bytes | bytearray, salt: bytes, kid: str) -> AESGCM:
    hkdf = HKDF(hashes.SHA256(), 32, salt, b"broker-weights/v1\0" + kid.encode())
    return AESGCM(hkdf.derive(dek))


def segment_nonce(prefix: bytes, index: int, last: bool) -> bytes:
    return prefix + struct.pack(">IB", index, 1 if last else 0)


def encode_header(kid: str, salt: bytes, prefix: bytes, segment_size: int) -> bytes:
    kid_bytes = kid.encode()
    if len(kid_bytes) > MAX_KID_BYTES:
        raise ValueError("key id too long")
    return (
        MAGIC
        + struct.pack(">H", len(kid_bytes))
        + kid_bytes
        + salt
        + prefix
        + struct.pack(">I", segment_size)
    )


@dataclass(frozen=True)
class Header:
    kid: str
    salt: bytes
    prefix: bytes
    segment_size: int
    raw: bytes  # the header exactly as stored: every segment's AAD

    @classmethod
    def parse(cls, data: bytes) -> Header:
        """Parse a header from the first bytes of a file (extra bytes are ignored).

        Raises:
            WeightsFormatError: when it is not a well-formed BRKW1 header.
        """
        if data[: len(MAGIC)] != MAGIC:
            raise WeightsFormatError("not a BRKW1 weights file")
        if len(data) < len(MAGIC) + 2:
            raise WeightsFormatError("file is truncated")
        (kid_len,) = struct.unpack(">H", data[len(MAGIC) : len(MAGIC) + 2])
        if kid_len > MAX_KID_BYTES:
            raise WeightsFormatError("key id too long")
        start = len(MAGIC) + 2
        end = start + kid_len + SALT_BYTES + PREFIX_BYTES + 4
        if len(data) < end:
            raise WeightsFormatError("file is truncated")
        try:
            kid = data[start : start + kid_len].decode()
        except UnicodeDecodeError as exc:
            raise WeightsFormatError("key id is not UTF-8") from exc
        salt = data[start + kid_len : start + kid_len + SALT_BYTES]
        prefix = data[start + kid_len + SALT_BYTES : end - 4]
        (segment_size,) = struct.unpack(">I", data[end - 4 : end])
        if not 1 <= segment_size <= MAX_SEGMENT:
            raise WeightsFormatError("segment size out of range")
        return cls(kid, salt, prefix, segment_size, bytes(data[:end]))


@dataclass(frozen=True)
class SealedFile:
    """A BRKW1 file's header and size: where each segment lies, and which one is final."""

    header: Header
    size: int  # of the whole encrypted file

    @property
    def segments(self) -> int:
        body = self.size - len(self.header.raw)
        return max(1, -(-body // (self.header.segment_size + TAG_BYTES)))

    @property
    def plaintext_size(self) -> int:
        return self.size - len(self.header.raw) - TAG_BYTES * self.segments

    def check(self) -> None:
        """Raises ``WeightsFormatError`` when the size cannot be a BRKW1 file's."""
        body = self.size - len(self.header.raw)
        full = self.header.segment_size + TAG_BYTES
        if body < TAG_BYTES or (body % full and body % full < TAG_BYTES):
            raise WeightsFormatError("file is truncated")
        if self.segments > MAX_SEGMENTS + 1:
            raise WeightsFormatError("file has too many segments")

    def span(self, index: int) -> tuple[int, int]:
        """(offset, length) of sealed segment ``index`` in the file."""
        full = self.header.segment_size + TAG_BYTES
        start = len(self.header.raw) + index * full
        return start, min(full, self.size - start)


class SegmentCipher:
    """Decrypts the segments of one file with its derived key (thread-safe: AESGCM is)."""

    def __init__(self, dek: bytes, sealed: SealedFile, expected_kid: str | None = None) -> None:
        # Without expected_kid the DEK alone authenticates the file (the per-file key is derived
        # from it and the header's kid); with it, a file for another key or version is refused
        # before any segment is read, with a clear message.
        if expected_kid is not None and sealed.header.kid != expected_kid:
            raise WeightsFormatError(f"file is for key {sealed.header.kid!r}, not {expected_kid!r}")
        sealed.check()
        self.sealed = sealed
        self._aead = file_key(dek, sealed.header.salt, sealed.header.kid)

    def _nonce(self, index: int) -> bytes:
        return segment_nonce(self.sealed.header.prefix, index, index == self.sealed.segments - 1)

    def open(self, index: int, data: bytes) -> bytes:
        """The plaintext of sealed segment ``index``.

        Raises:
            WeightsFormatError: when it does not authenticate (changed, moved, wrong key).
        """
        try:
            return self._aead.decrypt(self._nonce(index), data, self.sealed.header.raw)
        except InvalidTag as exc:
            raise WeightsFormatError(f"segment {index} does not authenticate") from exc

    def open_into(self, index: int, data: bytes | memoryview, out: bytearray | memoryview) -> int:
        """``open`` into a caller's buffer (at least ``len(data) - 16`` bytes): no allocation per
        segment. Returns the plaintext length; on failure ``out`` holds nothing usable.

        Raises:
            WeightsFormatError: when it does not authenticate.
        """
        size = len(data) - TAG_BYTES
        if size < 0:
            raise WeightsFormatError(f"segment {index} is truncated")
        target = memoryview(out)[:size]
        try:
            self._aead.decrypt_into(self._nonce(index), data, self.sealed.header.raw, target)
        except InvalidTag as exc:
            raise WeightsFormatError(f"segment {index} does not authenticate") from exc
        return size


def encrypt_stream(
    dek: bytes,
    kid: str,
    source: BinaryIO,
    sink: BinaryIO,
    *,
    segment_size: int = DEFAULT_SEGMENT,
    salt: bytes | None = None,
    nonce_prefix: bytes | None = None,
) -> int:
    """Encrypt ``source`` to ``sink`` under ``dek`` for key id ``kid``; return the plaintext size.

    ``salt`` and ``nonce_prefix`` are random unless given (only the test vectors give them).
    """
    if not 1 <= segment_size <= MAX_SEGMENT:
        raise ValueError("segment_size out of range")
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    prefix = os.urandom(PREFIX_BYTES) if nonce_prefix is None else nonce_prefix
    if len(salt) != SALT_BYTES or len(prefix) != PREFIX_BYTES:
        raise ValueError("salt is 16 bytes, the nonce prefix 7")
    header = encode_header(kid, salt, prefix, segment_size)
    aead = file_key(dek, salt, kid)
    sink.write(header)
    index = total = 0
    chunk = source.read(segment_size)
    while True:
        following = source.read(segment_size) if len(chunk) == segment_size else b""
        last = not following
        sink.write(aead.encrypt(segment_nonce(prefix, index, last), chunk, header))
        total += len(chunk)
        if last:
            return total
        index += 1
        if index > MAX_SEGMENTS:
            raise ValueError("file too large for this segment size")
        chunk = following


def read_kid(source: BinaryIO) -> tuple[str, bytes]:
    """Read the header; return the key id and the header bytes.

    Raises:
        WeightsFormatError: when the header is malformed.
    """
    start = source.read(len(MAGIC) + 2)
    if start[: len(MAGIC)] != MAGIC:
        raise WeightsFormatError("not a BRKW1 weights file")
    if len(start) < len(MAGIC) + 2:
        raise WeightsFormatError("file is truncated")
    (kid_len,) = struct.unpack(">H", start[len(MAGIC) :])
    if kid_len > MAX_KID_BYTES:
        raise WeightsFormatError("key id too long")
    header = Header.parse(start + source.read(kid_len + SALT_BYTES + PREFIX_BYTES + 4))
    return header.kid, header.raw


def decrypt_stream(dek: bytes, expected_kid: str, source: BinaryIO, sink: BinaryIO) -> None:
    """Decrypt a BRKW1 stream (size unknown up front); nothing unauthenticated is written.

    Raises:
        WeightsFormatError: on a wrong key id, a wrong key, or any modification, reordering
            or truncation.
    """
    kid, raw = read_kid(source)
    if kid != expected_kid:
        raise WeightsFormatError(f"file is for key {kid!r}, not {expected_kid!r}")
    header = Header.parse(raw)
    aead = file_key(dek, header.salt, kid)
    sealed_size = header.segment_size + TAG_BYTES
    index = 0
    chunk = source.read(sealed_size)
    while True:
        following = source.read(sealed_size) if len(chunk) == sealed_size else b""
        last = not following
        try:
            sink.write(aead.decrypt(segment_nonce(header.prefix, index, last), chunk, raw))
        except InvalidTag as exc:
            raise WeightsFormatError(f"segment {index} does not authenticate") from exc
        if last:
            return
        index += 1
        chunk = following
