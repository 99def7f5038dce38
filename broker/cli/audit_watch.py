"""``broker audit monitor --rules FILE``: watch rules over the records not yet seen (issue 34).

The rules (``audit/watch.py``) run after a log's checkpoint verified, over the records from the
index up to which they last ran to the checkpoint's size, read from the log's source (a log on
disk, or ``GET /v1/log/entries`` with an auditor token, ``--token-file``). Those records are not
trusted: their leaf hashes, appended to the compact range the state keeps for that index
(``crypto/merkle.py``), must give the verified checkpoint's root, or nothing is reported and the
log is an inconsistency (exit 1). Then the state advances (per origin: the index, the compact
range, the recipients rules' windows), so a hit is reported once.

A hit prints one JSON line (``{"hit": true, "origin", "rule", "kind", "index", …}``), is sent
to the sink (``--sink URL``, or ``[audit] sink`` of ``--config``) as a structured event (syslog
MSGID ``watch``, severity warning; JSON lines to an HTTPS sink), is kept in the state's recent
hits (the console's Watch rules page reads them) and makes the exit code 4 (1 still wins).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from broker.audit.sink import WARNING, AuditSink
from broker.audit.watch import Hit, Watch
from broker.audit.watch_rules import KIND_OF, Rule, RulesError, describe, parse_rules
from broker.audit.watch_state import KEPT_HITS, LogWatch, watch_member
from broker.cli.audit_sources import Inconsistent, Source, Unreachable
from broker.config import load_settings
from broker.config.checks import SINK_FORMS, sink_allowed
from broker.core.errors import ConfigError, FileFormatError
from broker.core.metrics import Metrics
from broker.crypto.merkle import CompactRange, leaf_hash

if TYPE_CHECKING:
    from broker.cli.audit_monitor import Followed, Seen

EXIT_WATCH_HIT = 4
EXIT_UNREACHABLE = 3
EXIT_INCONSISTENT = 1
SINK_TIMEOUT_SECONDS = 10


def add_arguments(monitor: argparse.ArgumentParser) -> None:
    monitor.add_argument(
        "--rules",
        type=Path,
        help="a watch rules file (TOML, docs/audit.md): run over the records not yet seen; a "
        "hit exits 4",
    )
    monitor.add_argument(
        "--token-file",
        type=Path,
        help="with --rules and a broker URL: a file holding an auditor token (to read records)",
    )
    monitor.add_argument(
        "--sink", help="with --rules: syslog://HOST:PORT or https://… for each hit's event"
    )
    monitor.add_argument(
        "--config", type=Path, help="with --rules: a broker config whose [audit] sink gets hits"
    )


@dataclass
class WatchRun:
    """One monitor run's rules, their state as saved, and what this run found."""

    rules: tuple[Rule, ...]
    rules_file: Path
    sink: str | None
    saved: dict[str, Any]  # the state's "watch" member as the last run left it
    logs: dict[str, LogWatch] = field(default_factory=dict)
    hits: list[dict[str, Any]] = field(default_factory=list)

    def follow(self, origin: str, outcome: Followed) -> Followed:
        """Run the rules over the log ``outcome`` verified (none when it did not verify)."""
        source = outcome.source
        if outcome.seen is None or source is None:
            return outcome
        start = self._saved_log(origin)
        try:
            found, done = _run_rules(self.rules, start, source, origin, outcome.seen)
        except Inconsistent as exc:
            report = {**outcome.report, "ok": False, "problem": str(exc)}
            return replace(outcome, report=report, code=EXIT_INCONSISTENT)
        except Unreachable as exc:
            watch = {"checked": False, "from": start.index, "problem": str(exc)}
            return replace(
                outcome,
                report={**outcome.report, "watch": watch},
                code=max(outcome.code, EXIT_UNREACHABLE),
            )
        self.logs[origin] = done
        found_at = datetime.now(UTC).isoformat()
        self.hits.extend({"origin": origin, "found_at": found_at, **h.as_json()} for h in found)
        watch = {"checked": True, "from": start.index, "to": done.index, "hits": len(found)}
        code = EXIT_WATCH_HIT if found and outcome.code != EXIT_INCONSISTENT else outcome.code
        return replace(outcome, report={**outcome.report, "watch": watch}, code=code)

    def _saved_log(self, origin: str) -> LogWatch:
        """The saved progress over ``origin`` (a fresh start when absent or unreadable)."""
        logs = self.saved.get("logs")
        return LogWatch.of(logs.get(origin) if isinstance(logs, dict) else None)

    def document(self) -> dict[str, Any]:
        """The state's ``watch`` member after this run (what the console reads)."""
        logs = dict(self.saved.get("logs", {})) if isinstance(self.saved.get("logs"), dict) else {}
        logs.update({origin: done.as_json() for origin, done in self.logs.items()})
        kept = self.saved.get("hits") if isinstance(self.saved.get("hits"), list) else []
        return {
            "rules_file": str(self.rules_file.absolute()),
            "rules": [
                {"name": r.name, "kind": KIND_OF[type(r)], "watches": describe(r)}
                for r in self.rules
            ],
            "checked_at": datetime.now(UTC).isoformat(),
            "logs": logs,
            "hits": [*(kept or []), *self.hits][-KEPT_HITS:],
        }

    def emit(self) -> None:
        """Each hit of this run: a JSON line on stdout, an event to the sink (best effort: a
        sink that fails is said on stderr; the hit stays printed, kept and in the exit code)."""
        lines = [json.dumps({"hit": True, **hit}, sort_keys=True) for hit in self.hits]
        for line in lines:
            print(line)
        if self.sink is None or not lines:
            return
        events = [
            json.dumps({"event": "broker.watch_hit", **hit}, sort_keys=True).encode()
            for hit in self.hits
        ]
        try:
            asyncio.run(_deliver(self.sink, events))
        except (OSError, aiohttp.ClientError, TimeoutError) as exc:
            print(
                f"warning: sink {self.sink}: {len(events)} hit(s) not sent: {exc}", file=sys.stderr
            )


def prepare(args: argparse.Namespace, previous_state: Path) -> WatchRun | None:
    """The rules of ``--rules`` (none without it), before anything is fetched.

    Raises:
        ConfigError: a rules file that cannot be read or used (one line naming it and the
            rule), a sink URL refused, ``--sink``/``--config``/``--token-file`` without
            ``--rules``, or a broker URL without ``--token-file``.
    """
    if args.rules is None:
        flags = (
            ("--sink", args.sink),
            ("--config", args.config),
            ("--token-file", args.token_file),
        )
        for flag, value in flags:
            if value is not None:
                raise ConfigError(flag, "applies with --rules only")
        return None
    try:
        rules = parse_rules(args.rules.read_bytes())
    except OSError as exc:
        raise FileFormatError(args.rules, f"cannot be read: {exc.strerror}") from exc
    except RulesError as exc:
        raise FileFormatError(args.rules, str(exc), "fix the rule (docs/audit.md)") from exc
    if args.token_file is None and any("://" in text for text in args.source):
        raise ConfigError("--token-file", "--rules reads a broker's records: an auditor token")
    sink = args.sink
    if sink is None and args.config is not None:
        sink = load_settings(args.config).audit.sink
    if sink is not None and not sink_allowed(sink):
        raise ConfigError("--sink", SINK_FORMS)
    return WatchRun(rules, args.rules, sink, saved_member(previous_state))


def saved_member(path: Path) -> dict[str, Any]:
    """The ``watch`` member of a state file ({} when none; a run without ``--rules`` keeps it
    as it is)."""
    try:
        return watch_member(path.read_bytes())
    except OSError:
        return {}  # no state yet (an unreadable one is refused by the monitor itself)


def _run_rules(
    rules: tuple[Rule, ...], start: LogWatch, source: Source, origin: str, checkpoint: Seen
) -> tuple[list[Hit], LogWatch]:
    """The hits of records ``[start.index, seen.size)``, once their leaf hashes lead from the
    saved compact range to the verified checkpoint's root.

    Raises:
        Inconsistent: the records do not hash to the checkpoint's root (or the rules ran past
            the checkpoint before): nothing is reported.
        Unreachable: the records could not be read.
    """
    size, root = checkpoint.size, checkpoint.root
    if start.index > size:
        raise Inconsistent(
            f"the watch rules ran over {start.index} records; the checkpoint has {size}"
        )
    watch = Watch(rules, start.windows)
    frontier = CompactRange(start.index, start.frontier)
    hits: list[Hit] = []
    while frontier.size < size:
        for line in source.entries(origin, frontier.size, size):
            hits.extend(watch.check(frontier.size, line))
            frontier.append(leaf_hash(line))
    if frontier.root() != root:
        raise Inconsistent(
            f"the records {start.index}..{size} served do not hash to the signed checkpoint's "
            "root: no rule was run on them"
        )
    return hits, LogWatch(size, tuple(frontier.hashes), watch.windows)


async def _deliver(url: str, events: list[bytes]) -> None:
    timeout = aiohttp.ClientTimeout(total=SINK_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sink = AuditSink(url, session, Metrics())
        try:
            async with asyncio.timeout(SINK_TIMEOUT_SECONDS):
                await sink.deliver(events, event="watch", severity=WARNING)
        finally:
            sink.close()
