"""Local file KEK: development only.

The KEK is 32 random bytes in a file readable only by the broker's user (mode 0600). DEKs are
wrapped with AES-256-GCM: ``0x01 || nonce(12) || ciphertext || tag`` with the key name and version
as associated data. The broker logs loudly when this provider is in use and ``/readyz`` says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from broker.core.errors import ConfigError, ErrorCode, UpstreamError

log = logging.getLogger(__name__)
FORMAT_V1 = b"\x01"
KEK_BYTES = 32
NONCE_BYTES = 12


def create_kek_file(path: Path) -> None:
    """Create a new random KEK file (0600); refuses to overwrite an existing one.

    Raises:
        ConfigError: ``keys.kek`` when the file exists or cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise ConfigError("keys.kek", f"KEK file already exists: {path}") from exc
    with os.fdopen(fd, "wb") as handle:
        handle.write(os.urandom(KEK_BYTES))
        handle.flush()
        os.fsync(handle.fileno())


class LocalKek:
    """``KekProvider`` over a KEK file."""

    def __init__(self, path: Path) -> None:
        try:
            mode = path.stat().st_mode
            material = path.read_bytes()
        except OSError as exc:
            raise ConfigError("keys.kek", f"cannot read KEK file {path}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError("keys.kek", f"KEK file {path} must not be readable by others (0600)")
        if len(material) != KEK_BYTES:
            raise ConfigError("keys.kek", f"KEK file {path} must hold exactly {KEK_BYTES} bytes")
        self._aead = AESGCM(material)
        fingerprint = hashlib.sha256(b"broker-kek-id\0" + material).hexdigest()[:16]
        self._reference = f"local:{fingerprint}"
        log.warning(
            "DEVELOPMENT KEK in use (%s): a local file guards the data keys; "
            "use a KMS or HSM KEK in production",
            path,
        )

    @property
    def reference(self) -> str:
        return self._reference

    @property
    def development_only(self) -> bool:
        return True

    async def wrap(self, dek: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return FORMAT_V1 + nonce + self._aead.encrypt(nonce, dek, aad)

    async def close(self) -> None:
        """Nothing to release."""

    async def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        if not wrapped.startswith(FORMAT_V1) or len(wrapped) < 1 + NONCE_BYTES + 16:
            raise UpstreamError("wrapped DEK has an unknown format", code=ErrorCode.KEK_UNAVAILABLE)
        nonce, body = wrapped[1 : 1 + NONCE_BYTES], wrapped[1 + NONCE_BYTES :]
        try:
            return self._aead.decrypt(nonce, body, aad)
        except InvalidTag as exc:
            raise UpstreamError(
                "wrapped DEK does not unwrap with this KEK", code=ErrorCode.KEK_UNAVAILABLE
            ) from exc
