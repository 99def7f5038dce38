"""Secrets the broker keeps in files of its own: created once, shared by its processes.

The audit mask key and the challenge MAC key are 32 random bytes each. When the configured file
does not exist it is created with mode 0600 (``O_EXCL``: workers starting together create it
once and all read the same bytes). Replicas that must agree (challenges behind one load
balancer; masks compared across logs) are given one file, e.g. from a Kubernetes Secret.
"""

from __future__ import annotations

import errno
import os
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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise ConfigError(setting, f"cannot create {path}: {exc.strerror}") from exc
    else:
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(SECRET_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
    try:
        secret = path.read_bytes()
    except OSError as exc:
        raise ConfigError(setting, f"cannot read {path}: {exc.strerror}") from exc
    if len(secret) != SECRET_BYTES:
        raise ConfigError(setting, f"{path} must hold {SECRET_BYTES} bytes")
    return secret
