"""``broker audit …``: what an auditor runs. Exit 0: the answer is yes / the command did its job;
1: the log or proof does not verify; 2: bad usage or unreadable input."""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from broker.audit.mask import load_or_create_mask_key, mask_value
from broker.audit.publisher import checkpoint_paths
from broker.audit.records import LogCorrupt, verify_bytes
from broker.audit.segments import SEGMENT_SUFFIX, repair_torn_tail
from broker.audit.witness import WitnessKey
from broker.cli import audit_monitor as cli_audit_monitor
from broker.cli import audit_query as cli_audit_query
from broker.cli.audit_query import read_file as _read
from broker.cli.audit_query import record_lines as _lines
from broker.cli.audit_query import with_segments
from broker.config import load_settings
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.crypto.checkpoint import NoteError, NoteVerifier, parse_checkpoint
from broker.crypto.merkle import MerkleTree, leaf_hash, verify_inclusion
from broker.signers.checkpoint import close_checkpoint_signer, open_checkpoint_signer

EXIT_NO = 1
EXIT_USAGE = 2


def add_commands(audit: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    key = audit.add_parser(
        "key", help="print the note verifier key auditors pin (and create the mask key if absent)"
    )
    key.add_argument("--config", type=Path, required=True)
    key.set_defaults(run=_key)
    mask = audit.add_parser(
        "mask", help="what a guessed value reads as when masked in a record (needs the mask key)"
    )
    mask.add_argument("value", help="the value as JSON: '\"alice@example.com\"', 42, …")
    mask.add_argument("--config", type=Path, required=True)
    mask.set_defaults(run=_mask)
    verify = audit.add_parser(
        "verify",
        help="recompute the tree; check a signed checkpoint; several replicas' logs at once",
    )
    verify.add_argument(
        "logs",
        type=Path,
        nargs="+",
        metavar="LOG",
        help="a log (its segments are found), or its segments in order; several logs (one per "
        "replica) are each verified on their own",
    )
    verify.add_argument(
        "--checkpoint",
        type=Path,
        help="a signed checkpoint (note) to check (one log); with several logs and --key, each "
        "log's own <log>.checkpoint is checked",
    )
    verify.add_argument(
        "--key",
        action="append",
        default=[],
        help="the verifier key (<name>+<hash>+<key>); with several logs one per replica "
        "(repeatable: each log is checked with the key named after its checkpoint's origin)",
    )
    verify.add_argument("--head", help="a record hash known from earlier that must be present")
    verify.add_argument(
        "--witness-key",
        action="append",
        default=[],
        help="a witness's cosignature key; the checkpoint must be cosigned by each (repeatable)",
    )
    verify.set_defaults(run=_verify)
    repair = audit.add_parser("repair", help="cut a torn final record left by a crash")
    repair.add_argument("path", type=Path)
    repair.set_defaults(run=_repair)
    prove = audit.add_parser("prove", help="a self-contained inclusion proof bundle")
    prove.add_argument("record", metavar="DECISION_ID|INDEX")
    prove.add_argument("--log", type=Path, required=True)
    prove.add_argument("--checkpoint", type=Path, help="default: <log>.checkpoint")
    prove.set_defaults(run=_prove)
    check = audit.add_parser("check-proof", help="verify a proof bundle offline")
    check.add_argument("bundle", type=Path)
    check.add_argument("--key", required=True, help="the verifier key")
    check.set_defaults(run=_check_proof)
    cli_audit_query.add_parsers(audit)
    cli_audit_monitor.add_parser(audit)


def _mask(args: argparse.Namespace) -> int:
    """``hmac-sha256:…`` of a guessed value under this broker's mask key: compare it with a
    masked field of a record (docs/audit.md, "Masked values")."""
    settings = load_settings(args.config)
    try:
        value = json.loads(args.value)
    except ValueError as exc:
        raise ConfigError("VALUE", "is not JSON (quote a string: '\"alice\"')") from exc
    key = load_or_create_mask_key(_mask_key_path(settings))
    print(mask_value(value, key))
    return 0


def _mask_key_path(settings: Any) -> Path:
    return Path(settings.audit.mask_key or settings.audit.log.parent / "mask.key")


def _key(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    mask_key = _mask_key_path(settings)
    load_or_create_mask_key(mask_key)
    print(f"mask key: {mask_key} (keep it secret; never logged)", file=sys.stderr)

    async def verifier_key() -> str | None:
        signer = await open_checkpoint_signer(settings)
        try:
            return None if signer is None else signer.verifier_key()
        finally:
            await close_checkpoint_signer(signer)

    key = asyncio.run(verifier_key())
    if key is None:
        raise ConfigError("audit.signing_key", "is not set: this broker signs no checkpoints")
    print(key)
    return 0


def _tree(lines: list[bytes]) -> MerkleTree:
    return MerkleTree.from_lines(lines)


def _verify(args: argparse.Namespace) -> int:
    groups = group_logs(args.logs)
    if len(groups) == 1:
        key = key_for(groups[0][-1], args.key, args.checkpoint)
        note = _single_log_note(groups[0][-1], args.checkpoint, key)
        report = verify_log(
            groups[0], note=note, key=key, head=args.head, witness_keys=args.witness_key
        )
    else:
        if args.checkpoint is not None or args.head is not None:
            raise ConfigError(
                "--checkpoint",
                "names one log; with several logs use --key (each log's own "
                "checkpoint file is checked)",
            )
        report = verify_logs(groups, keys=args.key, witness_keys=args.witness_key)
    print(json.dumps(report))
    return 0 if report["ok"] else EXIT_NO


def key_for(log: Path, keys: Sequence[str], checkpoint: Path | None = None) -> str | None:
    """The verifier key a log is checked with: the only one given, or (one per replica) the one
    named after the origin of its checkpoint (``checkpoint``, else ``<log>.checkpoint``).

    Raises:
        ConfigError: ``--key`` when several are given and none is named after that origin.
    """
    if len(keys) <= 1:
        return keys[0] if keys else None
    path = checkpoint or checkpoint_paths(log)[0]
    note = _read(path, "checkpoint").decode("utf-8", "replace") if path.is_file() else ""
    try:
        origin = parse_checkpoint(note[: note.rfind("\n\n") + 1]).origin
    except NoteError:
        origin = None
    for key in keys:
        if key.split("+", 1)[0] == origin:
            return key
    raise ConfigError("--key", f"none of the keys is named after {log}'s origin ({origin})")


def _single_log_note(log: Path, checkpoint: Path | None, key: str | None) -> str | None:
    """The checkpoint one log is checked against: ``--checkpoint``, else with ``--key`` the log's
    own ``<log>.checkpoint``. A key with no checkpoint to check is refused: it would otherwise
    be ignored and any made-up key would read ``ok``.

    Raises:
        ConfigError: ``--key`` when there is nothing to check it against.
    """
    if checkpoint is not None:
        return _read(checkpoint, "--checkpoint").decode()
    if key is None:
        return None
    own = checkpoint_paths(log)[0]
    if not own.is_file():
        raise ConfigError(
            "--key",
            f"there is no checkpoint to check it against ({own} does not exist); pass "
            "--checkpoint FILE, or verify the chain alone without --key",
        )
    return _read(own, "checkpoint").decode()


def group_logs(paths: list[Path]) -> list[list[Path]]:
    """The named files grouped by log: ``<log>.000001`` belongs with ``<log>``; any other path is
    a log of its own (one replica's)."""
    groups: dict[Path, list[Path]] = {}
    for path in paths:
        match = SEGMENT_SUFFIX.search(path.name)
        base = path.with_name(path.name[: match.start()]) if match else path
        groups.setdefault(base, []).append(path)
    return list(groups.values())


def verify_logs(
    groups: list[list[Path]], *, keys: Sequence[str], witness_keys: Sequence[str] = ()
) -> dict[str, Any]:
    """Several replicas' logs: each is a chain and tree of its own, verified on its own (against
    its own latest checkpoint when ``key`` is given and the file exists). No two logs may come
    from the same replica (a copy of one log passed twice is not a second replica)."""
    reports = []
    replicas: dict[str, str] = {}
    ok = True
    for group in groups:
        log = group[-1]
        key = key_for(log, keys)
        note_path = checkpoint_paths(log)[0]
        note = _read(note_path, "checkpoint").decode() if key and note_path.is_file() else None
        report = {
            "log": str(log),
            **verify_log(group, note=note, key=key, witness_keys=witness_keys),
        }
        replica = report.get("replica")
        if isinstance(replica, str) and replica in replicas:
            report |= {"ok": False, "problem": f"same replica {replica!r} as {replicas[replica]}"}
        elif isinstance(replica, str):
            replicas[replica] = str(log)
        ok = ok and bool(report["ok"])
        reports.append(report)
    records = sum(int(r.get("records", 0)) for r in reports)
    return {"ok": ok, "logs": reports, "records": records}


def verify_log(
    logs: list[Path],
    *,
    note: str | None,
    key: str | None,
    head: str | None = None,
    witness_keys: Sequence[str] = (),
) -> dict[str, Any]:
    """What ``broker audit verify`` reports: recompute the tree; with a signed checkpoint,
    check its signature and that the log is consistent with it; without, check the chain."""
    data = b"".join(_read(path, "LOG") for path in with_segments(logs) or logs)
    report: dict[str, Any] = {"ok": True}
    collecting = gc.isenabled()
    gc.disable()  # a million fresh bytes objects, no cycles: collections would double the time
    try:
        lines = _lines(data)
        tree = _tree(lines)
        report |= {"records": tree.size, "root": base64.b64encode(tree.root()).decode()}
        report |= _replica(lines)
        if note is None:  # no checkpoint: the chain names the first changed record
            report["head"] = verify_bytes(data, expected_head=head).head.hash
            report |= _against_its_checkpoint_file(logs[-1], tree)
        else:
            report |= _against_checkpoint(logs[0], note, key, tree)
            report |= _cosigned(note, witness_keys)
    except LogCorrupt as exc:
        report = {"ok": False, "first_bad_index": exc.line - 1, "problem": exc.problem}
    finally:
        if collecting:
            gc.enable()
    return report


def _against_its_checkpoint_file(log: Path, tree: MerkleTree) -> dict[str, Any]:
    """A chain-only verify still compares the log with the checkpoint file beside it (size and
    root; its signature cannot be checked without the key, so this can only fail a log, never
    pass one): a log shorter than a checkpoint the broker published was truncated, and one whose
    first records no longer hash to that checkpoint's root was rewritten, however well its chain
    was recomputed. The records before the first checkpoint (of ``<log>.checkpoints``) the log
    still matches are intact; the first changed one is named as closely as those allow.

    Raises:
        LogCorrupt: when the checkpoint file states a larger tree or another root.
    """
    note_path = checkpoint_paths(log)[0]
    if not note_path.is_file():
        return {}
    note = _read(note_path, "checkpoint").decode("utf-8", "replace")
    try:
        stated = parse_checkpoint(note[: note.rfind("\n\n") + 1])
    except NoteError:
        return {"checkpoint_file": "unreadable (not checked: pass --key to verify it)"}
    unsigned = "signature not checked without --key"
    if stated.size > tree.size:
        raise LogCorrupt(
            tree.size + 1,
            f"log truncated: its checkpoint file ({note_path.name}, {unsigned}) covers "
            f"{stated.size} records, the log has {tree.size}",
        )
    if tree.root(stated.size) != stated.root:
        good, bad = _bracket(log, None, tree, below=stated.size)
        raise LogCorrupt(
            good + 1,
            f"the log's first {stated.size} records do not hash to the root of its checkpoint "
            f"file ({note_path.name}, {unsigned}): {_which_changed(good, bad)}",
        )
    return {"checkpoint_file_size": stated.size}


def _which_changed(good: int, bad: int) -> str:
    """Records ``[0, good)`` match a checkpoint, ``[0, bad)`` do not: say which changed."""
    if bad == good + 1:
        intact = f" (records 0..{good - 1} are intact)" if good else ""
        return f"record {good} was changed, removed or moved{intact}"
    return (
        f"the first changed record is one of records {good}..{bad - 1} (records before "
        f"{good} are intact; checkpoints were published at no size in between)"
    )


def _replica(lines: list[bytes]) -> dict[str, Any]:
    """The replica named by the log's records (first and last are read; records of one log
    carry one replica id, and the chain check covers the rest)."""
    names = set()
    for line in (lines[:1] + lines[-1:]) if lines else []:
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise LogCorrupt(1, "not valid JSON") from exc
        if isinstance(record, dict) and isinstance(record.get("replica"), str):
            names.add(record["replica"])
    return {"replica": names.pop()} if len(names) == 1 else {}


def _against_checkpoint(log: Path, note: str, key: str | None, tree: MerkleTree) -> dict[str, Any]:
    if key is None:
        raise ConfigError("--key", "checking a checkpoint needs the verifier key")
    try:
        verifier = NoteVerifier.parse(key)
        checkpoint = parse_checkpoint(verifier.open(note), origin=verifier.name)
    except NoteError as exc:
        raise LogCorrupt(1, f"the checkpoint does not verify: {exc}") from exc
    if checkpoint.size > tree.size:
        raise LogCorrupt(
            tree.size + 1,
            f"log truncated: the checkpoint covers {checkpoint.size} records, the log has "
            f"{tree.size}",
        )
    if tree.root(checkpoint.size) != checkpoint.root:
        good, bad = _bracket(log, verifier, tree, below=checkpoint.size)
        raise LogCorrupt(
            good + 1,
            f"records below {checkpoint.size} were changed, removed or reordered: the log's "
            f"root differs from the checkpoint's; {_which_changed(good, bad)}",
        )
    return {"checkpoint_size": checkpoint.size}


def _cosigned(note: str, witness_keys: Sequence[str]) -> dict[str, Any]:
    body = note[: note.rfind("\n\n") + 1]
    names = []
    for text in witness_keys:
        try:
            witness = WitnessKey.parse(text)
        except NoteError as exc:
            raise ConfigError("--witness-key", str(exc)) from exc
        if not witness.cosigned(note, body):
            raise LogCorrupt(1, f"the checkpoint is not cosigned by witness {witness.name}")
        names.append(witness.name)
    return {"witnesses": names} if names else {}


def _bracket(
    log: Path, verifier: NoteVerifier | None, tree: MerkleTree, *, below: int
) -> tuple[int, int]:
    """From the log's checkpoint history (``<log>.checkpoints``; each note verified when a
    ``verifier`` is given): the largest size whose root the log still has, and the smallest
    larger one whose root it no longer has (at most ``below``). A tree that matches at a size
    has its records up to that size intact, so the first changed record lies between them."""
    _, history = checkpoint_paths(log)
    stated: dict[int, bytes] = {}
    if history.is_file():
        for line in history.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                note = str(json.loads(line)["note"])
                body = verifier.open(note) if verifier else note[: note.rfind("\n\n") + 1]
                checkpoint = parse_checkpoint(body, origin=verifier.name if verifier else None)
            except (ValueError, KeyError, TypeError, NoteError):
                continue
            if 0 < checkpoint.size < below:
                stated[checkpoint.size] = checkpoint.root
    good = max((n for n, root in stated.items() if tree.root(n) == root), default=0)
    bad = min((n for n, root in stated.items() if n > good and tree.root(n) != root), default=below)
    return good, bad


def _repair(args: argparse.Namespace) -> int:
    try:
        report = repair_torn_tail(args.path, now=datetime.now(UTC).isoformat())
    except OSError as exc:
        print(f"error: cannot repair {args.path}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except LogCorrupt as exc:
        print(json.dumps({"repaired": False, "first_bad_record": exc.line, "problem": exc.problem}))
        return EXIT_NO
    if report is None:
        print(json.dumps({"repaired": False, "problem": None}))
        return 0
    result = {
        "repaired": True,
        "removed_bytes": report.removed_bytes,
        "removed_sha256": report.removed_sha256,
        "records": report.head.size,
    }
    print(json.dumps(result))
    return 0


def _prove(args: argparse.Namespace) -> int:
    lines = _lines(
        b"".join(_read(path, "--log") for path in with_segments([args.log]) or [args.log])
    )
    note_path = args.checkpoint or checkpoint_paths(args.log)[0]
    note = _read(note_path, "--checkpoint").decode()
    body = note[: note.rfind("\n\n") + 1]
    checkpoint = parse_checkpoint(body)
    index = _find(lines, args.record, limit=checkpoint.size)
    tree = _tree(lines[: checkpoint.size])
    bundle = {
        "record": lines[index].decode("utf-8"),
        "index": index,
        "tree_size": checkpoint.size,
        "hashes": [
            base64.b64encode(h).decode() for h in tree.inclusion_proof(index, checkpoint.size)
        ],
        "checkpoint": note,
    }
    print(json.dumps(bundle, indent=2))
    return 0


def _find(lines: list[bytes], wanted: str, *, limit: int) -> int:
    if wanted.isdigit():
        index = int(wanted)
        if index >= limit:
            raise ConfigError("INDEX", f"record {index} is not covered by the checkpoint ({limit})")
        return index
    needle = f'"decision_id":"{wanted}"'.encode()
    for index, line in enumerate(lines[:limit]):
        if needle in line:
            return index
    raise ConfigError("DECISION_ID", f"no record {wanted} among the {limit} the checkpoint covers")


def _check_proof(args: argparse.Namespace) -> int:
    try:
        bundle = loads_bounded(_read(args.bundle, "BUNDLE"))
        verifier = NoteVerifier.parse(args.key)
        checkpoint = parse_checkpoint(verifier.open(bundle["checkpoint"]), origin=verifier.name)
        hashes = [base64.b64decode(h, validate=True) for h in bundle["hashes"]]
        record = str(bundle["record"]).encode("utf-8")
        index, size = int(bundle["index"]), int(bundle["tree_size"])
    except (ValueError, KeyError, TypeError, NoteError) as exc:
        print(json.dumps({"ok": False, "problem": f"unusable bundle or checkpoint: {exc}"}))
        return EXIT_NO
    problem = None
    if size != checkpoint.size:
        problem = (
            f"the proof is for a tree of {size} records; the checkpoint's has {checkpoint.size}"
        )
    elif not verify_inclusion(leaf_hash(record), index, size, hashes, checkpoint.root):
        problem = (
            f"the record is not leaf {index} of the checkpoint's tree: it was changed, or the "
            "proof is for another record"
        )
    answer = {"ok": problem is None, "index": index, "tree_size": size, "origin": checkpoint.origin}
    print(json.dumps(answer if problem is None else {**answer, "problem": problem}))
    return 0 if problem is None else EXIT_NO
