"""``broker audit monitor``: check each log's newest checkpoint against the last one seen.

Run it from cron (or a CI schedule) with a state file of its own. Each replica keeps its own log
under its own origin; the monitor follows a list of logs, one pinned key per log (the key's name
is the log's origin), through any number of sources::

    broker audit monitor --state monitor.json --key "$KEY_0" --key "$KEY_1" https://broker.example
    broker audit monitor --state monitor.json decisions-0.log decisions-1.log   # logs on disk

Through a load balancer every replica's log is asked for by its origin (``?origin=``; any
replica answers for all of them). For each log, each run fetches the newest signed checkpoint,
verifies its signature with the pinned key, and proves that the tree the previous run saw is a
prefix of the new one (a consistency proof). Only then is that log's state replaced (the file
atomically). A log that shrank, a root that changed at the same size, a bad signature or a proof
that does not verify is an inconsistency: its state is kept, the answer says what broke, and the
exit code is 1. A log that cannot be read is exit 3 (nothing was checked). The first run pins
the keys; later runs refuse another key for a log already followed.

A rotated log key is followed only through a hand-over note signed by the pinned key and naming
the new one (``broker.audit.handover``, served with ``GET /v1/log/key``); the answer names both
keys and the state pins the new one. An old key that signed past its hand-over is a fork.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from broker.audit.handover import Handover, follow_handovers
from broker.audit.identity import read_handovers
from broker.audit.publisher import checkpoint_paths
from broker.audit.segments import log_files
from broker.config import is_loopback
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.crypto.checkpoint import Checkpoint, NoteError, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import MerkleTree, verify_consistency

EXIT_INCONSISTENT = 1
EXIT_UNREACHABLE = 3
MAX_ANSWER_BYTES = 1024 * 1024
STATE_VERSION = 2  # one entry per origin (version 1: a single log, read and carried over)


class Unreachable(Exception):
    """The log could not be read; nothing was checked."""


class Inconsistent(Exception):
    """The log contradicts what was seen before (or its checkpoint is not genuine)."""


def add_parser(audit: Any) -> None:
    monitor = audit.add_parser(
        "monitor", help="check each log's newest checkpoint against the last one seen (cron)"
    )
    monitor.add_argument(
        "source",
        nargs="+",
        metavar="URL-or-LOG",
        help="https://broker (every replica's log, by origin) or log files (one per replica)",
    )
    monitor.add_argument("--state", type=Path, required=True, help="this monitor's state file")
    monitor.add_argument(
        "--key",
        action="append",
        default=[],
        help="a log's note verifier key (its name is the log's origin); one per log to follow, "
        "repeatable; required for a log on its first run",
    )
    monitor.add_argument("--ca", type=Path, help="the CA that signs the broker's TLS certificate")
    monitor.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    monitor.set_defaults(run=run)


@dataclass(frozen=True)
class Seen:
    verifier_key: str
    size: int
    root: bytes
    note: str


@dataclass(frozen=True)
class Followed:
    """One log's outcome: its report, its exit code, and its new state (None: keep the old)."""

    report: dict[str, Any]
    code: int
    seen: Seen | None


def run(args: argparse.Namespace) -> int:
    previous = _load_state(args.state)
    keys = _keys(args.key, previous)
    sources = [_source(text, args) for text in args.source]
    outcomes = [_follow(origin, key, previous.get(origin), sources) for origin, key in keys.items()]
    state = dict(previous)
    for origin, outcome in zip(keys, outcomes, strict=True):
        if outcome.seen is not None:
            state[origin] = outcome.seen
    if any(outcome.seen is not None for outcome in outcomes):
        _save_state(args.state, state)
    codes = {outcome.code for outcome in outcomes}
    code = EXIT_INCONSISTENT if EXIT_INCONSISTENT in codes else max(codes)
    if len(outcomes) == 1:
        print(json.dumps(outcomes[0].report))
    else:
        reports = [outcome.report for outcome in outcomes]
        print(json.dumps({"ok": code == 0, "logs": reports}))
    return code


def _keys(given: list[str], previous: dict[str, Seen]) -> dict[str, str]:
    """The logs to follow (origin → pinned key): those in the state, and new ones given.

    Raises:
        ConfigError: ``--key`` missing on the first run, two keys for one log, or a key other
            than the one pinned for that log.
    """
    keys = {origin: seen.verifier_key for origin, seen in previous.items()}
    named: set[str] = set()
    for text in given:
        origin = _verifier(text).name
        if origin in named:
            raise ConfigError("--key", f"two keys for the log of origin {origin!r}")
        named.add(origin)
        if origin in keys and keys[origin] != text.strip():
            raise ConfigError("--key", "differs from the key this monitor pinned on its first run")
        keys[origin] = text.strip()
    if not keys:
        raise ConfigError("--key", "the first run pins the log's verifier key: give it")
    return keys


def _verifier(key: str) -> NoteVerifier:
    try:
        return NoteVerifier.parse(key)
    except NoteError as exc:
        raise ConfigError("--key", str(exc)) from exc


def _follow(origin: str, key: str, previous: Seen | None, sources: list[_Source]) -> Followed:
    """Check one log in the first source that holds it."""
    problem = f"no source holds the log of origin {origin!r}"
    for source in sources:
        if not source.holds(origin):
            continue
        try:
            return _check(origin, key, previous, source)
        except Unreachable as exc:
            problem = str(exc)
        except Inconsistent as exc:
            report = {"ok": False, "checked": True, "origin": origin, "problem": str(exc)}
            return Followed(report, EXIT_INCONSISTENT, None)
    report = {"ok": False, "checked": False, "origin": origin, "problem": problem}
    return Followed(report, EXIT_UNREACHABLE, None)


def _check(origin: str, key: str, previous: Seen | None, source: _Source) -> Followed:
    note = source.checkpoint(origin)
    rotations: list[Handover] = []
    try:
        checkpoint = _open(NoteVerifier.parse(key), note)
    except Inconsistent:
        rotations = follow_handovers(key, source.handovers(origin))
        if not rotations:
            raise
        checkpoint = _open(NoteVerifier.parse(rotations[-1].new_key), note)
        if previous is not None and previous.size > rotations[0].size:
            raise Inconsistent(
                f"the old key signed a tree of {previous.size} records, past its hand-over at "
                f"{rotations[0].size}: two histories under one origin"
            ) from None
    if previous is not None:
        _check_consistent(previous, checkpoint, lambda a, b: source.consistency(origin, a, b))
    report: dict[str, Any] = {
        "ok": True,
        "origin": checkpoint.origin,
        "size": checkpoint.size,
        "previous_size": None if previous is None else previous.size,
        "root": base64.b64encode(checkpoint.root).decode(),
    }
    if rotations:
        report["key_rotated"] = [
            {"old_key": step.old_key, "new_key": step.new_key, "at_size": step.size}
            for step in rotations
        ]
    pinned = rotations[-1].new_key if rotations else key
    return Followed(report, 0, Seen(pinned, checkpoint.size, checkpoint.root, note))


def _open(verifier: NoteVerifier, note: str) -> Checkpoint:
    try:
        return parse_checkpoint(verifier.open(note), origin=verifier.name)
    except NoteError as exc:
        raise Inconsistent(f"the checkpoint is not signed by the pinned key: {exc}") from exc


def _check_consistent(previous: Seen, new: Checkpoint, proof_of: Any) -> None:
    if new.size < previous.size:
        raise Inconsistent(f"the log shrank: {new.size} records, {previous.size} seen before")
    if new.size == previous.size:
        if new.root != previous.root:
            raise Inconsistent(f"the tree of {new.size} records has another root than before")
        return
    if previous.size == 0:
        return  # every tree extends the empty one
    proof = proof_of(previous.size, new.size)
    if not verify_consistency(previous.size, new.size, previous.root, new.root, proof):
        raise Inconsistent(
            f"the tree of {new.size} records does not extend the {previous.size} seen before "
            "(records were changed or removed)"
        )


class _Source(Protocol):
    """Where the monitor reads logs: a broker's public API, or a log on this machine."""

    def holds(self, origin: str) -> bool: ...

    def checkpoint(self, origin: str) -> str: ...

    def consistency(self, origin: str, first: int, second: int) -> list[bytes]: ...

    def handovers(self, origin: str) -> list[str]: ...


class _Broker:
    """A broker's public audit API over HTTPS (loopback HTTP for development); every replica
    behind it answers for every replica's log, asked for by its origin."""

    def __init__(self, url: str, ca: Path | None, timeout: float) -> None:
        self._url = url.rstrip("/")
        self._context = ssl.create_default_context(cafile=str(ca) if ca else None)
        self._timeout = timeout

    def holds(self, origin: str) -> bool:
        return True

    def _get(self, path: str, origin: str) -> bytes:
        query = ("&" if "?" in path else "?") + "origin=" + quote(origin, safe="")
        try:
            with urllib.request.urlopen(  # noqa: S310 - the URL's scheme is checked in _source
                self._url + path + query, context=self._context, timeout=self._timeout
            ) as response:
                return bytes(response.read(MAX_ANSWER_BYTES))
        except urllib.error.HTTPError as exc:
            raise Unreachable(f"GET {path.split('?', 1)[0]}: HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise Unreachable(f"{self._url} cannot be reached: {exc}") from exc

    def checkpoint(self, origin: str) -> str:
        return self._get("/v1/log/checkpoint", origin).decode("utf-8", "replace")

    def consistency(self, origin: str, first: int, second: int) -> list[bytes]:
        raw = self._get(f"/v1/log/proof/consistency?first={first}&second={second}", origin)
        try:
            return [base64.b64decode(h, validate=True) for h in loads_bounded(raw)["hashes"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise Inconsistent("the consistency proof is malformed") from exc

    def handovers(self, origin: str) -> list[str]:
        try:
            notes = loads_bounded(self._get("/v1/log/key", origin)).get("handovers", [])
        except (ValueError, AttributeError):
            return []
        return [str(note) for note in notes] if isinstance(notes, list) else []


class _LocalLog:
    """A log on this machine: its checkpoint file, and proofs computed from its records."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def holds(self, origin: str) -> bool:
        try:
            note = self.checkpoint(origin)
            return parse_checkpoint(note[: note.find("\n\n") + 1]).origin == origin
        except (Unreachable, NoteError):
            return True  # tried, so that what is wrong with it is said

    def checkpoint(self, origin: str) -> str:
        try:
            return checkpoint_paths(self._path)[0].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Unreachable(f"no checkpoint beside {self._path}: {exc}") from exc

    def consistency(self, origin: str, first: int, second: int) -> list[bytes]:
        try:
            data = b"".join(p.read_bytes() for p in log_files(self._path) if p.exists())
        except OSError as exc:
            raise Unreachable(f"{self._path}: {exc.strerror}") from exc
        lines = data.split(b"\n")[:-1]
        if len(lines) < second:
            raise Inconsistent(f"the log holds {len(lines)} records, its checkpoint {second}")
        tree = MerkleTree.from_lines(lines[:second])
        return tree.consistency_proof(first, second)

    def handovers(self, origin: str) -> list[str]:
        return read_handovers(self._path)


def _source(text: str, args: argparse.Namespace) -> _Source:
    """A broker URL (``https://``; ``http://`` only when its host is loopback, parsed as a URL:
    ``http://127.0.0.1@evil.example/`` and ``http://127.0.0.1.evil.example/`` are remote), or a
    log file.

    Raises:
        ConfigError: any other URL.
    """
    if "://" not in text:
        return _LocalLog(Path(text))
    try:
        parts = urlsplit(text)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - a malformed port raises here, not at the first request
    except ValueError as exc:
        raise ConfigError("URL-or-LOG", f"not a URL: {exc}") from exc
    plain_loopback = parts.scheme == "http" and is_loopback(host)
    if parts.username is not None or parts.password is not None or not host:
        raise ConfigError("URL-or-LOG", "a broker URL has a host and no user name or password")
    if parts.scheme != "https" and not plain_loopback:
        raise ConfigError("URL-or-LOG", "a broker URL is https:// (http:// only on loopback)")
    return _Broker(text, args.ca, args.timeout)


def _load_state(path: Path) -> dict[str, Seen]:
    """Each followed log's last good state, by origin (a version-1 state is one log's).

    Raises:
        ConfigError: ``--state`` that is not this monitor's state.
    """
    if not path.exists():
        return {}
    try:
        value = loads_bounded(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError("--state", f"{path} is not this monitor's state: {exc}") from exc
    if not isinstance(value, dict) or value.get("version") not in (1, STATE_VERSION):
        raise ConfigError("--state", f"{path} is not this monitor's state (version)")
    entries = [value] if value["version"] == 1 else list(value.get("logs", {}).values())
    try:
        seen = [
            Seen(
                verifier_key=str(entry["verifier_key"]),
                size=int(entry["size"]),
                root=base64.b64decode(entry["root"], validate=True),
                note=str(entry["checkpoint"]),
            )
            for entry in entries
        ]
        return {_verifier(entry.verifier_key).name: entry for entry in seen}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError("--state", f"{path} is not this monitor's state: {exc}") from exc


def _save_state(path: Path, state: dict[str, Seen]) -> None:
    """Replace the state atomically: a crash leaves the old state or the new, never half."""
    checked = datetime.now(UTC).isoformat()
    document = {
        "version": STATE_VERSION,
        "logs": {
            origin: {
                "verifier_key": seen.verifier_key,
                "size": seen.size,
                "root": base64.b64encode(seen.root).decode(),
                "checkpoint": seen.note,
                "checked_at": checked,
            }
            for origin, seen in sorted(state.items())
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=2)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:  # after the rename this names nothing; after a failure, the half-written copy
        Path(temporary).unlink(missing_ok=True)
    print(f"state: {path}", file=sys.stderr)
