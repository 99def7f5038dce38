"""``sprintf``'s supported subset (``broker/policy/sprintf.py``): pinned against outputs of Go's
``fmt`` with OPA's argument types, refused outside the subset (at build and at run time), and
compared with OPA itself on generated values through the broker's Wasm engine."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from broker.policy.build import compile_entrypoints, compile_policy_dir, run_opa
from broker.policy.rego_values import RegoNumber, RegoSet, parse_rego_value, rego_string
from broker.policy.sprintf import Unsupported, check_template, sprintf
from broker.policy.testing import find_opa
from broker.policy.wasm import PolicyLoadError, WasmPolicyInstance
from tests.policy_helpers import policy_copy

N = RegoNumber


@pytest.mark.parametrize(
    ("template", "args", "expected"),
    [
        (
            "%v|%s|%d",
            [N("1234567.5")] * 3,
            "1.2345675e+06|%!s(float64=1.2345675e+06)|%!d(float64=1.2345675e+06)",
        ),
        (
            "%v|%v|%v|%v|%v",
            [N("1.5"), N("0.00001234"), N("123456.5"), N("1e21"), N("0.0001")],
            "1.5|1.234e-05|123456.5|1e+21|0.0001",
        ),
        ("%v|%v|%v", [N("1e6"), N("550.90"), N("-2.5")], "1e+06|550.9|-2.5"),
        ("%v|%s|%d", [N("5"), N("5"), N("5")], "5|%!s(int64=5)|5"),
        (
            "%v|%s|%d",
            [N("123456789012345678901234")] * 3,
            "123456789012345678901234|123456789012345678901234|123456789012345678901234",
        ),
        ("%v|%s|%d", ["abé", "abé", "abc"], "abé|abé|%!d(string=abc)"),
        ("%v %v", [N("1")], "1 %!v(MISSING)"),
        ("%v", [N("1"), "x", N("2.5")], "1%!(EXTRA string=x, float64=2.5)"),
        ("100%% %s", ["sure"], "100% sure"),
        ("%v|%s|%v", [True, None, [N("1"), "a", None]], 'true|null|[1, "a", null]'),
        ("%v", [RegoSet(("b", N("1")))], '{1, "b"}'),
        ("%v", [RegoSet(())], "set()"),
        ("%d", [[N("1")]], "%!d(string=[1])"),
    ],
)
def test_sprintf_matches_go(template: str, args: list[object], expected: str) -> None:
    assert sprintf(template, args) == expected


@pytest.mark.parametrize(
    "template",
    ["%f", "%e", "%g", "%.2f", "%x", "%5d", "%-5d", "%05d", "%q", "%.2s", "%5s", "%!", "%t"],
)
def test_verbs_outside_the_subset_are_refused(template: str) -> None:
    with pytest.raises(Unsupported, match="not supported"):
        check_template(template)
    with pytest.raises(Unsupported):  # at run time too: a bundle built elsewhere fails closed
        sprintf(template, [N("1")])


def test_a_trailing_percent_is_refused() -> None:
    with pytest.raises(Unsupported, match="trailing"):
        check_template("end %")


def test_value_dump_text_is_read_with_sets_and_objects() -> None:
    value = parse_rego_value('[{1, "a"}, set(), {"b": [1, "x\\n"], "a": null}, 5, 1e2, true]')
    assert rego_string(value) == '[{1, "a"}, set(), {"a": null, "b": [1, "x\\n"]}, 5, 1e2, true]'


@pytest.mark.parametrize(
    ("rego", "problem"),
    [
        ('msg := sprintf("%5d", [1])', "%5 is not supported"),
        ('msg := sprintf(concat("", ["%", "v"]), [1])', "must be a string literal"),
        ('sprintf("%x", [1], msg)', "%x is not supported"),
    ],
)
def test_a_policy_outside_the_subset_does_not_load(tmp_path: Path, rego: str, problem: str) -> None:
    policy = policy_copy(tmp_path / "policy")
    extra = policy / "broker" / "key_policies" / "fmt.rego"
    extra.parent.mkdir(parents=True, exist_ok=True)
    extra.write_text(
        "package broker.key_policies.fmt\nimport rego.v1\n"
        f"deny contains msg if {{\n\tinput.never\n\t{rego}\n}}\n"
    )
    with pytest.raises(PolicyLoadError, match=re.escape(problem)):
        compile_policy_dir(policy, opa=find_opa())


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any kind: strings with escapes, quotes and non-BMP characters, integers
    in and beyond int64, fractions and exponents, booleans, null, arrays, objects."""
    kind = rng.choice(
        ["str", "int", "big", "float", "bool", "null", "array", "object"][: 8 - depth]
    )
    alphabet = 'aé"\\\n\t\x01\x7f\u200b\u00a0 ✓😀%{}[]'
    if kind == "str":
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-(2**63), 2**63 - 1)
    if kind == "big":
        return rng.choice([-1, 1]) * rng.randint(2**63, 2**90)
    if kind == "float":
        return rng.choice([0.5, -2.5, 1e21, 1e-7, 123456.5, 1234567.5, 0.0001, 3.14159])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{rng.randint(0, 9)}": _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


DIFFERENTIAL = """package t
import rego.v1

out := [x |
\tsome v in input.values
\tx := [
\t\tsprintf("%v|%s|%d", [v, v, v]),
\t\tsprintf("<%v> 100%% %v", [v]),
\t\tsprintf("%s", [v, v]),
\t]
]

sets := [sprintf("%v|%s", [{v | some v in vs}, {v | some v in vs}]) | some vs in input.sets]
"""


def test_the_wasm_engine_renders_like_opa_on_generated_values(tmp_path: Path) -> None:
    """Every case: OPA's own evaluation (``opa eval``) against the broker's Wasm engine with
    the host ``sprintf``, on 300 generated values and 40 generated sets."""
    rng = random.Random(20261201)
    document = {
        "values": [_value(rng) for _ in range(300)],
        "sets": [[_value(rng, 6) for _ in range(rng.randint(0, 4))] for _ in range(40)],
    }
    policy = tmp_path / "p"
    policy.mkdir()
    (policy / "t.rego").write_text(DIFFERENTIAL)
    (tmp_path / "input.json").write_text(json.dumps(document))
    opa = find_opa()
    compiled = compile_entrypoints(policy, ["t/out", "t/sets"], opa=opa, with_tests=False)
    for rule in ("out", "sets"):
        done = run_opa(
            opa, "eval", "--format", "json", "-d", str(policy),
            "-i", str(tmp_path / "input.json"), f"data.t.{rule}",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        expected = json.loads(done.stdout)["result"][0]["expressions"][0]["value"]
        engine = WasmPolicyInstance(compiled, entrypoint=f"t/{rule}")
        assert engine.evaluate(document) == expected
