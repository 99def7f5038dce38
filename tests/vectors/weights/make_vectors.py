"""Regenerate brkw1.json: ``python tests/vectors/weights/make_vectors.py`` (from the repo root).

Fixed DEK, salt and nonce prefix; small segment sizes so the vectors stay readable. The
plaintexts cover the edge cases of the format: empty, one byte, exactly one segment, exactly
two, and a partial final segment. ``tests/unit/test_weights_vectors.py`` checks them with a
reader written from docs/weights-format.md, not with ``broker.crypto.weights``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from broker.crypto.weights import encrypt_stream

DEK = bytes(range(32))
SALT = bytes(range(0xA0, 0xB0))
PREFIX = bytes.fromhex("0102030405060c")
CASES = [
    ("empty", b"", 16),
    ("one byte", b"\x42", 16),
    ("exactly one segment", bytes(range(16)), 16),
    ("exactly two segments", bytes(range(32)), 16),
    ("partial final segment", b"sealed runner weights, five segments long", 9),
]


def main() -> None:
    vectors = []
    for name, plaintext, segment_size in CASES:
        sealed = io.BytesIO()
        encrypt_stream(
            DEK,
            "models/vector#1",
            io.BytesIO(plaintext),
            sealed,
            segment_size=segment_size,
            salt=SALT,
            nonce_prefix=PREFIX,
        )
        vectors.append(
            {
                "name": name,
                "dek": DEK.hex(),
                "kid": "models/vector#1",
                "salt": SALT.hex(),
                "nonce_prefix": PREFIX.hex(),
                "segment_size": segment_size,
                "plaintext": plaintext.hex(),
                "file": sealed.getvalue().hex(),
            }
        )
    out = Path(__file__).with_name("brkw1.json")
    out.write_text(json.dumps({"format": "BRKW1", "vectors": vectors}, indent=1) + "\n")


if __name__ == "__main__":
    main()
