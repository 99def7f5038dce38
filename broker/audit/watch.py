"""Watch rules: what an auditor wants to hear about as soon as the log shows it (issue 34).

rekor-monitor's habit, for the decision log: a small TOML file of rules that ``broker audit
monitor --rules FILE`` runs, on each run, over the records it has not seen yet (docs/audit.md,
"Watch rules")::

    [[rule]]
    name = "llama only to the release images"
    kind = "key_images"                  # key K released only to images in this list
    key = "models/llama-*"               # a shell-style pattern (fnmatch), or a key's name
    images = ["sha256:…"]

    [[rule]]
    name = "office hours"
    kind = "release_hours"               # no key released outside these hours and days (UTC)
    hours = "07:00-19:00"                # start inclusive, end exclusive; 22:00-06:00 wraps
    days = ["mon", "tue", "wed", "thu", "fri"]   # default: every day
    keys = ["models/*"]                  # default: every key

    [[rule]]
    name = "refused reloads"
    kind = "record_type"                 # any record of this type
    type = "policy_reload_failed"
    result = "deny"                      # optional: and this result (a release's outcome)

    [[rule]]
    name = "llama fan-out"
    kind = "recipients"                  # a key released to more than ``max`` distinct
    key = "models/llama-*"               # recipient keys within ``window_seconds``
    max = 3
    window_seconds = 3600

A key counts as released when a record decided it ``allow`` (a full-evidence ``release``, or a
key of an ``attested_release``); its image is the record's ``identity.image_digest`` and its
recipient the record's ``runner_key_thumbprint``. What a rule cannot read counts against the
release (fail closed): a released key without an image digest is not in any list, a release
without a readable time is outside every hour, a line that is not a record is a hit of its own.
A ``recipients`` rule reports once per window and key: after a hit it is quiet until
``window_seconds`` have passed. Its recent recipients are the only state rules keep between runs
(``Watch.windows``, saved by the monitor).

Pure: records in (``parse_record``), hits out; no I/O, no clock (record times only).
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from fnmatch import fnmatchcase
from typing import Any

from broker.audit.envelope import Envelope, KeyDecision, RecordError, instant, parse_record
from broker.audit.outcomes import ALLOW
from broker.core.records import KNOWN_TYPES, RecordType

MAX_RULES = 200
MAX_LIST = 10_000  # images or keys in one rule
MAX_TRACKED = 10_000  # recipients a recipients rule remembers per key (the newest)
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # datetime.weekday() order
RELEASES = (RecordType.RELEASE, RecordType.ATTESTED_RELEASE)
UNREADABLE = "unreadable_record"  # the kind of a hit no rule made: a line that is not a record


class RulesError(ValueError):
    """A rules file that cannot be used; the message names the rule (its name and number)."""


@dataclass(frozen=True)
class KeyImages:
    name: str
    key: str
    images: frozenset[str]


@dataclass(frozen=True)
class ReleaseHours:
    name: str
    start: int  # minutes after midnight UTC, inclusive
    end: int  # exclusive; below ``start``: the hours wrap past midnight
    days: frozenset[int]  # datetime.weekday()
    keys: tuple[str, ...]  # patterns; empty: every key

    def inside(self, at: datetime) -> bool:
        minute = at.hour * 60 + at.minute
        hours = (
            self.start <= minute < self.end
            if self.start < self.end
            else (minute >= self.start or minute < self.end)
        )
        return hours and at.weekday() in self.days


@dataclass(frozen=True)
class RecordOfType:
    name: str
    type: str
    result: str | None


@dataclass(frozen=True)
class Recipients:
    name: str
    key: str
    max: int
    window: timedelta


Rule = KeyImages | ReleaseHours | RecordOfType | Recipients
KINDS: dict[str, type[Rule]] = {
    "key_images": KeyImages,
    "release_hours": ReleaseHours,
    "record_type": RecordOfType,
    "recipients": Recipients,
}
KIND_OF = {cls: kind for kind, cls in KINDS.items()}


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


def describe(rule: Rule) -> str:
    """One line saying what the rule watches (the monitor's report, the console)."""
    if isinstance(rule, KeyImages):
        return f"{rule.key} released only to {len(rule.images)} image(s)"
    if isinstance(rule, ReleaseHours):
        days = ",".join(d for n, d in enumerate(DAYS) if n in rule.days)
        keys = ", ".join(rule.keys) or "any key"
        return f"{keys} released only {_clock(rule.start)}-{_clock(rule.end)} UTC on {days}"
    if isinstance(rule, RecordOfType):
        return f"any {rule.type} record" + (f" with result {rule.result}" if rule.result else "")
    seconds = int(rule.window.total_seconds())
    return f"{rule.key} released to at most {rule.max} recipient key(s) per {seconds} s"


# --- the rules file ------------------------------------------------------------------------


def parse_rules(text: bytes) -> tuple[Rule, ...]:
    """The rules of a rules file (TOML: ``[[rule]]`` tables, ``name`` and ``kind`` in each).

    Raises:
        RulesError: not TOML, an unknown member or kind, a value of the wrong type or out of
            range, two rules of one name; the message names the rule.
    """
    try:
        document = tomllib.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RulesError(f"not a TOML file: {exc}") from exc
    unknown = sorted(set(document) - {"rule"})
    if unknown:
        raise RulesError(f"unknown table or key {unknown[0]!r} (rules are [[rule]] tables)")
    tables = document.get("rule", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise RulesError("rule must be an array of tables ([[rule]])")
    if not tables:
        raise RulesError("no rule: a rules file holds at least one [[rule]]")
    if len(tables) > MAX_RULES:
        raise RulesError(f"{len(tables)} rules: at most {MAX_RULES}")
    rules: list[Rule] = []
    for number, table in enumerate(tables, start=1):
        label = f"rule #{number}" + (
            f" ({table['name']!r})" if isinstance(table.get("name"), str) else ""
        )
        try:
            rule = _rule(table)
        except RulesError as exc:
            raise RulesError(f"{label}: {exc}") from None
        if any(r.name == rule.name for r in rules):
            raise RulesError(f"{label}: another rule has this name")
        rules.append(rule)
    return tuple(rules)


def _rule(table: Mapping[str, Any]) -> Rule:
    kind = table.get("kind")
    if kind not in KINDS:
        raise RulesError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    members = {
        "key_images": {"key", "images"},
        "release_hours": {"hours", "days", "keys"},
        "record_type": {"type", "result"},
        "recipients": {"key", "max", "window_seconds"},
    }[kind] | {"name", "kind"}
    unknown = sorted(set(table) - members)
    if unknown:
        known = ", ".join(sorted(members))
        raise RulesError(f"unknown member {unknown[0]!r} for kind {kind} ({known})")
    name = _text(table, "name")
    if kind == "key_images":
        images = _texts(table, "images", required=True)
        return KeyImages(name, _text(table, "key"), frozenset(images))
    if kind == "release_hours":
        start, end = _hours(table.get("hours"))
        days = _texts(table, "days", required=False) or DAYS
        if any(d not in DAYS for d in days):
            raise RulesError(f"days: each one of {', '.join(DAYS)}")
        keys = _texts(table, "keys", required=False)
        return ReleaseHours(name, start, end, frozenset(DAYS.index(d) for d in days), keys)
    if kind == "record_type":
        written = _text(table, "type")
        if written not in KNOWN_TYPES | {RecordType.UNKNOWN.value}:
            raise RulesError(f"type {written!r} is not a record type ({', '.join(KNOWN_TYPES)})")
        result = _text(table, "result") if "result" in table else None
        return RecordOfType(name, written, result)
    most, seconds = table.get("max"), table.get("window_seconds")
    if not isinstance(most, int) or isinstance(most, bool) or most < 1:
        raise RulesError("max: a whole number of recipient keys, at least 1")
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not 0 < seconds <= 31 * 86400:
        raise RulesError("window_seconds: a whole number of seconds, 1 to 31 days")
    return Recipients(name, _text(table, "key"), most, timedelta(seconds=seconds))


def _text(table: Mapping[str, Any], member: str) -> str:
    value = table.get(member)
    if not isinstance(value, str) or not value.strip() or len(value) > 512:
        raise RulesError(f"{member}: a non-empty string is required")
    return value


def _texts(table: Mapping[str, Any], member: str, *, required: bool) -> tuple[str, ...]:
    value = table.get(member, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RulesError(f"{member}: a list of non-empty strings")
    if required and not value:
        raise RulesError(f"{member}: at least one (an empty list would allow nothing silently)")
    if len(value) > MAX_LIST:
        raise RulesError(f"{member}: at most {MAX_LIST}")
    return tuple(value)


def _hours(value: Any) -> tuple[int, int]:
    """``"HH:MM-HH:MM"`` as minutes after midnight (an end of ``24:00`` is midnight)."""
    problem = RulesError('hours: "HH:MM-HH:MM" in UTC, e.g. "07:00-19:00"')
    if not isinstance(value, str) or value.count("-") != 1:
        raise problem
    minutes = []
    for part in value.split("-"):
        hour, _, minute = part.strip().partition(":")
        if not (hour.isdigit() and minute.isdigit() and len(minute) == 2 and int(minute) < 60):
            raise problem
        minutes.append(int(hour) * 60 + int(minute))
    start, end = minutes
    if not (0 <= start < 24 * 60 and 0 <= end <= 24 * 60) or start == end:
        raise problem
    return start, end


def _clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


# --- evaluation ----------------------------------------------------------------------------


class Watch:
    """The rules, run over records in log order. ``windows`` (the recipients rules' recent
    recipients and quiet times, JSON) carries over to the next run."""

    def __init__(self, rules: tuple[Rule, ...], windows: Mapping[str, Any] | None = None) -> None:
        self._rules = rules
        self._windows: dict[str, dict[str, _Window]] = {
            rule.name: _windows_of(rule, (windows or {}).get(rule.name))
            for rule in rules
            if isinstance(rule, Recipients)
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


@dataclass
class _Window:
    """One key's recent recipients under one recipients rule."""

    seen: dict[str, datetime]  # recipient thumbprint -> its latest release of the key
    quiet_until: datetime | None  # after a hit: no other one before this

    def count(self, rule: Recipients, at: datetime, recipient: str) -> str | None:
        self.seen[recipient] = max(at, self.seen.get(recipient, at))
        oldest = at - rule.window
        self.seen = {r: t for r, t in self.seen.items() if t > oldest}
        if len(self.seen) > MAX_TRACKED:
            newest = sorted(self.seen.items(), key=lambda item: item[1])[-MAX_TRACKED:]
            self.seen = dict(newest)
        if len(self.seen) <= rule.max or (self.quiet_until is not None and at < self.quiet_until):
            return None
        self.quiet_until = at + rule.window
        return (
            f"released to {len(self.seen)} distinct recipient keys within "
            f"{int(rule.window.total_seconds())} s (at most {rule.max})"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "seen": {r: t.isoformat() for r, t in sorted(self.seen.items())},
            "quiet_until": None if self.quiet_until is None else self.quiet_until.isoformat(),
        }


def _windows_of(rule: Recipients, saved: Any) -> dict[str, _Window]:
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
    if record.kind in RELEASES:
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
