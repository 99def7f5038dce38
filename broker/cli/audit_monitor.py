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

With ``--broker-image`` (``cli/broker_pin.py``) a broker URL is trusted only once its attestation
verifies: before any log request, its image, its token and its TLS key are checked, its
certificate is pinned for every later request, and the key served at ``GET /v1/log/key`` must be
the attested checkpoint key (it is then pinned on a first run without ``--key``); the log the
broker answers for is its own (each replica at its own address), and every log key followed from
it, after hand-overs, must be the attested one. A refusal is exit 1 (``broker_not_attested``). An
attestation that binds no checkpoint key (one held in Cloud KMS) is refused unless
``--accept-unbound-log-key``: the log key is then only as good as the ``--key`` pinned by hand.

With ``--rules FILE`` (``cli/audit_watch.py``) watch rules run over each verified log's records
not yet seen, checked against the checkpoint's root; a hit is exit 4, a JSON line and an event
to the sink.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from broker.audit.handover import Handover, follow_handovers
from broker.cli import audit_watch
from broker.cli.audit_sources import Inconsistent, Source, Unreachable, open_source
from broker.cli.broker_pin import (
    BrokerUnreachable,
    add_broker_identity_arguments,
    broker_identity_from_args,
    not_attested_line,
)
from broker.cli.status import _bearer as bearer_from_token_file
from broker.client.broker_identity import BrokerNotAttested
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.crypto.checkpoint import Checkpoint, NoteError, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import verify_consistency

EXIT_INCONSISTENT = 1
EXIT_UNREACHABLE = 3
EXIT_WATCH_HIT = audit_watch.EXIT_WATCH_HIT  # --rules: a rule reported a record (1 wins)
STATE_VERSION = 2  # one entry per origin (version 1: a single log, read and carried over)


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
    add_broker_identity_arguments(monitor)
    monitor.add_argument(
        "--accept-unbound-log-key",
        action="store_true",
        help="with --broker-image: follow a broker whose attestation binds no checkpoint key "
        "(held in Cloud KMS); its log key is then checked only against --key",
    )
    audit_watch.add_arguments(monitor)
    monitor.set_defaults(run=run)


@dataclass(frozen=True)
class Seen:
    verifier_key: str
    size: int
    root: bytes
    note: str


@dataclass(frozen=True)
class Followed:
    """One log's outcome: its report, its exit code, its new state (None: keep the old), and
    the source that held it."""

    report: dict[str, Any]
    code: int
    seen: Seen | None
    source: Source | None = None


def run(args: argparse.Namespace) -> int:
    previous = _load_state(args.state)
    watch = audit_watch.prepare(args, args.state)  # the rules file is read before any request
    identity = broker_identity_from_args(args)
    if identity is not None and all("://" not in text for text in args.source):
        raise ConfigError("--broker-image", "pins a broker: give its https:// URL")
    if identity is None and args.accept_unbound_log_key:
        raise ConfigError("--accept-unbound-log-key", "applies with --broker-image only")
    try:
        sources = [
            open_source(
                text,
                ca=args.ca,
                timeout=args.timeout,
                identity=identity,
                accept_unbound=args.accept_unbound_log_key,
                headers=bearer_from_token_file(args),
            )
            for text in args.source
        ]
    except BrokerNotAttested as exc:
        problem = not_attested_line(exc)
        report = {"ok": False, "checked": True, "code": "broker_not_attested", "check": exc.check}
        print(json.dumps({**report, "problem": problem.removeprefix("error: ")}))
        print(problem, file=sys.stderr)
        return EXIT_INCONSISTENT
    except (BrokerUnreachable, OSError) as exc:  # OSError: urllib's URLError too
        print(json.dumps({"ok": False, "checked": False, "problem": str(exc)}))
        return EXIT_UNREACHABLE
    attested = [s.attested.log_key for s in sources if s.attested and s.attested.log_key]
    keys = _keys(args.key, previous, attested)
    outcomes = [_follow(origin, key, previous.get(origin), sources) for origin, key in keys.items()]
    if watch is not None:
        outcomes = [watch.follow(o, done) for o, done in zip(keys, outcomes, strict=True)]
    state = dict(previous)
    for origin, outcome in zip(keys, outcomes, strict=True):
        if outcome.seen is not None:
            state[origin] = outcome.seen
    if any(outcome.seen is not None for outcome in outcomes):
        kept = watch.document() if watch else audit_watch.saved_member(args.state)
        _save_state(args.state, state, kept)
    if watch is not None:
        watch.emit()  # a JSON line per hit, and the sink's events
    codes = {outcome.code for outcome in outcomes}
    code = next((c for c in (EXIT_INCONSISTENT, EXIT_WATCH_HIT) if c in codes), max(codes))
    if len(outcomes) == 1:
        print(json.dumps(outcomes[0].report))
    else:
        reports = [outcome.report for outcome in outcomes]
        print(json.dumps({"ok": all(r["ok"] for r in reports), "logs": reports}))
    return code


def _keys(given: list[str], previous: dict[str, Seen], attested: list[str]) -> dict[str, str]:
    """The logs to follow (origin → pinned key): those in the state, new ones given, and the
    attested brokers' logs not yet followed (their attested keys).

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
    for text in attested:
        keys.setdefault(_verifier(text).name, text)
    if not keys:
        raise ConfigError("--key", "the first run pins the log's verifier key: give it")
    return keys


def _verifier(key: str) -> NoteVerifier:
    try:
        return NoteVerifier.parse(key)
    except NoteError as exc:
        raise ConfigError("--key", str(exc)) from exc


def _follow(origin: str, key: str, previous: Seen | None, sources: list[Source]) -> Followed:
    """Check one log in the first source that holds it."""
    problem = f"no source holds the log of origin {origin!r}"
    if any(source.attested is not None for source in sources):
        problem += " (an attested broker answers for its own log: give each replica's address)"
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


def _check(origin: str, key: str, previous: Seen | None, source: Source) -> Followed:
    note = source.checkpoint(origin)
    rotations: list[Handover] = []
    try:
        checkpoint = _open(NoteVerifier.parse(key), note)
    except Inconsistent:
        rotations = follow_handovers(key, source.handovers(origin))
        if not rotations:
            if source.attested is not None:  # say so when the pinned key is not the attested
                source.attested.check(origin, key)
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
    if source.attested is not None:  # the key it was checked with is the attested one
        source.attested.check(origin, pinned)
        report["broker"] = source.attested.report()
    return Followed(report, 0, Seen(pinned, checkpoint.size, checkpoint.root, note), source)


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


def _save_state(path: Path, state: dict[str, Seen], watch: dict[str, Any]) -> None:
    """Replace the state atomically: a crash leaves the old state or the new, never half.
    ``watch``: the watch rules' progress and hits (``audit_watch``; {}: none)."""
    checked = datetime.now(UTC).isoformat()
    document: dict[str, Any] = {
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
    if watch:
        document["watch"] = watch
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
