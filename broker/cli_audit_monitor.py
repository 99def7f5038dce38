"""``broker audit monitor``: check a log's newest checkpoint against the last one seen.

Run it from cron (or a CI schedule) with a state file of its own::

    broker audit monitor --state monitor.json --key "$VKEY" https://broker.example:8443
    broker audit monitor --state monitor.json decisions.log        # a log on this machine

Each run fetches the newest signed checkpoint (``GET /v1/log/checkpoint``, or the log's own
checkpoint file), verifies its signature with the pinned key, and proves that the tree the
previous run saw is a prefix of the new one (a consistency proof: ``GET
/v1/log/proof/consistency``, or computed from the local log's records). Only then is the state
replaced (atomically). A log that shrank, a root that changed at the same size, a bad signature
or a proof that does not verify is an inconsistency: the state is kept, the answer says what
broke, and the exit code is 1. A broker that cannot be reached is exit 3 (nothing was checked).
The first run pins the key in the state; later runs refuse another one.
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

from broker.audit.publisher import checkpoint_paths
from broker.audit.segments import log_files
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.crypto.checkpoint import Checkpoint, NoteError, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import MerkleTree, verify_consistency

EXIT_INCONSISTENT = 1
EXIT_UNREACHABLE = 3
MAX_ANSWER_BYTES = 1024 * 1024
STATE_VERSION = 1


class Unreachable(Exception):
    """The log could not be read; nothing was checked."""


class Inconsistent(Exception):
    """The log contradicts what was seen before (or its checkpoint is not genuine)."""


def add_parser(audit: Any) -> None:
    monitor = audit.add_parser(
        "monitor", help="check the newest checkpoint against the last one seen (cron)"
    )
    monitor.add_argument("source", metavar="URL-or-LOG", help="https://broker or a log file")
    monitor.add_argument("--state", type=Path, required=True, help="this monitor's state file")
    monitor.add_argument("--key", help="the log's note verifier key (required on the first run)")
    monitor.add_argument("--ca", type=Path, help="the CA that signs the broker's TLS certificate")
    monitor.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    monitor.set_defaults(run=run)


@dataclass(frozen=True)
class Seen:
    verifier_key: str
    size: int
    root: bytes
    note: str


def run(args: argparse.Namespace) -> int:
    previous = _load_state(args.state)
    key = _pinned_key(args.key, previous)
    verifier = _verifier(key)
    source = _source(args)
    try:
        note = source.checkpoint()
        checkpoint = _open(verifier, note)
        if previous is not None:
            _check_consistent(previous, checkpoint, source)
    except Unreachable as exc:
        print(json.dumps({"ok": False, "checked": False, "problem": str(exc)}))
        return EXIT_UNREACHABLE
    except Inconsistent as exc:
        print(json.dumps({"ok": False, "checked": True, "problem": str(exc)}))
        return EXIT_INCONSISTENT
    _save_state(args.state, Seen(key, checkpoint.size, checkpoint.root, note))
    print(
        json.dumps(
            {
                "ok": True,
                "origin": checkpoint.origin,
                "size": checkpoint.size,
                "previous_size": None if previous is None else previous.size,
                "root": base64.b64encode(checkpoint.root).decode(),
            }
        )
    )
    return 0


def _pinned_key(given: str | None, previous: Seen | None) -> str:
    if previous is None:
        if given is None:
            raise ConfigError("--key", "the first run pins the log's verifier key: give it")
        return given
    if given is not None and given.strip() != previous.verifier_key:
        raise ConfigError("--key", "differs from the key this monitor pinned on its first run")
    return previous.verifier_key


def _verifier(key: str) -> NoteVerifier:
    try:
        return NoteVerifier.parse(key)
    except NoteError as exc:
        raise ConfigError("--key", str(exc)) from exc


def _open(verifier: NoteVerifier, note: str) -> Checkpoint:
    try:
        return parse_checkpoint(verifier.open(note), origin=verifier.name)
    except NoteError as exc:
        raise Inconsistent(f"the checkpoint is not signed by the pinned key: {exc}") from exc


def _check_consistent(previous: Seen, new: Checkpoint, source: _Source) -> None:
    if new.size < previous.size:
        raise Inconsistent(f"the log shrank: {new.size} records, {previous.size} seen before")
    if new.size == previous.size:
        if new.root != previous.root:
            raise Inconsistent(f"the tree of {new.size} records has another root than before")
        return
    if previous.size == 0:
        return  # every tree extends the empty one
    proof = source.consistency(previous.size, new.size)
    if not verify_consistency(previous.size, new.size, previous.root, new.root, proof):
        raise Inconsistent(
            f"the tree of {new.size} records does not extend the {previous.size} seen before "
            "(records were changed or removed)"
        )


class _Source(Protocol):
    """Where the monitor reads a log: a broker's public API, or a log on this machine."""

    def checkpoint(self) -> str: ...

    def consistency(self, first: int, second: int) -> list[bytes]: ...


class _Broker:
    """A broker's public audit API over HTTPS (loopback HTTP for development)."""

    def __init__(self, url: str, ca: Path | None, timeout: float) -> None:
        self._url = url.rstrip("/")
        self._context = ssl.create_default_context(cafile=str(ca) if ca else None)
        self._timeout = timeout

    def _get(self, path: str) -> bytes:
        try:
            with urllib.request.urlopen(  # noqa: S310 - the URL's scheme is checked in _source
                self._url + path, context=self._context, timeout=self._timeout
            ) as response:
                return bytes(response.read(MAX_ANSWER_BYTES))
        except urllib.error.HTTPError as exc:
            raise Unreachable(f"GET {path.split('?', 1)[0]}: HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise Unreachable(f"{self._url} cannot be reached: {exc}") from exc

    def checkpoint(self) -> str:
        return self._get("/v1/log/checkpoint").decode("utf-8", "replace")

    def consistency(self, first: int, second: int) -> list[bytes]:
        raw = self._get(f"/v1/log/proof/consistency?first={first}&second={second}")
        try:
            return [base64.b64decode(h, validate=True) for h in loads_bounded(raw)["hashes"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise Inconsistent("the consistency proof is malformed") from exc


class _LocalLog:
    """A log on this machine: its checkpoint file, and proofs computed from its records."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def checkpoint(self) -> str:
        try:
            return checkpoint_paths(self._path)[0].read_text(encoding="utf-8")
        except OSError as exc:
            raise Unreachable(f"no checkpoint beside {self._path}: {exc.strerror}") from exc

    def consistency(self, first: int, second: int) -> list[bytes]:
        try:
            data = b"".join(p.read_bytes() for p in log_files(self._path) if p.exists())
        except OSError as exc:
            raise Unreachable(f"{self._path}: {exc.strerror}") from exc
        lines = data.split(b"\n")[:-1]
        if len(lines) < second:
            raise Inconsistent(f"the log holds {len(lines)} records, its checkpoint {second}")
        tree = MerkleTree.from_lines(lines[:second])
        return tree.consistency_proof(first, second)


def _source(args: argparse.Namespace) -> _Source:
    text = str(args.source)
    if text.startswith(("https://", "http://127.0.0.1")):
        return _Broker(text, args.ca, args.timeout)
    if "://" in text:
        raise ConfigError("URL-or-LOG", "a broker URL is https:// (or http://127.0.0.1)")
    return _LocalLog(Path(text))


def _load_state(path: Path) -> Seen | None:
    if not path.exists():
        return None
    try:
        value = loads_bounded(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError("--state", f"{path} is not this monitor's state: {exc}") from exc
    if not isinstance(value, dict) or value.get("version") != STATE_VERSION:
        raise ConfigError("--state", f"{path} is not this monitor's state (version)")
    try:
        return Seen(
            verifier_key=str(value["verifier_key"]),
            size=int(value["size"]),
            root=base64.b64decode(value["root"], validate=True),
            note=str(value["checkpoint"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError("--state", f"{path} is not this monitor's state: {exc}") from exc


def _save_state(path: Path, seen: Seen) -> None:
    """Replace the state atomically: a crash leaves the old state or the new, never half."""
    document = {
        "version": STATE_VERSION,
        "verifier_key": seen.verifier_key,
        "size": seen.size,
        "root": base64.b64encode(seen.root).decode(),
        "checkpoint": seen.note,
        "checked_at": datetime.now(UTC).isoformat(),
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
