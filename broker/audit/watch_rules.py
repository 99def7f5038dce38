"""Watch rules, the file: what each rule says, read from TOML and refused when unusable.

``broker audit monitor --rules FILE`` reads a small TOML file of rules (docs/audit.md, "Watch
rules") and ``audit/watch.py`` runs them over records::

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
    # result = "deny"                    # optional, for types that have one: and this result

    [[rule]]
    name = "refusal burst"
    kind = "deny_rate"                   # more than ``max`` refused decisions within
    max = 20                             # ``window_seconds`` (of these keys; default: any)
    window_seconds = 300

    [[rule]]
    name = "llama fan-out"
    kind = "recipients"                  # a key released to more than ``max`` distinct
    key = "models/llama-*"               # recipient keys within ``window_seconds``
    max = 3
    window_seconds = 3600

A file that cannot be used — not TOML, an unknown kind or member, a value of the wrong type or
out of range, two rules of one name, an empty list that would allow nothing silently, a
``result`` its type never has (a typo would never match) — is refused whole (``RulesError``,
naming the rule): never run partly, never ignored.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from broker.audit.outcomes import ALLOW, DENY, ERROR, PARTIAL
from broker.core.records import DECISION_TYPES, KNOWN_TYPES, ChangeResult, RecordType

MAX_RULES = 200
MAX_LIST = 10_000  # images or keys in one rule
MAX_TRACKED = 10_000  # entries a windowed rule remembers per window (the newest); max is below
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # datetime.weekday() order
# the results a record_type rule may name, per type (a type not here has none): a decision's
# (a release on a result's outcome may be partial), a key change's outcome
RESULTS_OF: dict[str, tuple[str, ...]] = {
    **{kind.value: (ALLOW, DENY, ERROR) for kind in DECISION_TYPES | {RecordType.KBS_AUTH}},
    RecordType.ATTESTED_RELEASE.value: (ALLOW, PARTIAL, DENY, ERROR),
    RecordType.KEY_ADMIN.value: tuple(result.value for result in ChangeResult),
}


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


@dataclass(frozen=True)
class DenyRate:
    name: str
    max: int
    window: timedelta
    keys: tuple[str, ...]  # patterns; empty: every refusal (keyless ones too)


Rule = KeyImages | ReleaseHours | RecordOfType | Recipients | DenyRate
Windowed = Recipients | DenyRate
KINDS: dict[str, type[Rule]] = {
    "key_images": KeyImages,
    "release_hours": ReleaseHours,
    "record_type": RecordOfType,
    "recipients": Recipients,
    "deny_rate": DenyRate,
}
KIND_OF = {cls: kind for kind, cls in KINDS.items()}


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
    if isinstance(rule, DenyRate):
        keys = " of " + ", ".join(rule.keys) if rule.keys else ""
        return f"at most {rule.max} refused decision(s){keys} per {seconds} s"
    return f"{rule.key} released to at most {rule.max} recipient key(s) per {seconds} s"


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
        "deny_rate": {"max", "window_seconds", "keys"},
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
        results = RESULTS_OF.get(written, ())
        if result is not None and not results:
            raise RulesError(f"result: {written} records have no result (leave it out)")
        if result is not None and result not in results:
            raise RulesError(f"result {result!r} is not one of {written}'s ({', '.join(results)})")
        return RecordOfType(name, written, result)
    most, seconds = table.get("max"), table.get("window_seconds")
    if not isinstance(most, int) or isinstance(most, bool) or not 0 < most < MAX_TRACKED:
        raise RulesError(f"max: a whole number, 1 to {MAX_TRACKED - 1}")
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not 0 < seconds <= 31 * 86400:
        raise RulesError("window_seconds: a whole number of seconds, 1 to 31 days")
    if kind == "deny_rate":
        keys = _texts(table, "keys", required=False)
        return DenyRate(name, most, timedelta(seconds=seconds), keys)
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
