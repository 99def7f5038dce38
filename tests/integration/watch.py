"""What the watch rules' tests share: ``broker audit monitor`` run as cron runs it, the log key
to pin, and a wait for a signed checkpoint that covers every record written."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from broker.audit.publisher import checkpoint_paths
from broker.crypto.checkpoint import parse_checkpoint
from tests.integration.conftest import RunningBroker
from tests.support.cli import run


def monitor(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[Any], Any]:
    """``broker audit monitor ARGS``: its exit code, its hit lines and its report (or stderr)."""
    done = run("audit", "monitor", *args, env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    hits = [line for line in lines if line.get("hit")]
    report = lines[-1] if lines and not lines[-1].get("hit") else {"stderr": done.stderr}
    return done.returncode, hits, report


async def log_key(broker: RunningBroker) -> str:
    config = str(broker.workdir / "broker.toml")
    return (await asyncio.to_thread(run, "audit", "key", "--config", config)).stdout.strip()


async def covered(broker: RunningBroker) -> int:
    """The log's size, once a signed checkpoint covers every record written."""
    log = broker.settings.audit.log
    for _ in range(200):
        size = len(log.read_bytes().splitlines())
        note = checkpoint_paths(log)[0].read_text()
        if parse_checkpoint(note[: note.find("\n\n") + 1]).size == size:
            return size
        await asyncio.sleep(0.05)
    raise AssertionError("no checkpoint covers the log")
