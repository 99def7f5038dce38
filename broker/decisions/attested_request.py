"""A release on an attestation result as the request presents it (issue 19, issue 27): the
body's keys, the ``Authorization: DPoP <EAR>`` token, the ``DPoP`` proof and the ``Host`` header,
all untrusted, parsed or refused here before ``attested_release.py`` verifies anything."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from broker.core.errors import AttestationError, ErrorCode, InputError
from broker.core.fields import optional_version
from broker.crypto.wrap import WRAP_MODES
from broker.keys.service import MAX_KEY_NAME, validate_key_name

MAX_KEYS = 16
ATTESTED_FIELDS = ("keys",)
ATTESTED_OPTIONAL = ("wrap",)
SCHEME = "DPoP"
MAX_AUTHORIZATION_CHARS = 8 * 1024
MAX_HOST_CHARS = 300  # a DNS name (253) and a port
RELEASE_PATH = "/v1/release"  # the route a proof's htu names, after a configured public URL


@dataclass(frozen=True)
class KeyAsk:
    key: str
    version: int | None = None


@dataclass(frozen=True)
class AttestedRequest:
    keys: tuple[KeyAsk, ...]
    wrap: str = "jwe"


def parse_attested_request(unverified_body: Mapping[str, Any]) -> AttestedRequest:
    """``{"keys": ["name" | {"key": "name", "version": n}, …], "wrap"?}``.

    Raises:
        InputError: ``bad_request`` naming the field.
    """
    keys = unverified_body.get("keys")
    if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS:
        raise InputError(f"keys must be a list of 1..{MAX_KEYS} key names")
    asks: list[KeyAsk] = []
    for item in keys:
        if isinstance(item, str):
            asks.append(KeyAsk(validate_key_name(_bounded(item))))
        elif isinstance(item, Mapping) and set(item) <= {"key", "version"}:
            name = item.get("key")
            if not isinstance(name, str):
                raise InputError("each key must be a name or {key, version}")
            asks.append(KeyAsk(validate_key_name(_bounded(name)), optional_version(item)))
        else:
            raise InputError("each key must be a name or {key, version}")
    if len(set(asks)) != len(asks):
        raise InputError("a key is listed twice")
    wrap = unverified_body.get("wrap", "jwe")
    if not isinstance(wrap, str) or wrap not in WRAP_MODES:
        raise InputError(f"wrap must be one of {', '.join(WRAP_MODES)}")
    return AttestedRequest(tuple(asks), wrap)


def _bounded(name: str) -> str:
    if len(name) > MAX_KEY_NAME:
        raise InputError(f"a key name is longer than {MAX_KEY_NAME} characters")
    return name


def presented_token(authorization: str | None) -> str:
    """The EAR in ``Authorization: DPoP <EAR>``.

    Raises:
        AttestationError: no such header, another scheme, or not one token.
    """
    if not authorization or len(authorization) > MAX_AUTHORIZATION_CHARS:
        raise AttestationError("Authorization: DPoP <attestation result> is required")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != SCHEME.lower() or not token or " " in token.strip():
        raise AttestationError("Authorization must be: DPoP <attestation result>")
    return token.strip()


@dataclass(frozen=True)
class Presented:
    """What the request's headers present (all untrusted): ``Authorization``, ``DPoP`` and
    ``Host`` (checked for syntax only: a proof's ``htu`` is compared with the configured public
    URLs, never with a URL built from it)."""

    authorization: str | None
    proof: str | None
    host: str | None = None


# A plan on an attestation result reads, unverified: the JSON body, and what the headers present.
Unverified = tuple[Mapping[str, Any], Presented]


def check_host(host: str | None) -> None:
    """A ``Host`` header must be ``host[:port]`` (RFC 9112 §3.2, RFC 3986 §3.2.2): printable
    ASCII, a port of at most 65535. It decides nothing here; a malformed one is still refused
    with 400, and recorded, rather than reaching code that might build a URL from it.

    Raises:
        InputError: ``host_invalid``.
    """
    if host is None:
        return
    problem = not host or len(host) > MAX_HOST_CHARS or not host.isascii()
    problem = problem or not host.isprintable() or any(c in host for c in "/?#@,\\ ")
    if not problem:
        try:
            parts = urlsplit("//" + host)
            _ = parts.port  # raises when out of range or not a number
            problem = not parts.hostname
        except ValueError:  # a port out of range or not a number
            problem = True
    if problem:
        raise InputError("the Host header is not a host[:port]", code=ErrorCode.HOST_INVALID)
