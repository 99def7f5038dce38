"""What a Confidential Containers guest sends the KBS facade, parsed at the boundary (docs/kbs.md).

The shapes are kbs-types 0.18's, as guest-components' ``kbs_protocol`` client (0.4.0) writes
them: ``Request`` (``version``, ``tee``, ``extra-params``), ``Attestation`` (kebab-case outer
members ``init-data``, ``runtime-data``, ``tee-evidence``; ``runtime-data`` is ``nonce`` and
``tee-pubkey``; ``tee-evidence`` is snake_case ``primary_evidence`` and ``additional_evidence``,
a string), and the resource path ``<repository>/<type>/<tag>``. Parsing is strict: an unknown
member, a missing one or a value of the wrong type is refused naming it (the guest sends none);
the evidence itself stays unverified (``unverified_evidence``). Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.core.errors import AttestationError, BrokerError, ErrorCode, InputError, NotFound
from broker.core.jsonsafe import loads_bounded
from broker.core.protocol import KBS_PATH_SEGMENT
from broker.crypto.jwk import thumbprint
from broker.crypto.kbs_jwe import parse_tee_pubkey as parse_tee_key
from broker.kbs.init_data import UnverifiedInitData, parse_init_data
from broker.kbs.wire import (
    DEFAULT_HASH_ALGORITHM,
    canonical_tee,
    version_refusal,
)
from broker.stores.nonces import MAX_NONCE_CHARS

HASH_ALGORITHM = DEFAULT_HASH_ALGORITHM  # the report data's hash: the guest's default
SEGMENT = re.compile(KBS_PATH_SEGMENT)  # one part of a resource path
MAX_SHOWN = 64  # characters of a guest's string a record or an answer repeats


@dataclass(frozen=True)
class KbsArrival:
    """One request as the handler read it, unverified: the body (``None`` for a GET) or why it
    could not be read, the session cookie, ``Authorization`` and the resource path."""

    body: bytes | None = None
    unreadable: BrokerError | None = None  # too large, too slow, not JSON media
    cookie: str | None = None
    authorization: str | None = None
    path: str | None = None
    query: str = ""


@dataclass(frozen=True)
class AuthRequest:
    version: str
    tee: str


@dataclass(frozen=True)
class TeePubKey:
    """The guest's ``tee-pubkey``: its JWK as sent (answers are sealed to it) and its RFC 7638
    thumbprint."""

    jwk: Mapping[str, str]
    thumbprint: str


@dataclass(frozen=True)
class AttestRequest:
    nonce: str
    tee_pubkey: TeePubKey
    unverified_evidence: Mapping[str, Any]  # ``primary_evidence``
    additional_evidence: str
    unverified_init_data: UnverifiedInitData | None  # bound to the evidence only once verified


@dataclass(frozen=True)
class ResourcePath:
    repository: str
    type: str
    tag: str

    def __str__(self) -> str:
        return f"{self.repository}/{self.type}/{self.tag}"


def shown(value: Any) -> str | None:
    """A guest's string as a record or an answer repeats it: printable, at most ``MAX_SHOWN``
    characters, else ``None`` (a hostile value is not copied anywhere)."""
    if isinstance(value, str) and len(value) <= MAX_SHOWN and value.isprintable():
        return value
    return None


def json_object(
    arrival: KbsArrival, members: frozenset[str], optional: frozenset[str]
) -> dict[str, Any]:
    """The body as a JSON object with exactly ``members`` (and any of ``optional``).

    Raises:
        BrokerError: the reason the body could not be read; ``malformed_json``; ``bad_request``.
    """
    if arrival.unreadable is not None:
        raise arrival.unreadable
    try:
        body = loads_bounded(arrival.body or b"")
    except ValueError as exc:
        raise InputError("request body is not valid JSON", code=ErrorCode.MALFORMED_JSON) from exc
    return _members(body, "request body", members, optional)


def parse_auth(arrival: KbsArrival) -> AuthRequest:
    """``Request``: ``version`` ``0.4.0`` as Trustee's semver requirement admits it (else 401 in
    Trustee's words, ``wire.version_refusal``), ``tee`` a kbs-types name (``nvidiadpu`` read as
    ``nvidia-dpu``), ``extra-params`` an object, ``""`` or absent.

    Raises:
        InputError: ``bad_request``, ``malformed_json``; AttestationError:
            ``kbs_version_mismatch``.
    """
    body = json_object(arrival, frozenset({"version", "tee"}), frozenset({"extra-params"}))
    version = body["version"]
    if not isinstance(version, str):
        raise InputError("version must be a string")
    refusal = version_refusal(version)
    if refusal is not None:  # Trustee's words, the guest's version echoed only when printable
        raise AttestationError(
            refusal if shown(version) == version else version_refusal("(unprintable)") or "",
            code=ErrorCode.KBS_VERSION_MISMATCH,
        )
    tee = canonical_tee(body["tee"]) if isinstance(body["tee"], str) else None
    if tee is None:
        raise InputError("tee must be one of the KBS protocol's TEE names")
    extra = body.get("extra-params", "")
    if extra not in ("", None) and not isinstance(extra, dict):
        raise InputError("extra-params must be an object")
    return AuthRequest(version, tee)


def parse_attest(arrival: KbsArrival) -> AttestRequest:
    """``Attestation``, member by member (the module's docstring).

    Raises:
        InputError: ``bad_request``, ``malformed_json``, ``tee_pubkey_*``.
    """
    body = json_object(
        arrival, frozenset({"runtime-data", "tee-evidence"}), frozenset({"init-data"})
    )
    runtime = _members(body["runtime-data"], "runtime-data", frozenset({"nonce", "tee-pubkey"}))
    evidence = _members(
        body["tee-evidence"],
        "tee-evidence",
        frozenset({"primary_evidence", "additional_evidence"}),
    )
    nonce = runtime["nonce"]
    if not isinstance(nonce, str) or not 0 < len(nonce) <= MAX_NONCE_CHARS or not _unicode(nonce):
        raise InputError(f"runtime-data.nonce must be a string of 1 to {MAX_NONCE_CHARS}")
    primary, additional = evidence["primary_evidence"], evidence["additional_evidence"]
    if not isinstance(primary, dict):
        raise InputError("tee-evidence.primary_evidence must be an object")
    if not isinstance(additional, str):
        raise InputError("tee-evidence.additional_evidence must be a string")
    if not _unicode(additional):  # the report data hashes its UTF-8 (JCS): it must have one
        raise InputError("tee-evidence.additional_evidence holds a lone surrogate (not Unicode)")
    return AttestRequest(
        nonce=nonce,
        tee_pubkey=parse_tee_pubkey(runtime["tee-pubkey"]),
        unverified_evidence=primary,
        additional_evidence=additional,
        unverified_init_data=parse_init_data(body.get("init-data")),
    )


def parse_tee_pubkey(unverified: Any) -> TeePubKey:
    """The guest's key (``crypto/kbs_jwe.parse_tee_pubkey``: EC P-256 or P-521 for
    ``ECDH-ES+A256KW``, RSA 2048 to 4096 bits for ``RSA-OAEP-256``, the point on its curve,
    public members only), kept as kbs-types' ``TeePubKey`` keeps it, with its thumbprint.

    Raises:
        InputError: ``tee_pubkey_unsupported``, ``tee_pubkey_invalid``.
    """
    members = dict(parse_tee_key(unverified).members)
    names = ("crv", "kty", "x", "y") if members["kty"] == "EC" else ("e", "kty", "n")
    return TeePubKey(jwk=members, thumbprint=thumbprint({n: members[n] for n in names}))


def parse_resource_path(path: str | None, query: str) -> ResourcePath:
    """``<repository>/<type>/<tag>``, each part a short name (``SEGMENT``), no query.

    Raises:
        NotFound: ``kbs_resource_not_found`` (Trustee answers 404 for a path it cannot read).
    """
    parts = (path or "").split("/")
    if query or len(parts) != 3 or not all(SEGMENT.fullmatch(p) for p in parts):
        raise NotFound(
            "a resource is addressed as <repository>/<type>/<tag> (short names, no query)",
            code=ErrorCode.KBS_RESOURCE_NOT_FOUND,
        )
    return ResourcePath(*parts)


def _members(
    value: Any, where: str, members: frozenset[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InputError(f"{where} must be a JSON object")
    unknown = sorted(set(value) - members - optional)
    if unknown:
        names = ", ".join(shown(n) or "<unprintable or long>" for n in unknown[:5])
        raise InputError(f"{where}: unknown members: {names}")
    missing = sorted(members - set(value))
    if missing:
        raise InputError(f"{where}: missing members: {', '.join(missing)}")
    return value


def _unicode(text: str) -> bool:
    """``text`` has a UTF-8 form (JSON's ``"\\ud800"`` parses to a lone surrogate: it has none)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
