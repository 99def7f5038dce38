"""Publishing signed checkpoints of the decision log.

Every ``[audit] checkpoint_seconds``, if records were added, the broker signs a checkpoint of the
tree as committed and writes it to ``<log>.checkpoint`` (replaced atomically; what
``GET /v1/log/checkpoint`` serves) and appends it to ``<log>.checkpoints`` (JSON lines
``{"size", "note"}``: the history ``broker audit verify`` uses to name the first bad index).
Without ``[audit] signing_key`` no checkpoint is made (``/readyz`` says so).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from broker.audit.checkpoint import Checkpoint, CheckpointSigner
from broker.audit.log import DecisionLog
from broker.audit.witness import Witness, request_cosignature
from broker.errors import UpstreamError

log = logging.getLogger(__name__)


def checkpoint_paths(log_path: Path) -> tuple[Path, Path]:
    return log_path.with_name(log_path.name + ".checkpoint"), log_path.with_name(
        log_path.name + ".checkpoints"
    )


class CheckpointPublisher:
    def __init__(
        self,
        decisions: DecisionLog,
        signer: CheckpointSigner,
        *,
        interval: float,
        witnesses: Sequence[Witness] = (),
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._log = decisions
        self._signer = signer
        self._interval = interval
        self._witnesses = list(witnesses)
        self._session = session
        self.latest: str | None = None
        self._latest_size = -1

    @property
    def signer(self) -> CheckpointSigner:
        return self._signer

    async def publish(self) -> str:
        """Sign and store a checkpoint of the committed tree now; returns the note."""
        size = self._log.committed_size
        root = self._log.tree.root(size)
        body = Checkpoint(self._signer.name, size, root).body()
        note = await self._signer.sign_note(body)
        if self._session is not None and size > 0:
            for witness in self._witnesses:  # best effort, one at a time
                line = await request_cosignature(
                    self._session,
                    witness,
                    note=note,
                    body=body,
                    size=size,
                    proof_from=lambda old: self._log.tree.consistency_proof(old, size),
                )
                if line is not None:
                    note += line
        await asyncio.to_thread(self._store, note, size)
        self.latest, self._latest_size = note, size
        return note

    def _store(self, note: str, size: int) -> None:
        latest, history = checkpoint_paths(self._log.path)
        temporary = latest.with_name(latest.name + ".tmp")
        temporary.write_text(note, encoding="utf-8")
        os.replace(temporary, latest)
        with history.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"size": size, "note": note}) + "\n")

    async def run(self) -> None:
        """Publish after new records, at most every ``interval`` seconds."""
        while True:
            await asyncio.sleep(self._interval)
            if self._log.committed_size != self._latest_size:
                try:
                    await self.publish()
                except (OSError, UpstreamError):
                    log.exception("checkpoint could not be signed or written")
