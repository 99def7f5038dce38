"""Encrypted weights made as an owner makes them (``broker weights encrypt``, in process)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from tests.support.cli import run
from tests.support.constants import KEY


async def sealed_before_a_rotation(workdir: Path, name: str, size: int) -> tuple[Path, bytes]:
    """``<name>.brkw`` encrypted with ``KEY`` version 1, then ``KEY`` rotated (the newest version
    is 2): the encrypted file and its plaintext."""
    config = str(workdir / "broker.toml")
    plain = os.urandom(size)
    source, sealed = workdir / name, workdir / f"{name}.brkw"
    await asyncio.to_thread(source.write_bytes, plain)
    made = await asyncio.to_thread(
        run, "weights", "encrypt", str(source), str(sealed), "--key", KEY, "--config", config
    )
    assert made.returncode == 0, made.stderr
    rotated = await asyncio.to_thread(run, "keys", "rotate", KEY, "--config", config)
    assert rotated.returncode == 0, rotated.stderr
    return sealed, plain


async def sealed_with(workdir: Path, name: str, key: str, size: int = 4096) -> tuple[Path, bytes]:
    """``<name>.brkw`` encrypted with ``key``'s newest version (no rotation): the encrypted file
    and its plaintext."""
    plain = os.urandom(size)
    source, sealed = workdir / name, workdir / f"{name}.brkw"
    await asyncio.to_thread(source.write_bytes, plain)
    config = str(workdir / "broker.toml")
    made = await asyncio.to_thread(
        run, "weights", "encrypt", str(source), str(sealed), "--key", key, "--config", config
    )
    assert made.returncode == 0, made.stderr
    return sealed, plain
