"""Rego values as the Wasm host receives them, and their text as OPA renders terms.

The host gets arguments as ``opa_value_dump`` text (Rego notation, which keeps sets apart from
arrays and allows any object key); ``parse_rego_value`` reads it. ``rego_string`` is a term's
``String()`` as OPA's Go code writes it (arrays ``[1, "a"]``, objects ``{"a": 1}`` and sets
``{1, 2}`` in OPA's sort order, ``set()``, strings quoted as Go's ``strconv.Quote`` does): what
``sprintf`` shows for a value that is neither a number nor a string.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

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
            return RegoObject(())  # `{}` is the empty object; the empty set dumps as set()
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
                    return RegoObject(tuple(pairs))
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
class RegoObject:
    """An object whose keys may be any term (Rego allows non-string keys)."""

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

_TYPE_ORDER = {type(None): 0, bool: 1, RegoNumber: 2, str: 3, list: 6, RegoObject: 7, RegoSet: 8}


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
    if isinstance(value, RegoObject):
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
