"""OPA's sprintf as the Wasm host implements it, against outputs of Go's fmt (vectors produced
by Go's ``fmt.Printf`` on this machine with OPA's argument types: integers are ``int64``); the
differential test compares with a real OPA on generated inputs."""

from __future__ import annotations

import pytest

from broker.policy.gofmt import RegoNumber, RegoSet, go_sprintf, parse_rego_value, rego_string

N = RegoNumber


@pytest.mark.parametrize(
    ("template", "args", "expected"),
    [
        (
            "%v|%s|%d|%f|%e|%g|%.2f",
            [N("1234567.5")] * 7,
            "1.2345675e+06|%!s(float64=1.2345675e+06)|%!d(float64=1.2345675e+06)|1234567.500000|1.234568e+06|1.2345675e+06|1234567.50",
        ),
        (
            "%v|%v|%v|%v|%v",
            [N("1.5"), N("0.00001234"), N("123456.5"), N("1e21"), N("0.0001")],
            "1.5|1.234e-05|123456.5|1e+21|0.0001",
        ),
        ("%v|%v|%v", [N("1e6"), N("550.90"), N("-2.5")], "1e+06|550.9|-2.5"),
        (
            "%v|%s|%d|%x|%5d|%-5d|%05d",
            [N("5"), N("5"), N("5"), N("255"), N("42"), N("42"), N("42")],
            "5|%!s(int64=5)|5|ff|   42|42   |00042",
        ),
        (
            "%v|%s|%d|%x",
            [N("123456789012345678901234")] * 4,
            "123456789012345678901234|123456789012345678901234|123456789012345678901234|1a249b1f10a06c96aff2",
        ),
        (
            "%v|%s|%d|%q|%.2s|%5s|%x",
            ["abé", "abé", "abc", 'a"b\x7f\u00e9\u200b', "héllo", "ab", "hi"],
            'abé|abé|%!d(string=abc)|"a\\"b\\x7fé\\u200b"|hé|   ab|6869',
        ),
        ("%v %v", [N("1")], "1 %!v(MISSING)"),
        ("%v", [N("1"), "x", N("2.5")], "1%!(EXTRA string=x, float64=2.5)"),
        ("%!|%z|%%|%t", [N("1"), N("2"), "s"], "%!!(int64=1)|%!z(int64=2)|%|%!t(string=s)"),
        ("%v|%s|%v", [True, None, [N("1"), "a", None]], 'true|null|[1, "a", null]'),
        ("%v", [RegoSet(("b", N("1")))], '{1, "b"}'),
        ("%v", [RegoSet(())], "set()"),
        ("end %", [], "end %!(NOVERB)"),
    ],
)
def test_sprintf_matches_go(template: str, args: list[object], expected: str) -> None:
    assert go_sprintf(template, args) == expected


def test_value_dump_text_is_read_with_sets_and_objects() -> None:
    value = parse_rego_value('[{1, "a"}, set(), {"b": [1, "x\\n"], "a": null}, 5, 1e2, true]')
    assert rego_string(value) == '[{1, "a"}, set(), {"a": null, "b": [1, "x\\n"]}, 5, 1e2, true]'
