"""Publishing signed checkpoints of the decision log.

Every ``[audit] checkpoint_seconds``, if records were added, the broker signs a checkpoint of the
tree as committed and writes it to ``<log>.checkpoint`` (replaced atomically; what
``GET /v1/log/checkpoint`` serves) and appends it to ``<log>.checkpoints`` (JSON lines
``{"size", "note"}``: the history ``broker audit verify`` uses to name the first bad index).
Without ``[audit] signing_key`` no checkpoint is made (``/readyz`` says so).

Checkpoints only grow. The workers of one replica share the log and its checkpoint files; each
publishes under ``<log>.checkpoint.lock`` (``flock``, held across the signature): it first
catches up with every worker's records, then signs only a tree larger than the last signed one
and only if that tree still has the last checkpoint's root at its size (consistent, RFC 9162
§2.1.4). Otherwise it adopts the file's checkpoint. Every worker serves the file's newest
checkpoint, so whichever answers, a client never sees a checkpoint smaller than one it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

from broker.audit.log import DecisionLog
from broker.audit.records import LogCorrupt
from broker.audit.witness import Witness, request_cosignature
from broker.core.errors import UpstreamError
from broker.core.metrics import Metrics
from broker.crypto.checkpoint import (
    Checkpoint,
    CheckpointSigner,
    NoteError,
    NoteVerifier,
    parse_checkpoint,
)

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
        metrics: Metrics | None = None,
    ) -> None:
        """``metrics``: the newest checkpoint's size and time, and failures, exported."""
        self._log = decisions
        self._metrics = metrics
        self._signer = signer
        self._interval = interval
        self._witnesses = list(witnesses)
        self._session = session
        self.latest: str | None = None
        self._latest_size = -1
        self._lock_fd: int | None = None
        self._turn = asyncio.Lock()  # one publish at a time within this process

    @property
    def signer(self) -> CheckpointSigner:
        return self._signer

    def verifier_key(self) -> str:
        """The note verifier key that checks this log's checkpoints."""
        return self._signer.verifier_key()

    async def publish(self) -> str:
        """Sign and store a checkpoint of the committed tree, if it grew; returns the newest
        checkpoint (ours, or one another worker signed).

        Raises:
            LogCorrupt: the log no longer has the last checkpoint's root (nothing is signed).
            UpstreamError / OSError: the signer or the files failed.
        """
        async with self._turn, self._exclusive():
            await self._log.refresh()
            size = self._log.committed_size
            previous = await asyncio.to_thread(self._read_latest)
            if previous is not None:
                note, last = previous
                ours = self._ours(note)
                if last.size >= size and ours:
                    self.latest, self._latest_size = note, last.size
                    await self._observed(last.size)
                    return note
                # (a rotated key signs the tree at once, even if it did not grow)
                if last.size > size or self._log.tree.root(last.size) != last.root:
                    raise LogCorrupt(
                        last.size,
                        f"the log's first {last.size} records no longer match the last "
                        "signed checkpoint: refusing to sign a new one",
                    )
            note = await self._sign(size)
            await asyncio.to_thread(self._store, note, size)
            self.latest, self._latest_size = note, size
            await self._observed(size)
            return note

    async def _observed(self, size: int) -> None:
        """The metrics of the newest checkpoint: its size, and its file's time (what the
        console's health page calls its age)."""
        if self._metrics is None:
            return
        path = checkpoint_paths(self._log.path)[0]
        written = await asyncio.to_thread(_modified, path)
        self._metrics.checkpoint_published(size, written)

    def _ours(self, note: str) -> bool:
        """Whether ``note`` is signed by this publisher's key (after a key rotation the last
        checkpoint is the old key's: the new key signs the same tree at once)."""
        try:
            NoteVerifier.parse(self.verifier_key()).open(note)
        except NoteError:
            return False
        return True

    async def current(self) -> str | None:
        """The newest signed checkpoint of this replica's log (any worker's)."""
        previous = await asyncio.to_thread(self._read_latest)
        if previous is not None and previous[1].size >= self._latest_size:
            self.latest, self._latest_size = previous[0], previous[1].size
        return self.latest

    async def _sign(self, size: int) -> str:
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
        return note

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """``<log>.checkpoint.lock``, exclusively: one publisher of this log at a time."""
        if self._lock_fd is None:
            path = checkpoint_paths(self._log.path)[0]
            lock = path.with_name(path.name + ".lock")
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        fd = self._lock_fd
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _read_latest(self) -> tuple[str, Checkpoint] | None:
        """``<log>.checkpoint`` and its parsed body (our own file: its signature is ours)."""
        latest = checkpoint_paths(self._log.path)[0]
        try:
            note = latest.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return note, parse_checkpoint(note[: note.find("\n\n") + 1])
        except NoteError as exc:
            raise LogCorrupt(0, f"{latest} is not a checkpoint: {exc}") from exc

    def _store(self, note: str, size: int) -> None:
        latest, history = checkpoint_paths(self._log.path)
        temporary = latest.with_name(latest.name + ".tmp")
        temporary.write_text(note, encoding="utf-8")
        os.replace(temporary, latest)
        with history.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"size": size, "note": note}) + "\n")

    async def run(self) -> None:
        """Publish after new records (by any worker), at most every ``interval`` seconds."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.publish()
            except (OSError, UpstreamError, LogCorrupt):
                log.exception("checkpoint could not be signed or written")
                if self._metrics is not None:
                    self._metrics.checkpoint_failures.inc()


def _modified(path: Path) -> float | None:
    """``path``'s modification time (None when it cannot be read)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return None
