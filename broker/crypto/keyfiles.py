"""Private keys from PEM files named in configuration (development keys, statement and result
keys, checkpoint keys): one reader, one error naming the setting. Blocking: call it at start-up,
off the event loop."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from broker.core.errors import ConfigError


def private_key_file(path: Path, setting: str) -> PrivateKeyTypes:
    """The unencrypted PEM private key in ``path``.

    Raises: ConfigError naming ``setting`` when the file is unreadable or not such a key."""
    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(setting, f"not a readable PEM private key: {path}") from exc


def p256_private_key_file(path: Path, setting: str) -> ec.EllipticCurvePrivateKey:
    """Raises: ConfigError naming ``setting`` unless ``path`` holds an EC P-256 private key."""
    key = private_key_file(path, setting)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise ConfigError(setting, "must be an EC P-256 private key")
    return key


def p256_public_key_file(path: Path, setting: str) -> ec.EllipticCurvePublicKey:
    """The EC P-256 public key of a PEM file holding it or its private half.

    Raises: ConfigError naming ``setting``."""
    try:
        data = path.read_bytes()
        key = (
            serialization.load_pem_private_key(data, password=None).public_key()
            if b"PRIVATE KEY" in data
            else serialization.load_pem_public_key(data)
        )
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(setting, f"not a readable PEM key: {path}") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise ConfigError(setting, f"not an EC P-256 key: {path}")
    return key
