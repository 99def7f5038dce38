"""Watch rules, run: what an auditor wants to hear about as soon as the log shows it (issue 34).

rekor-monitor's habit, for the decision log: the rules of a small TOML file
(``audit/watch_rules.py``) that ``broker audit monitor --rules FILE`` runs, on each run, over
the records it has not seen yet and has checked against a signed checkpoint (docs/audit.md,
"Watch rules").

A release is a key a record decided ``allow`` (``envelope.RELEASING``: a runner's ``release``,
each key of an ``attested_release``, a KBS guest's ``kbs_resource``); its image is the
record's ``identity.image_digest`` and its recipient the record's ``runner_key_thumbprint``.
What a rule cannot read counts against the release (fail closed): a released key without an
image digest (a KBS guest of raw TDX or SEV-SNP evidence has none) is not in any list, a
release without a readable time is outside every hour, a line that is not a record is a hit
of its own.
A refused decision is one a record decided ``deny`` (each key of a release, an attestation as
a whole). A ``recipients`` rule reports once per window and key, a ``deny_rate`` rule once per
window: after a hit it is quiet until ``window_seconds`` have passed. Their recent recipients
and refusals are the only state rules keep between runs (``Watch.windows``, saved by the
monitor).

Pure: records in (``parse_record``), hits out; no I/O, no clock (record times only).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any

from broker.audit.envelope import (
    RELEASING,
    Envelope,
    KeyDecision,
    RecordError,
    instant,
    parse_record,
)
from broker.audit.outcomes import ALLOW, DENY
from broker.audit.watch_rules import (
    KIND_OF,
    MAX_TRACKED,
    DenyRate,
    KeyImages,
    Recipients,
    RecordOfType,
    ReleaseHours,
    Rule,
    Windowed,
    describe,
)

UNREADABLE = "unreadable_record"  # the kind of a hit no rule made: a line that is not a record


@dataclass(frozen=True)
class Hit:
    """One record a rule reports (``index``: its leaf index in the log)."""

    rule: str
    kind: str
    index: int
    type: str
    time: str | None
    decision_id: str | None
    key: str | None
    image: str | None
    detail: str

    def as_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class Watch:
    """The rules, run over records in log order. ``windows`` (the recipients rules' recent
    recipients and quiet times, JSON) carries over to the next run."""

    def __init__(self, rules: tuple[Rule, ...], windows: Mapping[str, Any] | None = None) -> None:
        self._rules = rules
        self._windows: dict[str, dict[str, _Window]] = {
            rule.name: _windows_of(rule, (windows or {}).get(rule.name))
            for rule in rules
            if isinstance(rule, Windowed)
        }

    @property
    def windows(self) -> dict[str, Any]:
        return {
            name: {key: window.as_json() for key, window in sorted(by_key.items())}
            for name, by_key in self._windows.items()
        }

    def check(self, index: int, line: bytes) -> list[Hit]:
        """The hits of record ``index`` (its stored line)."""
        try:
            record = parse_record(line)
        except RecordError as exc:
            return [Hit("", UNREADABLE, index, "", None, None, None, None, str(exc))]
        hits: list[Hit] = []
        for rule in self._rules:
            if isinstance(rule, RecordOfType):
                if rule.type == record.kind.value and rule.result in (None, record.outcome):
                    hits.append(_hit(rule, index, record, None, f"a {record.type} record"))
                continue
            if isinstance(rule, DenyRate):
                hits.extend(self._refused(rule, index, record))
                continue
            for released in _released(record):
                problem = self._released(rule, record, released)
                if problem is not None:
                    hits.append(_hit(rule, index, record, released, problem))
        return hits

    def _released(self, rule: Rule, record: Envelope, released: KeyDecision) -> str | None:
        key = released.key or ""
        image = record.identity.get("image_digest")
        if isinstance(rule, KeyImages) and fnmatchcase(key, rule.key) and image not in rule.images:
            return f"{key} released to image {image or '(none recorded)'}, not in the list"
        if isinstance(rule, ReleaseHours) and (
            not rule.keys or any(fnmatchcase(key, k) for k in rule.keys)
        ):
            if record.at is None:
                return f"{key} released at an unreadable time ({record.time!r})"
            if not rule.inside(record.at):
                return f"{key} released at {record.at.isoformat()}, outside {describe(rule)}"
        if isinstance(rule, Recipients) and fnmatchcase(key, rule.key) and record.at is not None:
            window = self._windows[rule.name].setdefault(key, _Window({}, None))
            return window.count(rule, record.at, _recipient(record))
        return None

    def _refused(self, rule: DenyRate, index: int, record: Envelope) -> Iterator[Hit]:
        """A hit when this record's refusals take the rule's window past its ``max``."""
        if record.at is None:
            return
        window = self._windows[rule.name].setdefault("", _Window({}, None))
        for n, decision in enumerate(record.decisions):
            if decision.result != DENY:
                continue
            if rule.keys and not any(fnmatchcase(decision.key or "", k) for k in rule.keys):
                continue
            problem = window.count(rule, record.at, f"{index}/{n}", "refused decisions")
            if problem is not None:
                yield _hit(rule, index, record, decision, problem)


@dataclass
class _Window:
    """One window of a windowed rule: a key's recent recipients (``recipients``), or the recent
    refusals (``deny_rate``). Each entry expires through a heap of (time, entry): a record costs
    O(log n), whatever the window holds (at most ``MAX_TRACKED``, the newest)."""

    seen: dict[str, datetime]  # recipient thumbprint (or refusal) -> its latest time
    quiet_until: datetime | None  # after a hit: no other one before this
    _expiry: list[tuple[datetime, str]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._expiry = [(t, r) for r, t in self.seen.items()]
        heapq.heapify(self._expiry)

    def count(
        self, rule: Windowed, at: datetime, recipient: str, what: str = "distinct recipient keys"
    ) -> str | None:
        latest = max(at, self.seen.get(recipient, at))
        self.seen[recipient] = latest
        heapq.heappush(self._expiry, (latest, recipient))
        oldest = at - rule.window
        while self._expiry and (self._expiry[0][0] <= oldest or len(self.seen) > MAX_TRACKED):
            when, entry = heapq.heappop(self._expiry)
            if self.seen.get(entry) == when:  # else an older time of an entry seen since
                del self.seen[entry]
        if len(self._expiry) > 2 * len(self.seen) + 64:  # drop the older times of entries
            self.__post_init__()
        if len(self.seen) <= rule.max or (self.quiet_until is not None and at < self.quiet_until):
            return None
        self.quiet_until = at + rule.window
        verb = "released to " if isinstance(rule, Recipients) else ""
        seconds = int(rule.window.total_seconds())
        return f"{verb}{len(self.seen)} {what} within {seconds} s (at most {rule.max})"

    def as_json(self) -> dict[str, Any]:
        return {
            "seen": {r: t.isoformat() for r, t in sorted(self.seen.items())},
            "quiet_until": None if self.quiet_until is None else self.quiet_until.isoformat(),
        }


def _windows_of(rule: Windowed, saved: Any) -> dict[str, _Window]:
    """A rule's windows as saved (an entry that does not read is dropped: the monitor's own
    state, so at worst a window restarts empty)."""
    windows: dict[str, _Window] = {}
    if not isinstance(saved, Mapping):
        return windows
    for key, entry in saved.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("seen"), Mapping):
            continue
        seen = {str(r): at for r, t in entry["seen"].items() if (at := instant(t)) is not None}
        windows[str(key)] = _Window(seen, instant(entry.get("quiet_until")))
    return windows


def _released(record: Envelope) -> Iterator[KeyDecision]:
    """The keys a record released (decided ``allow``)."""
    if record.kind in RELEASING:
        yield from (k for k in record.keys if k.decided and k.result == ALLOW)


def _recipient(record: Envelope) -> str:
    thumbprint = record.body.get("runner_key_thumbprint")
    return thumbprint if isinstance(thumbprint, str) else "(none recorded)"


def _hit(
    rule: Rule, index: int, record: Envelope, released: KeyDecision | None, detail: str
) -> Hit:
    image = record.identity.get("image_digest")
    return Hit(
        rule=rule.name,
        kind=KIND_OF[type(rule)],
        index=index,
        type=record.type,
        time=record.time,
        decision_id=record.uid,
        key=released.key if released is not None else record.key,
        image=image if isinstance(image, str) else None,
        detail=detail,
    )
