"""The broker's attested identity on the command line: one set of flags, one check, one pin.

``broker audit monitor URL`` and ``broker keys create --url URL`` take ``--broker-image
sha256:…`` (repeatable) with ``--broker-jwks FILE`` (OIDC tokens) or ``--broker-root PEM`` (PKI
tokens), and ``--broker-audience`` / ``--broker-issuer``; ``broker verify broker`` reads the same
values from its own flags (``--image``, ``--jwks``, ``--root``, ``--audience``, ``--issuer``).
``broker_identity_from_args`` is the one place that turns them into a ``BrokerIdentity``.

With an identity, ``connect`` first runs the SDK's check (``client/broker_pin.attest_broker``:
one TLS connection, the checklist of ``client/broker_identity.py``, including that the
connection's server key is the attested TLS key), before any other request. Every later request
goes over a new connection whose certificate must be that very certificate (SHA-256 of its DER),
checked after the handshake and before a byte of the request is written; the certificate is
trusted through the pin alone, as ``aiohttp.Fingerprint`` does for the SDK. No redirect is
followed on a pinned connection, nor on any request that carries a token (``Authorization``).

``attested_log_key`` checks that the note verifier key the broker serves at ``GET /v1/log/key``
is the checkpoint key its attestation binds, comparing the Ed25519 public keys (the note key's
32 raw bytes against the attested SubjectPublicKeyInfo), not their text.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.client
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from broker.client.broker_identity import (
    GOOGLE_ISSUER,
    BrokerIdentity,
    BrokerNotAttested,
    VerifiedBrokerIdentity,
)
from broker.client.broker_pin import attest_broker
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.crypto.checkpoint import NoteError, NoteVerifier

MAX_ANSWER_BYTES = 1024 * 1024
LOG_KEY_PATH = "/v1/log/key"


class BrokerUnreachable(Exception):
    """The broker could not be reached (nothing was checked)."""


def add_broker_identity_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--broker-*`` flags (read by ``broker_identity_from_args``)."""
    parser.add_argument(
        "--broker-image",
        dest="broker_image",
        action="append",
        default=[],
        metavar="sha256:DIGEST",
        help="verify the broker's attestation first (its image is one of these, repeatable) "
        "and pin its attested TLS certificate for every request; needs --broker-jwks or "
        "--broker-root",
    )
    parser.add_argument(
        "--broker-jwks",
        dest="broker_jwks",
        type=Path,
        metavar="FILE",
        help="the attestation issuer's key set (OIDC tokens)",
    )
    parser.add_argument(
        "--broker-root",
        dest="broker_root",
        type=Path,
        metavar="PEM",
        help="the attestation issuer's root certificate (PKI tokens)",
    )
    parser.add_argument(
        "--broker-audience",
        dest="broker_audience",
        metavar="AUDIENCE",
        help="the audience of the broker's token ([sealed] token_audience)",
    )
    parser.add_argument(
        "--broker-issuer",
        dest="broker_issuer",
        metavar="ISSUER",
        help=f"the token issuer (default: {GOOGLE_ISSUER})",
    )
    parser.add_argument(
        "--broker-tls-trust",
        dest="broker_tls_trust",
        choices=("ca", "attestation"),
        default="ca",
        help="trust the broker's TLS certificate through a CA (default) or only through the "
        "attestation that binds its key (a sealed broker's own, self-signed certificate)",
    )


def broker_identity_from_args(
    args: argparse.Namespace, *, prefix: str = "broker_"
) -> BrokerIdentity | None:
    """The expected broker from ``--broker-image`` & co. (``prefix=""``: ``broker verify
    broker``'s ``--image`` & co.); ``None`` when no image is given.

    Raises:
        ConfigError: a trust anchor without an image, an image without a trust anchor, a
            malformed digest, or a file that cannot be read (naming the flag).
    """
    flag = "--" + prefix.replace("_", "-")
    images = list(getattr(args, prefix + "image", None) or [])
    jwks: Path | None = getattr(args, prefix + "jwks", None)
    root: Path | None = getattr(args, prefix + "root", None)
    audience: str | None = getattr(args, prefix + "audience", None)
    issuer: str | None = getattr(args, prefix + "issuer", None)
    if not images:
        given = [name for name, value in (("jwks", jwks), ("root", root)) if value is not None]
        trust = getattr(args, prefix + "tls_trust", None) or "ca"
        if prefix and (given or audience is not None or issuer is not None or trust != "ca"):
            raise ConfigError(f"{flag}image", "the broker's expected image digest is required")
        return None
    if jwks is None and root is None:
        raise ConfigError(
            f"{flag}jwks",
            f"{flag}jwks FILE (OIDC tokens) or {flag}root PEM (PKI tokens) is required",
        )
    try:
        return BrokerIdentity(
            image_digests=frozenset(images),
            jwks=_read(jwks, f"{flag}jwks").decode("utf-8") if jwks is not None else None,
            root_pem=_read(root, f"{flag}root") if root is not None else None,
            audience=audience,
            issuer=issuer or GOOGLE_ISSUER,
            tls_trust=getattr(args, prefix + "tls_trust", None) or "ca",
        )
    except (ValueError, UnicodeError) as exc:
        raise ConfigError(f"{flag}image", str(exc)) from exc


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {path}: {exc.strerror}") from exc


class PinMismatch(OSError):
    """A pinned connection met another certificate than the attested one (nothing was sent)."""


class _PinnedConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, *, pin: bytes, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self._pin = pin

    def connect(self) -> None:
        super().connect()  # the handshake: urllib writes the request only after this returns
        der = self.sock.getpeercert(binary_form=True)
        if der is None or hashlib.sha256(der).digest() != self._pin:
            self.sock.close()
            raise PinMismatch("the broker's certificate is not the attested one")


class _PinnedHandler(urllib.request.HTTPSHandler):
    def __init__(self, pin: bytes) -> None:
        context = ssl.create_default_context()  # trust comes from the pin (see the module)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        super().__init__(context=context)
        self._pin_context = context
        self._pin = pin

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        pin = self._pin

        def connection(host: str, **kwargs: Any) -> http.client.HTTPSConnection:
            return _PinnedConnection(host, pin=pin, **kwargs)

        return self.do_open(connection, req, context=self._pin_context)


@dataclass(frozen=True)
class BrokerConnection:
    """How a command reaches one broker: TLS checked against the CAs, or, once its attestation
    is verified (``verified``), only over its attested certificate."""

    url: str
    timeout: float
    context: ssl.SSLContext
    verified: VerifiedBrokerIdentity | None = None
    pin: bytes | None = None

    def open(
        self, path: str, *, data: bytes | None = None, headers: dict[str, str] | None = None
    ) -> http.client.HTTPResponse:
        """``GET`` (or ``POST`` with ``data``) ``path``; a context manager, as ``urlopen``'s.

        Raises:
            BrokerNotAttested: ``tls``, a pinned connection met another certificate.
            urllib.error.HTTPError: an answer that is not 2xx (a 3xx too, when pinned or
                when ``headers`` carry ``Authorization``: never followed).
            urllib.error.URLError, OSError: the broker was not reached.
        """
        request = urllib.request.Request(  # noqa: S310 - callers check the scheme
            self.url + path, data=data, headers=headers or {}
        )
        credentials = any(name.lower() == "authorization" for name in request.headers)
        if self.pin is None and not credentials:
            response: http.client.HTTPResponse = urllib.request.urlopen(  # noqa: S310
                request, context=self.context, timeout=self.timeout
            )
            return response
        # pinned, or carrying a token: no redirect (urllib would send the token on to wherever
        # it points, another host or plain HTTP included), no plain-HTTP handler
        tls = (
            urllib.request.HTTPSHandler(context=self.context)
            if self.pin is None
            else _PinnedHandler(self.pin)
        )
        opener = urllib.request.OpenerDirector()
        for handler in (
            urllib.request.ProxyHandler(),
            tls,
            urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPErrorProcessor(),
        ):
            opener.add_handler(handler)
        try:
            pinned: http.client.HTTPResponse = opener.open(request, timeout=self.timeout)
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, PinMismatch):
                raise BrokerNotAttested(
                    "tls",
                    "the broker's certificate is not the one its attestation was checked with",
                ) from exc
            raise
        return pinned


def connect(
    url: str, identity: BrokerIdentity | None, *, ca: Path | None, timeout: float
) -> BrokerConnection:
    """A connection to the broker at ``url`` (``https://``); with ``identity``, its attestation
    verified now, before anything else is asked of it.

    Raises:
        BrokerNotAttested: the attestation failed a check (``check`` names it).
        BrokerUnreachable: the broker could not be reached.
    """
    base = url.rstrip("/")
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if identity is None:
        return BrokerConnection(base, timeout, context)
    try:
        verified, fingerprint = asyncio.run(
            attest_broker(base, identity, context, now=datetime.now(UTC), timeout_seconds=timeout)
        )
    except (aiohttp.ClientError, ssl.SSLError, TimeoutError, OSError) as exc:
        raise BrokerUnreachable(f"{base} cannot be reached: {type(exc).__name__}: {exc}") from exc
    return BrokerConnection(base, timeout, context, verified, fingerprint.fingerprint)


def attested_log_key(broker: BrokerConnection) -> str | None:
    """The log's note verifier key (``GET /v1/log/key``), shown to be the checkpoint key the
    broker's attestation binds; ``None`` when the attestation binds none (a checkpoint key held
    in Cloud KMS: its binding cannot be checked here).

    Raises:
        BrokerNotAttested: ``checkpoint``, the served key is not the attested one (or none is
            served), or ``tls``.
        urllib.error.URLError, OSError: the broker was not reached.
    """
    if broker.verified is None:
        raise ValueError("attested_log_key needs a connection whose attestation was verified")
    bound = broker.verified.keys.get("checkpoint")
    if bound is None:
        return None
    try:
        with broker.open(LOG_KEY_PATH) as response:
            served = loads_bounded(response.read(MAX_ANSWER_BYTES))["verifier_key"]
        verifier = NoteVerifier.parse(str(served))
    except urllib.error.HTTPError as exc:
        exc.close()
        raise BrokerNotAttested(
            "checkpoint",
            f"the attestation binds a checkpoint key, but GET {LOG_KEY_PATH} is HTTP {exc.code}",
        ) from exc
    except (ValueError, KeyError, TypeError, NoteError) as exc:
        raise BrokerNotAttested(
            "checkpoint", f"GET {LOG_KEY_PATH} serves no note verifier key"
        ) from exc
    if not same_public_key(bound, verifier):
        raise BrokerNotAttested(
            "checkpoint",
            f"the log key served at {LOG_KEY_PATH} ({verifier.name}) is not the checkpoint key "
            "the broker's attestation binds",
        )
    return str(served).strip()


def same_public_key(spki: bytes, verifier: NoteVerifier) -> bool:
    """Whether an attested SubjectPublicKeyInfo is the Ed25519 key of a note verifier key."""
    try:
        key = serialization.load_der_public_key(spki)
    except ValueError:
        return False
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    return isinstance(key, ed25519.Ed25519PublicKey) and key.public_bytes(
        *raw
    ) == verifier.public.public_bytes(*raw)


def not_attested_line(exc: BrokerNotAttested) -> str:
    """The one stderr line every command prints for a refused broker."""
    return f"error: broker_not_attested: {exc.check}: {exc.reason}"
