"""BRKW1 test vectors (tests/vectors/weights/brkw1.json) checked by a second reader written from
docs/weights-format.md — it shares no code with ``broker.crypto.weights`` — and the attacks the
format must detect, applied to the vectors, refused by both readers."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from broker.client.weights import open_encrypted
from broker.crypto.weights import WeightsFormatError, decrypt_stream, encrypt_stream

VECTORS = json.loads(
    (Path(__file__).parents[1] / "vectors" / "weights" / "brkw1.json").read_text()
)["vectors"]


def reference_decrypt(dek: bytes, file: bytes) -> tuple[str, bytes]:
    """The format as docs/weights-format.md states it, nothing more."""
    if file[:6] != b"BRKW1\x00":
        raise ValueError("magic")
    (kid_len,) = struct.unpack(">H", file[6:8])
    kid = file[8 : 8 + kid_len].decode()
    salt = file[8 + kid_len : 24 + kid_len]
    prefix = file[24 + kid_len : 31 + kid_len]
    (segment,) = struct.unpack(">I", file[31 + kid_len : 35 + kid_len])
    header = file[: 35 + kid_len]
    key = HKDF(hashes.SHA256(), 32, salt, b"broker-weights/v1\x00" + kid.encode()).derive(dek)
    body = file[len(header) :]
    count = max(1, -(-len(body) // (segment + 16)))
    plain = b""
    for i in range(count):
        piece = body[i * (segment + 16) : (i + 1) * (segment + 16)]
        nonce = prefix + struct.pack(">I", i) + (b"\x01" if i == count - 1 else b"\x00")
        plain += AESGCM(key).decrypt(nonce, piece, header)
    return kid, plain


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_decrypts_with_the_reference_and_the_broker(vector: dict[str, Any]) -> None:
    dek, file = bytes.fromhex(vector["dek"]), bytes.fromhex(vector["file"])
    kid, plain = reference_decrypt(dek, file)
    assert (kid, plain) == (vector["kid"], bytes.fromhex(vector["plaintext"]))
    out = io.BytesIO()
    decrypt_stream(dek, kid, io.BytesIO(file), out)
    assert out.getvalue() == plain
    path_free = _MemorySource(file)
    with open_encrypted(path_free, dek, kid) as reader:
        assert reader.read() == plain


def attacks(file: bytes, vector: dict[str, Any]) -> dict[str, bytes]:
    header_len = 35 + len(vector["kid"])
    full = vector["segment_size"] + 16
    body = file[header_len:]
    segments = [body[i : i + full] for i in range(0, len(body), full)]
    found = {
        "flipped ciphertext byte": file[:-1] + bytes([file[-1] ^ 1]),
        "changed segment size": file[: header_len - 1]
        + bytes([file[header_len - 1] ^ 2])
        + file[header_len:],
        "changed salt": file[: header_len - 20]
        + bytes([file[header_len - 20] ^ 1])
        + file[header_len - 19 :],
        "appended segment": file + segments[-1],
    }
    if len(segments) > 1:
        found["truncated at a segment boundary"] = file[: header_len + full * (len(segments) - 1)]
        found["segments swapped"] = (
            file[:header_len] + segments[1] + segments[0] + b"".join(segments[2:])
        )
    return found


@pytest.mark.parametrize("vector", VECTORS[2:], ids=[v["name"] for v in VECTORS[2:]])
def test_every_attack_on_a_vector_is_refused_by_both_readers(vector: dict[str, Any]) -> None:
    dek, file = bytes.fromhex(vector["dek"]), bytes.fromhex(vector["file"])
    for name, changed in attacks(file, vector).items():
        with pytest.raises((InvalidTag, ValueError)):
            reference_decrypt(dek, changed)
        with pytest.raises(WeightsFormatError):
            decrypt_stream(dek, vector["kid"], io.BytesIO(changed), io.BytesIO())
        with (
            pytest.raises(WeightsFormatError),
            open_encrypted(_MemorySource(changed), dek, vector["kid"]) as reader,
        ):
            reader.read()
        assert name


def test_splicing_a_segment_from_another_file_under_the_same_dek_is_refused() -> None:
    (vector,) = (v for v in VECTORS if v["name"] == "exactly two segments")
    dek = bytes.fromhex(vector["dek"])
    other = io.BytesIO()
    encrypt_stream(dek, vector["kid"], io.BytesIO(bytes(32)), other, segment_size=16)
    file = bytes.fromhex(vector["file"])
    spliced = file[: len(file) - 32] + other.getvalue()[-32:]  # the other file's last segment
    with pytest.raises(WeightsFormatError):
        decrypt_stream(dek, vector["kid"], io.BytesIO(spliced), io.BytesIO())


class _MemorySource:
    """A RangeSource over bytes (the vectors are small)."""

    name = "memory"

    def __init__(self, data: bytes) -> None:
        self._data = data

    def size(self) -> int:
        return len(self._data)

    def read_range(self, start: int, length: int) -> bytes:
        return self._data[start : start + length]

    async def aread_range(self, start: int, length: int) -> bytes:
        return self.read_range(start, length)

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
