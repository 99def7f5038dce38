"""Secret files the broker creates for itself (challenge and mask keys): processes starting
together all read the one secret, never a file its creator has not written yet."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from broker.core.errors import ConfigError
from broker.core.secrets_files import SECRET_BYTES, load_or_create_secret


def test_starting_together_every_one_reads_the_same_whole_secret(tmp_path: Path) -> None:
    for round_ in range(30):
        path = tmp_path / f"round-{round_}" / "challenge.key"
        barrier = threading.Barrier(8)

        def start(_: int, path: Path = path, barrier: threading.Barrier = barrier) -> bytes:
            barrier.wait()
            return load_or_create_secret(path, "nonces.challenge_key")

        with ThreadPoolExecutor(8) as pool:
            secrets = set(pool.map(start, range(8)))
        assert len(secrets) == 1
        assert len(secrets.pop()) == SECRET_BYTES
        assert [p.name for p in path.parent.iterdir()] == ["challenge.key"]  # no temporary left
        assert path.stat().st_mode & 0o777 == 0o600


def test_a_secret_file_of_another_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mask.key"
    path.write_bytes(b"short")
    with pytest.raises(ConfigError) as caught:
        load_or_create_secret(path, "audit.mask_key")
    assert caught.value.key == "audit.mask_key"
