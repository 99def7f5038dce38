"""One spelling per host name, for guards that compare names (pure; no lookups).

A guard that compares host names as written is bypassed by another spelling of the same name:
``dev.invalid.`` (the trailing dot of a fully qualified name), ``DEV.INVALID``, full-width or
other Unicode forms that IDNA maps to the same A-label, ``127.000.000.001`` or ``0x7f.1`` for
``127.0.0.1``, ``[0:0::1]`` for ``::1``. ``normal_host`` gives every spelling one form, the
way resolvers and the WHATWG URL parser read them, so ``guard(normal_host(x))`` holds however
``x`` is spelled (``dev%2Einvalid`` too). A name that cannot be read raises ``ValueError``: the
guards built on it treat that as the cautious answer.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import unquote

# WHATWG URL "ends in a number": such a host is an IPv4 address or invalid, never a name.
_NUMBER = re.compile(r"^(0[xX][0-9a-fA-F]*|[0-9]+)$")
_MAX_HOST = 253


def normal_host(host: str) -> str:
    """``host`` percent-decoded, lower-cased, without its trailing dot, IDNA-encoded (A-labels),
    and an IP literal in its canonical form (IPv4 dotted quad, IPv6 compressed, brackets dropped).

    Raises:
        ValueError: empty, too long, an invalid label, or a number that is no IPv4 address.
    """
    try:  # a URL's host as the WHATWG parser reads it: percent-decoded
        text = unquote(host.strip(), errors="strict")
    except UnicodeError as exc:
        raise ValueError(f"not a host name: {host!r}") from exc
    if text.startswith("[") and text.endswith("]"):
        return str(ipaddress.IPv6Address(text[1:-1]))
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    try:
        # IDNA 2003 (the codec resolvers used) maps case, full-width letters and the
        # ideographic full stops to ASCII before the dot is trimmed.
        name = text.encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise ValueError(f"not a host name: {host!r}") from exc
    name = name.removesuffix(".")
    if not name or len(name) > _MAX_HOST or "" in name.split("."):
        raise ValueError(f"not a host name: {host!r}")
    if _NUMBER.match(name.rsplit(".", 1)[-1]):
        return str(_legacy_ipv4(name))
    return name


def _legacy_ipv4(name: str) -> ipaddress.IPv4Address:
    """The IPv4 address of a numeric host as ``inet_aton`` and the WHATWG URL parser read it:
    one to four parts, each decimal, octal (leading ``0``) or hex (``0x``); the last part fills
    the remaining bytes (``127.1`` is ``127.0.0.1``).

    Raises:
        ValueError: a part is not a number or out of range.
    """
    parts = name.split(".")
    if len(parts) > 4 or not all(_NUMBER.match(p) for p in parts):
        raise ValueError(f"not an IPv4 address: {name!r}")
    numbers = [_part(p) for p in parts]
    *leading, last = numbers
    if any(n > 255 for n in leading) or last >= 256 ** (5 - len(numbers)):
        raise ValueError(f"not an IPv4 address: {name!r}")
    value = last
    for index, number in enumerate(leading):
        value += number << (8 * (3 - index))
    return ipaddress.IPv4Address(value)


def _part(text: str) -> int:
    if text[:2].lower() == "0x":
        return int(text[2:] or "0", 16)
    if len(text) > 1 and text.startswith("0"):
        if not set(text) <= set("01234567"):
            raise ValueError(f"not an octal number: {text!r}")
        return int(text, 8)
    return int(text)


def is_loopback_host(host: str) -> bool:
    """True when ``host``, however spelled, names only this machine (``localhost`` or a
    loopback address); False for a name that cannot be read.
    """
    try:
        name = normal_host(host)
    except ValueError:
        return False
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def in_domain(host: str, domain: str) -> bool:
    """True when ``host``, however spelled, is ``domain`` or a name under it. A host that
    cannot be read is counted in (the cautious answer for a guard that refuses the domain).
    """
    try:
        name = normal_host(host)
    except ValueError:
        return True
    suffix = normal_host(domain)
    return name == suffix or name.endswith("." + suffix)
