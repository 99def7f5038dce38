"""``sprintf`` for the Wasm engine: the subset of Go's ``fmt`` that OPA and the broker render alike.

OPA's Wasm target leaves ``sprintf`` to the host. OPA's own (``topdown/strings.go``) converts each
argument, then calls Go's ``fmt.Sprintf``. Rather than clone Go's ``fmt`` (every verb, flag, width
and precision), the broker supports a small, documented subset and refuses the rest:

* **Templates** are string literals whose directives are ``%v``, ``%s``, ``%d`` and ``%%`` — no
  flags, width or precision (``check_template``). ``broker policy check|test|build`` and every
  policy load from a directory refuse any other ``sprintf`` (``build.check_structure``, on OPA's
  AST). A bundle built elsewhere that uses one fails closed when the call runs (``Unsupported``:
  the evaluation fails, nothing is allowed).
* **Arguments**, as OPA converts them, then as Go prints them:

  - a string: ``%s``/``%v`` the text; ``%d`` ``%!d(string=text)``;
  - an integer (its JSON text is one): ``%d``/``%v`` decimal; ``%s`` ``%!s(int64=5)``, or the
    decimal for integers beyond int64 (Go's ``*big.Int`` prints ``%s`` as ``%d``);
  - another number (``float64``): ``%v`` Go's shortest ``%g`` (``1.2345675e+06``, ``0.5``);
    ``%s``/``%d`` ``%!s(float64=…)``;
  - anything else (boolean, null, array, object, set): its Rego text (``rego_values``), which Go
    receives as a string: ``%s``/``%v`` that text; ``%d`` ``%!d(string=…)``;
  - too few arguments: ``%!v(MISSING)``; too many: ``%!(EXTRA int64=1, string=x)``.

``tests/unit/test_sprintf.py`` pins the rules with outputs of Go's ``fmt`` and compares the
engine with OPA itself on generated values for every verb (docs/decisions.md: why a subset).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from broker.policy.rego_values import RegoNumber, rego_string

VERBS = frozenset("vsd")
_DIRECTIVE = re.compile(r"%(.?)", re.DOTALL)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Unsupported(ValueError):
    """A template outside the subset: the policy is refused (or, at run time, fails closed)."""


def check_template(template: str) -> None:
    """Raises ``Unsupported`` naming the first directive outside ``%v %s %d %%``."""
    for match in _DIRECTIVE.finditer(template):
        verb = match.group(1)
        if verb not in VERBS and verb != "%":
            shown = "%" + verb if verb else "a trailing %"
            raise Unsupported(
                f"sprintf template {template!r}: {shown} is not supported; use %v, %s, %d or %% "
                "without flags, width or precision (docs/policy.md)"
            )


@dataclass(frozen=True)
class _Arg:
    """One argument after OPA's conversion: its Go type and how each verb prints it."""

    go_type: str  # string | int64 | *big.Int | float64
    text: str  # the %v rendering
    kind: str  # "string" | "int" | "float"


def _convert(value: Any) -> _Arg:
    if isinstance(value, RegoNumber):
        if re.fullmatch(r"-?\d+", value.text):
            number = int(value.text)
            go_type = "int64" if INT64_MIN <= number <= INT64_MAX else "*big.Int"
            return _Arg(go_type, str(number), "int")
        return _Arg("float64", go_float(float(value.text)), "float")
    if isinstance(value, str):
        return _Arg("string", value, "string")
    return _Arg("string", rego_string(value), "string")


def _render(arg: _Arg, verb: str) -> str:
    if verb == "v":
        return arg.text
    if verb == "s" and (arg.kind == "string" or arg.go_type == "*big.Int"):
        return arg.text
    if verb == "d" and arg.kind == "int":
        return arg.text
    return f"%!{verb}({arg.go_type}={arg.text})"


def sprintf(template: str, values: list[Any]) -> str:
    """``sprintf(template, values)`` as OPA renders it, for templates inside the subset.

    Raises:
        Unsupported: a directive outside the subset.
    """
    check_template(template)
    args = [_convert(v) for v in values]
    out: list[str] = []
    used = position = 0
    for match in _DIRECTIVE.finditer(template):
        out.append(template[position : match.start()])
        position = match.end()
        verb = match.group(1)
        if verb == "%":
            out.append("%")
        elif used < len(args):
            out.append(_render(args[used], verb))
            used += 1
        else:
            out.append(f"%!{verb}(MISSING)")
    out.append(template[position:])
    if used < len(args):
        out.append("%!(EXTRA " + ", ".join(f"{a.go_type}={a.text}" for a in args[used:]) + ")")
    return "".join(out)


def go_float(value: float) -> str:
    """Go's ``%v`` of a float64: the shortest round-trip digits (Python's ``repr`` finds the
    same), in exponent form when the decimal exponent is below -4 or at least 6 (strconv's
    shortest ``%g``: "if precision was the shortest possible, use precision 6"), with at least
    two exponent digits (``1e+06``)."""
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    mantissa = repr(magnitude).partition("e")[0]
    digits = mantissa.replace(".", "").lstrip("0").rstrip("0") or "0"
    scientific = f"{magnitude:.{max(len(digits) - 1, 0)}e}"
    exponent = int(scientific.partition("e")[2])
    if exponent < -4 or exponent >= 6:
        coefficient, _, power = scientific.partition("e")
        return f"{sign}{coefficient}e{power[0]}{power[1:].lstrip('0').rjust(2, '0')}"
    return sign + f"{magnitude:.{max(len(digits) - 1 - exponent, 0)}f}"
