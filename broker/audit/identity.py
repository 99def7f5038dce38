"""Which log a log file is: ``<log>.identity`` records the origin it was created with and the key
its checkpoints are signed by, so a replica never signs its log under another origin and never
changes its key silently.

At start-up, before anything is logged, ``claim_origin`` compares the configured origin with the
recorded one (a log created as ``…/broker-0`` is not continued as ``…/broker-1``: two replicas
would then sign one origin's checkpoints over different trees, which monitors and witnesses see
as a fork). ``adopt_signing_key`` then compares the checkpoint key: the same key, nothing to do;
the recorded key given as ``[audit] previous_signing_key``, a rotation (a hand-over note signed by
both keys, a ``log_key_rotation`` record, docs/audit.md); any other key, a refusal. The workers of
one replica share the files under ``<log>.identity.lock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from broker.audit.handover import Handover
from broker.audit.log import DecisionLog
from broker.core.errors import ConfigError
from broker.core.records import RecordType
from broker.crypto.checkpoint import (
    SIGNATURE_PREFIX,
    CheckpointSigner,
    NoteError,
    NoteVerifier,
    parse_checkpoint,
)

MAX_HANDOVERS_BYTES = 256 * 1024


def identity_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name + ".identity")


def _device(log_path: Path) -> bool:
    """A log that is not a regular file (a device, in the write-failure tests) has no identity
    files beside it."""
    return log_path.exists() and not log_path.is_file()


def _lock_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name + ".identity.lock")


def handovers_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name + ".key-handovers")


@dataclass(frozen=True)
class LogIdentity:
    origin: str
    replica: str
    verifier_key: str | None = None  # the key of the log's checkpoints (none signed yet)


def claim_origin(log_path: Path, *, origin: str, replica: str) -> LogIdentity:
    """The log's identity, created on first use; the configured origin must be its origin.
    A log without the file (older brokers) takes the origin of its checkpoint, if any.

    Raises:
        ConfigError: ``audit.origin`` when the log was created under another origin.
    """
    if _device(log_path):
        return LogIdentity(origin, replica)
    with _locked(log_path):
        identity = _read(log_path)
        if identity is None:
            identity = LogIdentity(_checkpoint_origin(log_path) or origin, replica)
        if identity.origin != origin:
            raise ConfigError(
                "audit.origin",
                f"{log_path} is the log of origin {identity.origin!r}, not {origin!r}: a log "
                "keeps its origin (each replica has its own log and origin; docs/audit.md)",
            )
        _write(log_path, identity)
        return identity


async def adopt_signing_key(
    decisions: DecisionLog,
    signer: CheckpointSigner,
    previous: CheckpointSigner | None,
    *,
    now: str,
) -> Handover | None:
    """Make ``signer`` the key of the log's checkpoints: nothing to do when it already is;
    hand over from ``previous`` when that is the recorded key (returned); refused otherwise.

    Raises:
        ConfigError: ``audit.signing_key`` for a key the log does not know how it came by.
        UpstreamError: the log or a signer failed (nothing is recorded as rotated).
    """
    current = signer.verifier_key()
    if await asyncio.to_thread(_device, decisions.path):
        return None
    async with _locked_async(decisions.path):
        identity = await asyncio.to_thread(_read, decisions.path)
        if identity is None:
            raise ConfigError("audit.origin", "the log's origin was not claimed first")
        known = identity.verifier_key or await asyncio.to_thread(
            _checkpoint_key, decisions.path, [current, *_keys(previous)]
        )
        if known in (None, current):
            await asyncio.to_thread(_write, decisions.path, replace(identity, verifier_key=current))
            return None
        if previous is None or previous.verifier_key() != known:
            raise ConfigError(
                "audit.signing_key",
                f"this log's checkpoints are signed by {known}; to rotate the key, give that "
                "key as [audit] previous_signing_key (docs/audit.md, 'Rotating the key')",
            )
        handover = await _hand_over(decisions, signer, previous, now=now)
        await asyncio.to_thread(_write, decisions.path, replace(identity, verifier_key=current))
        return handover


async def _hand_over(
    decisions: DecisionLog, signer: CheckpointSigner, previous: CheckpointSigner, *, now: str
) -> Handover:
    """Sign the hand-over with both keys, keep it beside the log, then record it in the log."""
    await decisions.refresh()
    handover = Handover(
        signer.name, previous.verifier_key(), signer.verifier_key(), decisions.committed_size
    )
    body = handover.body()
    note = await previous.sign_note(body)
    note += _signature_lines(await signer.sign_note(body))
    await asyncio.to_thread(_keep_handover, decisions.path, note)
    await decisions.append(
        {
            "type": RecordType.LOG_KEY_ROTATION,
            "time": now,
            "origin": handover.origin,
            "old_key": handover.old_key,
            "new_key": handover.new_key,
            "tree_size": handover.size,
            "handover": note,
        }
    )
    return handover


def read_handovers(log_path: Path) -> list[str]:
    """The hand-over notes kept beside the log, oldest first (none: the key never changed)."""
    path = handovers_path(log_path)
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_HANDOVERS_BYTES)
    except FileNotFoundError:
        return []
    notes = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            notes.append(str(json.loads(line)["note"]))
    return notes


def _keep_handover(log_path: Path, note: str) -> None:
    with handovers_path(log_path).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"note": note}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _signature_lines(note: str) -> str:
    return "".join(line + "\n" for line in note.splitlines() if line.startswith(SIGNATURE_PREFIX))


def _keys(signer: CheckpointSigner | None) -> list[str]:
    return [] if signer is None else [signer.verifier_key()]


def _checkpoint_text(log_path: Path) -> str | None:
    try:
        return log_path.with_name(log_path.name + ".checkpoint").read_text(encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def _checkpoint_origin(log_path: Path) -> str | None:
    note = _checkpoint_text(log_path)
    if note is None:
        return None
    try:
        return parse_checkpoint(note[: note.find("\n\n") + 1]).origin
    except NoteError:
        return None


def _checkpoint_key(log_path: Path, candidates: list[str]) -> str | None:
    """Which of ``candidates`` signed the log's checkpoint (a log from before identity files);
    ``None`` without a checkpoint.

    Raises:
        ConfigError: a checkpoint none of them signed.
    """
    note = _checkpoint_text(log_path)
    if note is None:
        return None
    for key in candidates:
        try:
            NoteVerifier.parse(key).open(note)
        except NoteError:
            continue
        return key
    raise ConfigError(
        "audit.signing_key",
        f"the log's checkpoint is signed by another key than {candidates[0]}; give that key "
        "as [audit] previous_signing_key to rotate (docs/audit.md, 'Rotating the key')",
    )


def _read(log_path: Path) -> LogIdentity | None:
    try:
        value = json.loads(identity_path(log_path).read_text(encoding="utf-8"))
        key = value.get("verifier_key")
        return LogIdentity(
            str(value["origin"]), str(value["replica"]), None if key is None else str(key)
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError("audit.log", f"{identity_path(log_path)} is damaged: {exc}") from exc


def _write(log_path: Path, identity: LogIdentity) -> None:
    if _read(log_path) == identity:
        return
    path = identity_path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    document = {
        "origin": identity.origin,
        "replica": identity.replica,
        "verifier_key": identity.verifier_key,
    }
    temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


@contextlib.contextmanager
def _locked(log_path: Path) -> Iterator[None]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(_lock_path(log_path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def _locked_async(log_path: Path) -> AsyncIterator[None]:
    fd = await asyncio.to_thread(os.open, _lock_path(log_path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
