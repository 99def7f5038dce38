"""Watch rules (issue 34), pure: a rules file that cannot be used is refused naming the rule, and
each rule kind reports exactly the records it should on the records the broker's plans write
(the pinned vectors of tests/vectors/decision_records). The same rules on a live broker's log,
through ``broker audit monitor``, are tests/integration/test_audit_watch.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.audit.watch import Watch
from broker.audit.watch_rules import MAX_TRACKED, RulesError, describe, parse_rules
from broker.audit.watch_state import LogWatch, watch_member, watch_view
from broker.core.encoding import canonical
from broker.crypto.merkle import CompactRange, leaf_hash

VECTORS = Path(__file__).parents[1] / "vectors" / "decision_records"
IMAGE = "sha256:" + "a1" * 32  # the vectors' workload
WEDNESDAY_0304 = "2030-01-02T03:04:05+00:00"  # the vectors' time


def record(name: str, **changes: Any) -> bytes:
    return canonical({**json.loads((VECTORS / f"{name}.json").read_text()), **changes})


def hits(rules: str, *lines: bytes, watch: Watch | None = None) -> list[tuple[str, int, str]]:
    watch = watch or Watch(parse_rules(rules.encode()))
    return [
        (h.rule, h.index, h.key or "") for i, line in enumerate(lines) for h in watch.check(i, line)
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("rule = 1", "rule must be an array of tables"),
        ("", "no rule"),
        ("[[rules]]\nname='a'", "unknown table or key 'rules'"),
        ("[[rule]]\nkind='key_images'\nkey='k'\nimages=['x']", "rule #1: name: a non-empty"),
        ("[[rule]]\nname='a'\nkind='nope'", "rule #1 ('a'): kind 'nope' is not one of"),
        ("[[rule]]\nname='a'\nkind='key_images'\nkey='k'\nimages=[]", "images: at least one"),
        ("[[rule]]\nname='a'\nkind='key_images'\nkey='k'\nimage=['x']", "unknown member 'image'"),
        ("[[rule]]\nname='a'\nkind='release_hours'\nhours='7-19'", 'hours: "HH:MM-HH:MM"'),
        ("[[rule]]\nname='a'\nkind='release_hours'\nhours='07:00-19:60'", "hours:"),
        ("[[rule]]\nname='a'\nkind='release_hours'\nhours='07:00-07:00'", "hours:"),
        ("[[rule]]\nname='a'\nkind='release_hours'\nhours='07:00-19:00'\ndays=['monday']", "days"),
        ("[[rule]]\nname='a'\nkind='record_type'\ntype='policy_reload_fail'", "not a record type"),
        (
            "[[rule]]\nname='a'\nkind='record_type'\ntype='release'\nresult='denied'",
            "rule #1 ('a'): result 'denied' is not one of release's (allow, deny, error)",
        ),
        (
            "[[rule]]\nname='a'\nkind='record_type'\ntype='release'\nresult='partial'",
            "result 'partial' is not one of release's",  # only a release on a result's
        ),
        (
            "[[rule]]\nname='a'\nkind='record_type'\ntype='policy_change'\nresult='allow'",
            "result: policy_change records have no result (leave it out)",
        ),
        (
            "[[rule]]\nname='a'\nkind='record_type'\ntype='key_admin'\nresult='allow'",
            "result 'allow' is not one of key_admin's (ok, error, unknown)",
        ),
        ("[[rule]]\nname='a'\nkind='recipients'\nkey='k'\nmax=0\nwindow_seconds=60", "max:"),
        ("[[rule]]\nname='a'\nkind='deny_rate'\nkey='k'\nmax=1\nwindow_seconds=60", "'key'"),
        ("[[rule]]\nname='a'\nkind='deny_rate'\nmax=10000\nwindow_seconds=60", "max: a whole"),
        ("[[rule]]\nname='a'\nkind='recipients'\nkey='k'\nmax=2\nwindow_seconds=true", "window"),
        (
            "[[rule]]\nname='a'\nkind='record_type'\ntype='release'\n"
            "[[rule]]\nname='a'\nkind='record_type'\ntype='release'",
            "rule #2 ('a'): another rule has this name",
        ),
        ("[[rule]\nname='a'", "not a TOML file"),
    ],
)
def test_a_rules_file_that_cannot_be_used_is_refused_naming_the_rule(
    text: str, problem: str
) -> None:
    with pytest.raises(RulesError) as refused:
        parse_rules(text.encode())
    assert problem in str(refused.value)


def test_key_images_reports_a_release_to_an_image_not_listed_and_a_missing_image() -> None:
    rules = f"""
[[rule]]
name = "llama listed"
kind = "key_images"
key = "models/llama"
images = ["{IMAGE}"]

[[rule]]
name = "models elsewhere"
kind = "key_images"
key = "models/*"
images = ["sha256:{"0" * 64}"]
"""
    allowed, partial = record("release.allow"), record("attested_release.partial")
    denied = record("release.deny-policy")  # refused: never a hit, whatever the image
    no_image = record("release.allow", identity={})
    # a KBS guest's resource (its key at the top, as a release's); raw evidence names no image
    guest = record("release.allow", type="kbs_resource", identity={"image_digest": ""})
    found = hits(rules, allowed, partial, denied, no_image, guest)
    assert found == [
        ("models elsewhere", 0, "models/llama"),
        ("models elsewhere", 1, "models/llama"),  # the key it released, not the one refused
        ("llama listed", 3, "models/llama"),  # no image recorded: in no list (fail closed)
        ("models elsewhere", 3, "models/llama"),
        ("llama listed", 4, "models/llama"),  # released through the KBS facade: the same
        ("models elsewhere", 4, "models/llama"),
    ]


def test_release_hours_reports_releases_outside_the_hours_or_days() -> None:
    inside = '[[rule]]\nname="night"\nkind="release_hours"\nhours="22:00-06:00"\n'
    assert hits(inside, record("release.allow")) == []  # 03:04 is inside a wrapping window
    weekend = inside + 'days = ["sat", "sun"]\n'
    assert hits(weekend, record("release.allow")) == [("night", 0, "models/llama")]
    office = '[[rule]]\nname="office"\nkind="release_hours"\nhours="07:00-19:00"\nkeys=["x/*"]\n'
    assert hits(office, record("release.allow")) == []  # another key
    office = office.replace('["x/*"]', '["models/*"]')
    assert hits(office, record("release.allow"), record("release.allow", time="yesterday")) == [
        ("office", 0, "models/llama"),
        ("office", 1, "models/llama"),  # a time that does not read: outside every hour
    ]


def test_record_type_reports_every_record_of_the_type_and_result() -> None:
    rules = (
        '[[rule]]\nname="reloads"\nkind="record_type"\ntype="policy_reload_failed"\n'
        '[[rule]]\nname="partial"\nkind="record_type"\ntype="attested_release"\nresult="partial"\n'
        '[[rule]]\nname="failed changes"\nkind="record_type"\ntype="key_admin"\nresult="error"\n'
        '[[rule]]\nname="newer"\nkind="record_type"\ntype="unknown"\n'
    )
    failed = canonical({"type": "policy_reload_failed", "time": WEDNESDAY_0304, "problem": "x"})
    newer = canonical({"type": "from_a_newer_broker", "time": WEDNESDAY_0304})
    found = hits(rules, record("release.allow"), record("attested_release.partial"), failed, newer)
    assert [(rule, index) for rule, index, _ in found] == [
        ("partial", 1),
        ("reloads", 2),
        ("newer", 3),
    ]


def test_recipients_reports_once_per_window_and_carries_its_window_across_runs() -> None:
    rules = parse_rules(
        b'[[rule]]\nname="fan-out"\nkind="recipients"\nkey="models/*"\nmax=2\nwindow_seconds=3600\n'
    )

    def release(minute: int, recipient: str) -> bytes:
        when = f"2030-01-02T03:{minute:02d}:00+00:00"
        return record("release.allow", time=when, runner_key_thumbprint=recipient)

    first = Watch(rules)
    assert hits("", release(0, "a"), release(1, "b"), release(2, "b"), watch=first) == []
    second = Watch(rules, json.loads(json.dumps(first.windows)))  # as saved, as read back
    found = hits("", release(3, "c"), release(4, "d"), watch=second)
    assert found == [("fan-out", 0, "models/llama")]  # the third recipient; then quiet
    later = Watch(rules, second.windows)
    assert [h.rule for h in later.check(9, record("release.allow"))] == []  # 03:04, quiet
    outside = "2030-01-02T05:00:00+00:00"  # past the window: a, b, c, d have aged out
    assert later.check(10, record("release.allow", time=outside)) == []


def test_a_line_that_is_not_a_record_is_a_hit_of_its_own() -> None:
    watch = Watch(parse_rules(b'[[rule]]\nname="r"\nkind="record_type"\ntype="release"\n'))
    (hit,) = watch.check(7, b"not json")
    assert (hit.kind, hit.index, hit.rule) == ("unreadable_record", 7, "")


def test_a_saved_progress_that_does_not_fit_its_size_restarts_from_record_zero() -> None:
    """The monitor's state, read back: a compact range that does not fit its index (an edited
    or truncated state) is a fresh start, never a range checked against the wrong root."""
    carried = CompactRange()
    for n in range(5):
        carried.append(leaf_hash(b"%d" % n))
    saved = LogWatch(carried.size, tuple(carried.hashes), {"r": {}}).as_json()
    assert LogWatch.of(json.loads(json.dumps(saved))) == LogWatch(
        5, tuple(carried.hashes), {"r": {}}
    )
    for broken in ({**saved, "index": 4}, {**saved, "index": True}, {**saved, "frontier": ["!"]}):
        assert LogWatch.of(broken) == LogWatch()
    assert LogWatch.of(None) == LogWatch()


def test_the_console_reads_the_state_the_monitor_writes_and_drops_what_does_not_read() -> None:
    rules = parse_rules(b'[[rule]]\nname="r"\nkind="record_type"\ntype="release"\n')
    (hit,) = Watch(rules).check(3, record("release.allow"))
    saved = {**hit.as_json(), "origin": "o", "found_at": WEDNESDAY_0304}
    member = watch_member(
        json.dumps(
            {
                "watch": {
                    "rules": [{"name": "r", "kind": "record_type", "watches": describe(rules[0])}],
                    "checked_at": WEDNESDAY_0304,
                    "logs": {"o": {"index": 4, "frontier": ["!"]}},
                    "hits": [saved, {**saved, "index": "3"}, {**saved, "key": 7}, "x"],
                }
            }
        ).encode()
    )
    view = watch_view(member)
    assert [(r.name, r.watches) for r in view.rules] == [("r", "any release record")]
    assert view.logs == (("o", 0),)  # a range that does not fit: restarts, and says so
    assert [(s.origin, s.hit) for s in view.hits] == [("o", hit)]
    assert view.checked_at is not None
    assert watch_member(b"not json") == watch_member(b"[]") == {}


def test_deny_rate_reports_a_burst_of_refusals_once_per_window_across_runs() -> None:
    """Every refused decision counts (a release, a key of a release on a result, an attestation,
    a release on a result refused before it named a key); allowed and failed (5xx) ones do not."""
    rules = parse_rules(b'[[rule]]\nname="burst"\nkind="deny_rate"\nmax=2\nwindow_seconds=300\n')

    def at(name: str, minute: int) -> bytes:
        return record(name, time=f"2030-01-02T03:{minute:02d}:00+00:00")

    first = Watch(rules)
    quiet = [at("release.deny-policy", 0), at("release.allow", 1), at("release.error-kek", 1)]
    assert hits("", *quiet, watch=first) == []
    second = Watch(rules, json.loads(json.dumps(first.windows)))  # as saved, as read back
    burst = [
        at("attestation.deny-policy", 2),
        at("attested_release.deny-result-invalid", 3),  # the third refusal within 300 s
        at("attested_release.partial", 4),  # quiet for one window after a hit
    ]
    assert [
        (h.rule, h.index, h.detail)
        for i, line in enumerate(burst, start=3)
        for h in second.check(i, line)
    ] == [("burst", 4, "3 refused decisions within 300 s (at most 2)")]
    later = Watch(rules, second.windows)
    assert later.check(9, at("release.deny-policy", 8)) == []  # in the window: 03:04, 03:08
    assert [h.index for h in later.check(10, at("release.deny-policy", 9))] == []  # 2 in window
    assert describe(rules[0]) == "at most 2 refused decision(s) per 300 s"


def test_deny_rate_of_some_keys_counts_only_their_refusals() -> None:
    rules = parse_rules(
        b'[[rule]]\nname="k"\nkind="deny_rate"\nmax=1\nwindow_seconds=60\nkeys=["models/not-*"]\n'
    )
    watch = Watch(rules)
    assert watch.check(0, record("release.deny-policy")) == []  # models/llama
    assert watch.check(1, record("attestation.deny-policy")) == []  # no key
    assert watch.check(2, record("attested_release.partial")) == []  # the first of its key
    (hit,) = watch.check(3, record("attested_release.partial", decision_id="another"))
    assert (hit.index, hit.key) == (3, "models/not-for-this-image")


def test_a_window_keeps_the_newest_entries_up_to_its_bound_and_still_counts_past_max() -> None:
    """A window holds at most MAX_TRACKED entries (the newest): a deny_rate rule with the largest
    max still reports when the refusals within its window exceed it, and its saved window stays
    bounded (each record costs a heap operation, not a pass over the window)."""
    most = MAX_TRACKED - 1
    rules = parse_rules(
        f'[[rule]]\nname="b"\nkind="deny_rate"\nmax={most}\nwindow_seconds=3600\n'.encode()
    )
    watch = Watch(rules)
    denied = record("release.deny-policy")
    found = [h.index for i in range(MAX_TRACKED + 5) for h in watch.check(i, denied)]
    assert found == [most]  # the (max + 1)-th refusal; then quiet for the window
    assert len(watch.windows["b"][""]["seen"]) == MAX_TRACKED
