"""Generator of the fixed test keys in this folder. Run once; its output is checked in.

    python -m tests.vectors.generate

Tokens are minted from these keys at fixed times by ``tests/vectors/tokens.py``, so every
generated vector is reproducible from checked-in material.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

HERE = Path(__file__).parent
KEYS = ("issuer_rsa.pem", "attacker_rsa.pem")


def main() -> None:
    for name in KEYS:
        path = HERE / name
        if path.exists():
            continue
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


if __name__ == "__main__":
    main()
