"""The watch rules' part of a monitor's state file: one reading for its two readers.

``broker audit monitor --rules`` (``cli/audit_watch.py``) writes a ``watch`` member beside the
logs' checkpoints in its state file and reads it back on the next run (how far the rules ran
over each log, and the compact range that lets it check the next records against a signed
root); the console's Watch page (``console/watch.py``) shows the same member: the rules as the
monitor described them, how far it got, the newest hits. Both read it here. The file is the
monitor's own (written atomically by it): an entry that does not read is dropped, never
guessed at — a log's progress restarts from record 0, a hit is left out of the page.

Pure: bytes or JSON values in, typed values out.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.audit.envelope import instant
from broker.audit.watch import Hit
from broker.core.jsonsafe import loads_bounded
from broker.crypto.merkle import CompactRange

KEPT_HITS = 500  # the newest hits a state keeps (the console shows them)
MAX_STATE_BYTES = 64 * 1024 * 1024  # a state file read whole (its hits and windows are bounded)


@dataclass(frozen=True)
class LogWatch:
    """How far the rules ran over one log: ``index``, the compact range of ``[0, index)``, and
    the recipients rules' windows."""

    index: int = 0
    frontier: tuple[bytes, ...] = ()
    windows: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "frontier": [base64.b64encode(h).decode() for h in self.frontier],
            "windows": self.windows,
        }

    @classmethod
    def of(cls, entry: Any) -> LogWatch:
        """A log's saved progress (a fresh start when absent or unreadable)."""
        if not isinstance(entry, Mapping):
            return cls()
        try:
            frontier = tuple(base64.b64decode(h, validate=True) for h in entry["frontier"])
            index = entry["index"]
            if not isinstance(index, int) or isinstance(index, bool):
                return cls()
            CompactRange(index, frontier)  # hashes that fit the size
        except (KeyError, TypeError, ValueError):
            return cls()
        windows = entry.get("windows")
        return cls(index, frontier, dict(windows) if isinstance(windows, Mapping) else {})


def watch_member(raw: bytes) -> dict[str, Any]:
    """The ``watch`` member of a state file's bytes ({} when it has none or does not read)."""
    try:
        value = loads_bounded(raw)
    except ValueError:
        return {}
    watch = value.get("watch") if isinstance(value, dict) else None
    return watch if isinstance(watch, dict) else {}


@dataclass(frozen=True)
class SavedRule:
    name: str
    kind: str
    watches: str  # ``watch.describe`` at the time of the run


@dataclass(frozen=True)
class SavedHit:
    origin: str
    found_at: datetime | None
    hit: Hit


@dataclass(frozen=True)
class WatchView:
    """What the last run left: its rules, when it ran, each log's progress, the newest hits
    (newest first)."""

    rules_file: str | None
    checked_at: datetime | None
    rules: tuple[SavedRule, ...]
    logs: tuple[tuple[str, int], ...]  # origin, records the rules ran over
    hits: tuple[SavedHit, ...]


def watch_view(member: Mapping[str, Any]) -> WatchView:
    """``member`` (``watch_member``) as the console shows it."""
    rules = tuple(
        SavedRule(r["name"], r["kind"], r["watches"])
        for r in _list(member.get("rules"))
        if all(isinstance(r.get(name), str) for name in ("name", "kind", "watches"))
    )
    logs = member.get("logs")
    progress = tuple(
        (str(origin), LogWatch.of(entry).index)
        for origin, entry in sorted(logs.items() if isinstance(logs, Mapping) else [])
    )
    hits = tuple(saved for h in reversed(_list(member.get("hits"))) if (saved := _hit(h)))
    rules_file = member.get("rules_file")
    return WatchView(
        rules_file if isinstance(rules_file, str) else None,
        instant(member.get("checked_at")),
        rules,
        progress,
        hits[:KEPT_HITS],
    )


def _list(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _hit(saved: Mapping[str, Any]) -> SavedHit | None:
    """A saved hit (``Hit.as_json`` with its origin and when it was found); None when a member
    is missing or of another type."""
    index, origin = saved.get("index"), saved.get("origin")
    texts = [saved.get(name) for name in ("rule", "kind", "type", "detail")]
    optional = [saved.get(name) for name in ("time", "decision_id", "key", "image")]
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(origin, str):
        return None
    if not all(isinstance(v, str) for v in texts) or any(
        v is not None and not isinstance(v, str) for v in optional
    ):
        return None
    rule, kind, type_, detail = (str(v) for v in texts)
    time, decision_id, key, image = (None if v is None else str(v) for v in optional)
    hit = Hit(rule, kind, index, type_, time, decision_id, key, image, detail)
    return SavedHit(origin, instant(saved.get("found_at")), hit)
