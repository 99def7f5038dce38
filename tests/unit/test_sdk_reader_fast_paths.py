"""The SDK reader's fast paths give the same bytes as segment-by-segment reading: ``read()`` of
the rest (segments decrypted by threads, from any position), reads of whole segments straight
into the caller's buffer, and a changed segment still refused."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from broker.client.weights import EncryptedReader, open_encrypted, open_source
from broker.crypto.weights import WeightsFormatError, encrypt_stream

DEK = bytes(range(32))
KID = "models/fast#1"
SEGMENT = 4096


@pytest.fixture
def sealed(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(SEGMENT * 37 + 123)  # many segments and a short last one
    path = tmp_path / "w.brkw"
    with path.open("wb") as sink:
        encrypt_stream(DEK, KID, io.BytesIO(data), sink, segment_size=SEGMENT)
    return path, data


@pytest.mark.parametrize("position", [0, 1, SEGMENT - 1, SEGMENT, 5 * SEGMENT + 7, 37 * SEGMENT])
def test_read_of_the_rest_from_any_position(sealed: tuple[Path, bytes], position: int) -> None:
    path, data = sealed
    with open_encrypted(path, DEK, KID) as reader:
        reader.seek(position)
        assert reader.read() == data[position:]
        assert reader.read() == b""


def test_whole_segments_land_straight_in_the_callers_buffer(sealed: tuple[Path, bytes]) -> None:
    path, data = sealed
    raw = EncryptedReader(open_source(path), DEK, KID)
    buffer = bytearray(10 * SEGMENT + 5)  # ten whole segments, then part of one
    assert raw.readinto(buffer) == len(buffer)
    assert bytes(buffer) == data[: len(buffer)]
    raw.seek(3)  # not on a boundary: the cached path, then whole segments again
    buffer = bytearray(3 * SEGMENT)
    assert raw.readinto(buffer) == len(buffer)
    assert bytes(buffer) == data[3 : 3 + len(buffer)]


def test_a_changed_segment_is_refused_by_every_path(sealed: tuple[Path, bytes]) -> None:
    path, _ = sealed
    changed = bytearray(path.read_bytes())
    changed[-SEGMENT * 3] ^= 1  # inside a segment near the end
    path.write_bytes(bytes(changed))
    with open_encrypted(path, DEK, KID) as reader, pytest.raises(WeightsFormatError):
        reader.read()
    raw = EncryptedReader(open_source(path), DEK, KID)
    with pytest.raises(WeightsFormatError):
        raw.readinto(bytearray(40 * SEGMENT))
