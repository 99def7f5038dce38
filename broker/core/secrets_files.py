"""Secrets the broker keeps in files of its own: created once, shared by its processes.

The audit mask key and the challenge MAC key are 32 random bytes each. When the configured file
does not exist it is created with mode 0600, whole (written to a temporary file, then linked
into place: workers or replicas starting together create it once and all read the same bytes).
Replicas that must agree (challenges behind one load balancer; masks compared across logs) are
given one file, e.g. from a Kubernetes Secret.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from broker.core.errors import ConfigError

SECRET_BYTES = 32


def load_or_create_secret(path: Path, setting: str) -> bytes:
    """The 32-byte secret in ``path``, created if absent.

    Raises:
        ConfigError: ``setting`` when the file cannot be created or read, or is not 32 bytes.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _create_whole(path)
    except OSError as exc:
        raise ConfigError(setting, f"cannot create {path}: {exc.strerror}") from exc
    try:
        secret = path.read_bytes()
    except OSError as exc:
        raise ConfigError(setting, f"cannot read {path}: {exc.strerror}") from exc
    if len(secret) != SECRET_BYTES:
        raise ConfigError(setting, f"{path} must hold {SECRET_BYTES} bytes")
    return secret


def _create_whole(path: Path) -> None:
    """Create ``path`` with 32 random bytes unless it exists, never visible half-written: the
    bytes go to a private temporary file first, which is then linked into place (``link`` fails
    if the name exists: the first of several starting processes wins; the others read its bytes,
    not an empty file it has not written yet)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(SECRET_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another made it first: its bytes count
            os.link(temporary, path)
    finally:
        os.unlink(temporary)
