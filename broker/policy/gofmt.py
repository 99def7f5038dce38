"""``sprintf`` for the Wasm engine, matching OPA's Go implementation to the character.

OPA's Wasm target leaves ``sprintf`` to the host. OPA's own (``topdown/strings.go``) converts
each argument, then calls Go's ``fmt.Sprintf``:

* a number: ``int64`` when its JSON text parses as one, else ``*big.Int`` when it parses as
  a base-10 integer, else ``float64``;
* a string: the Go string itself;
* anything else (boolean, null, array, object, set): the Rego term's ``String()`` text — arrays
  ``[1, "a"]``, objects ``{"a": 1}`` and sets ``{1, 2}`` in OPA's sort order, ``set()``,
  strings inside quoted as Go's ``strconv.Quote`` does.

So ``%s`` of a number is ``%!s(int64=5)``, ``%v`` of a fractional float is Go's shortest ``%g``
(``1.2345675e+06``), ``%d`` of a string is ``%!d(string=abc)`` — exactly what a policy author
sees from ``opa eval``. ``tests/unit/test_gofmt.py`` pins cases; the Wasm-vs-OPA differential
test checks them on generated inputs.

The host receives arguments as ``opa_value_dump`` text (Rego notation, which keeps sets apart
from arrays); ``parse_rego_value`` reads it.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_DEPTH = 64


@dataclass(frozen=True)
class RegoNumber:
    """A number as its JSON text (OPA keeps the text: ``1e2`` stays ``1e2`` inside terms)."""

    text: str


@dataclass(frozen=True)
class RegoSet:
    items: tuple[Any, ...]


# --- reading opa_value_dump text -------------------------------------------------------------

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("value nested too deeply")
        self._space()
        char = self.text[self.at : self.at + 1]
        if char == '"':
            return self._string()
        if char == "[":
            return self._items("]", depth)
        if char == "{":
            return self._brace(depth)
        for word, result in (("null", None), ("true", True), ("false", False)):
            if self.text.startswith(word, self.at):
                self.at += len(word)
                return result
        if self.text.startswith("set()", self.at):
            self.at += 5
            return RegoSet(())
        match = _NUMBER.match(self.text, self.at)
        if match is None:
            raise ValueError(f"unexpected {self.text[self.at : self.at + 10]!r}")
        self.at = match.end()
        return RegoNumber(match.group())

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\n\r":
            self.at += 1

    def _string(self) -> str:
        import json  # noqa: PLC0415 - JSON string escapes are the dump's escapes

        end = self.at + 1
        while True:
            end = self.text.index('"', end)
            backslashes = len(self.text[:end]) - len(self.text[:end].rstrip("\\"))
            if backslashes % 2 == 0:
                break
            end += 1
        raw = self.text[self.at : end + 1]
        self.at = end + 1
        return str(json.loads(raw))

    def _items(self, close: str, depth: int) -> list[Any]:
        self.at += 1
        items: list[Any] = []
        self._space()
        if self.text.startswith(close, self.at):
            self.at += 1
            return items
        while True:
            items.append(self.value(depth + 1))
            self._space()
            char = self.text[self.at : self.at + 1]
            self.at += 1
            if char == close:
                return items
            if char != ",":
                raise ValueError("expected , or " + close)

    def _brace(self, depth: int) -> Any:
        self.at += 1
        self._space()
        if self.text.startswith("}", self.at):
            self.at += 1
            return _Object(())  # `{}` is the empty object; the empty set dumps as set()
        first = self.value(depth + 1)
        self._space()
        if self.text.startswith(":", self.at):
            self.at += 1
            pairs = [(first, self.value(depth + 1))]
            while True:
                self._space()
                char = self.text[self.at : self.at + 1]
                self.at += 1
                if char == "}":
                    return _Object(tuple(pairs))
                if char != ",":
                    raise ValueError("expected , or }")
                key = self.value(depth + 1)
                self._space()
                if not self.text.startswith(":", self.at):
                    raise ValueError("expected :")
                self.at += 1
                pairs.append((key, self.value(depth + 1)))
        items = [first]
        while True:
            self._space()
            char = self.text[self.at : self.at + 1]
            self.at += 1
            if char == "}":
                return RegoSet(tuple(items))
            if char != ",":
                raise ValueError("expected , or }")
            items.append(self.value(depth + 1))


@dataclass(frozen=True)
class _Object:
    pairs: tuple[tuple[Any, Any], ...]


def parse_rego_value(text: str) -> Any:
    """Parse ``opa_value_dump`` output (JSON plus sets ``{a, b}``/``set()``, any object keys).

    Raises:
        ValueError: not such text.
    """
    reader = _Reader(text)
    value = reader.value()
    reader._space()
    if reader.at != len(reader.text):
        raise ValueError("trailing text")
    return value


# --- Rego term String() ----------------------------------------------------------------------

_TYPE_ORDER = {type(None): 0, bool: 1, RegoNumber: 2, str: 3, list: 6, _Object: 7, RegoSet: 8}


def _sort_key(value: Any) -> tuple[Any, ...]:
    rank = _TYPE_ORDER.get(type(value), 9)
    if isinstance(value, RegoNumber):
        return (rank, _numeric(value.text))
    if isinstance(value, bool | str):
        return (rank, value)
    if isinstance(value, list):
        return (rank, len(value) and 0, tuple(_sort_key(v) for v in value))
    return (rank, rego_string(value))


def _numeric(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        return float(text)


def rego_string(value: Any) -> str:  # noqa: PLR0911 - one return per kind of term
    """The Rego term's ``String()`` as OPA's Go code renders it."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, RegoNumber):
        return value.text
    if isinstance(value, str):
        return go_quote(value)
    if isinstance(value, list):
        return "[" + ", ".join(rego_string(v) for v in value) + "]"
    if isinstance(value, _Object):
        pairs = sorted(value.pairs, key=lambda pair: _sort_key(pair[0]))
        return "{" + ", ".join(f"{rego_string(k)}: {rego_string(v)}" for k, v in pairs) + "}"
    if isinstance(value, RegoSet):
        if not value.items:
            return "set()"
        return "{" + ", ".join(rego_string(v) for v in sorted(value.items, key=_sort_key)) + "}"
    raise TypeError(f"not a Rego value: {type(value).__name__}")


def go_quote(text: str) -> str:
    """Go's ``strconv.Quote``: printable runes as they are, others escaped."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif _go_printable(char):
            out.append(char)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append("\\ufffd")  # Go strings hold UTF-8; a lone surrogate is RuneError
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


_SHORT_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def _go_printable(char: str) -> bool:
    """Go's ``unicode.IsPrint``: letters, marks, numbers, punctuation, symbols, ASCII space."""
    if char == " ":
        return True
    category = unicodedata.category(char)
    return category[0] in "LMNPS"


# --- fmt.Sprintf ------------------------------------------------------------------------------

# Go reads any character after the flags, width and precision as the verb ("%!" included).
_VERB = re.compile(r"%([-+# 0]*)(\*|\d+)?(?:\.(\*|\d*))?(.?)", re.DOTALL)


@dataclass(frozen=True)
class _BigInt:
    value: int


def go_arg(value: Any) -> Any:
    """OPA's conversion of one ``sprintf`` argument before ``fmt.Sprintf``."""
    if isinstance(value, RegoNumber):
        text = value.text
        if re.fullmatch(r"-?\d+", text):
            number = int(text)
            return number if INT64_MIN <= number <= INT64_MAX else _BigInt(number)
        return float(text)
    if isinstance(value, str):
        return value
    return _RegoText(rego_string(value))


@dataclass(frozen=True)
class _RegoText:
    """A non-number, non-string term, already rendered; Go sees a ``string``."""

    text: str


def go_sprintf(template: str, values: list[Any]) -> str:
    """``fmt.Sprintf(template, args...)`` with OPA's argument conversion."""
    args = [go_arg(v) for v in values]
    out: list[str] = []
    used = 0
    position = 0
    for match in _VERB.finditer(template):
        out.append(template[position : match.start()])
        position = match.end()
        flags, width, precision, verb = match.groups()
        if not verb:
            out.append("%!(NOVERB)")
            continue
        if verb == "%" and not flags and width is None and precision is None:
            out.append("%")
            continue
        if width == "*" or precision == "*":
            out.append("%!(BADWIDTH)")
            continue
        if used >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        arg = args[used]
        used += 1
        out.append(_format(arg, flags, width, precision, verb))
    out.append(template[position:])
    if used < len(args):
        extra = ", ".join(f"{_go_type(a)}={_format(a, '', None, None, 'v')}" for a in args[used:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)


def _go_type(arg: Any) -> str:
    if isinstance(arg, bool):
        return "bool"
    if isinstance(arg, int):
        return "int64"  # OPA 1.x converts with Number.Int64()
    if isinstance(arg, _BigInt):
        return "*big.Int"
    if isinstance(arg, float):
        return "float64"
    return "string"


def _bad(verb: str, arg: Any) -> str:
    rendered = _format(arg, "", None, None, "v")
    return f"%!{verb}({_go_type(arg)}={rendered})"


def _pad(text: str, flags: str, width: str | None, *, numeric: bool = False) -> str:
    if width is None or len(text) >= int(width):
        return text
    size = int(width)
    if "-" in flags:
        return text.ljust(size)
    if "0" in flags and numeric:
        sign = text[0] if text[:1] in "+-" else ""
        return sign + text[len(sign) :].rjust(size - len(sign), "0")
    return text.rjust(size)


def _format(arg: Any, flags: str, width: str | None, precision: str | None, verb: str) -> str:
    if isinstance(arg, _RegoText | str):
        text = arg.text if isinstance(arg, _RegoText) else arg
        return _format_string(text, arg, flags=flags, width=width, precision=precision, verb=verb)
    if isinstance(arg, int | _BigInt):
        return _format_int(arg, flags, width, precision, verb)
    return _format_float(arg, flags, width, precision, verb)


def _format_string(
    text: str, arg: Any, *, flags: str, width: str | None, precision: str | None, verb: str
) -> str:
    if verb in "sv":
        if precision is not None:
            text = text[: int(precision or 0)]
        return _pad(text, flags, width)
    if verb == "q":
        return _pad(go_quote(text), flags, width)
    if verb in "xX":
        data = text.encode("utf-8", "surrogatepass")
        rendered = data.hex() if verb == "x" else data.hex().upper()
        return _pad(rendered, flags, width)
    return _bad(verb, arg)


def _format_int(
    arg: int | _BigInt, flags: str, width: str | None, precision: str | None, verb: str
) -> str:
    number = arg.value if isinstance(arg, _BigInt) else arg
    bases = {"d": 10, "v": 10, "b": 2, "o": 8, "O": 8, "x": 16, "X": 16}
    if isinstance(arg, _BigInt) and verb == "s":
        verb = "d"
    if verb not in bases and not (verb in "cqU" and isinstance(arg, int)):
        return _bad(verb, arg)
    if verb == "c":
        return _pad(chr(number) if 0 <= number <= 0x10FFFF else "\ufffd", flags, width)
    if verb == "q":
        return _pad("'" + go_quote(chr(number))[1:-1].replace("'", "\\'") + "'", flags, width)
    if verb == "U":
        return _pad(f"U+{number:04X}", flags, width)
    digits = _int_digits(abs(number), bases[verb], upper=verb == "X")
    if precision is not None:
        digits = digits.rjust(int(precision or 0), "0") if precision else (digits if number else "")
    prefix = ""
    if "#" in flags:
        prefix = {"x": "0x", "X": "0X", "o": "0", "b": "0b"}.get(verb, "")
    if verb == "O":
        prefix = "0o"
    sign = "-" if number < 0 else ("+" if "+" in flags else (" " if " " in flags else ""))
    return _pad(sign + prefix + digits, flags, width, numeric=precision is None)


def _int_digits(number: int, base: int, *, upper: bool) -> str:
    if base == 10:
        return str(number)
    text = {2: format(number, "b"), 8: format(number, "o"), 16: format(number, "x")}[base]
    return text.upper() if upper else text


def _format_float(
    value: float, flags: str, width: str | None, precision: str | None, verb: str
) -> str:
    if verb not in "vgGeEfF":
        return _bad(verb, value)
    digits = None if precision is None else int(precision or 0)
    if verb in "fF":
        text = f"{value:.{6 if digits is None else digits}f}"
    elif verb in "eE":
        text = _go_exponent(f"{value:.{6 if digits is None else digits}e}")
    else:
        text = _go_g(value, digits)
    if verb in "EG":
        text = text.upper()
    if value >= 0 and not math.copysign(1, value) < 0:
        text = ("+" if "+" in flags else (" " if " " in flags else "")) + text
    return _pad(text, flags, width, numeric=True)


def _go_exponent(text: str) -> str:
    """Python writes ``1e+06``; so does Go (at least two exponent digits)."""
    mantissa, _, exponent = text.partition("e")
    sign = exponent[0]
    return f"{mantissa}e{sign}{exponent[1:].lstrip('0').rjust(2, '0')}"


def _go_g(value: float, precision: int | None) -> str:
    """Go's ``%g``/``%v`` of a float64. Shortest (``%v``, ``%g``): the shortest round-trip digits
    (Python's ``repr`` finds the same), in exponent form when the decimal exponent is below -4
    or at least 6 (strconv: "if precision was the shortest possible, use precision 6")."""
    if value == 0:
        return "0"
    if precision is None:
        mantissa = repr(abs(value)).partition("e")[0]
        digits = mantissa.replace(".", "").lstrip("0").rstrip("0") or "0"
        exp10 = int(f"{abs(value):.{max(len(digits) - 1, 0)}e}".partition("e")[2])
        sign = "-" if value < 0 else ""
        if exp10 < -4 or exp10 >= 6:
            return sign + _go_exponent(f"{abs(value):.{max(len(digits) - 1, 0)}e}")
        return sign + f"{abs(value):.{max(len(digits) - 1 - exp10, 0)}f}"
    text = f"{value:.{max(precision, 1)}g}"
    return _go_exponent(text) if "e" in text else text
