"""The broker's own attestation, bound to its keys: ``GET /.well-known/broker-attestation``.

With ``[sealed] launcher_socket`` set, the broker asks the Confidential Space launcher
(``POST /v1/token`` over its Unix socket: custom audience, ``token_type`` OIDC, nonces) for a
token whose ``eat_nonce`` holds the lowercase hex SHA-256 of each public key it serves with
(SubjectPublicKeyInfo DER): the TLS certificate's key, the query-statement key, and the
checkpoint and attestation-result keys when they are local PEM files. The token is renewed in
the background before it expires; a renewal that fails is logged and the old token keeps being
served until its ``exp``, after which the endpoint says the broker is not attested.

A launcher that does not answer at start-up stops the broker (``ConfigError``: it was configured
to be sealed, so it fails closed). Without ``[sealed]`` the endpoint answers ``attested: false``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes

from broker.api.services import CLOCK
from broker.client.tokens import ConfidentialSpaceTokenSource, TokenSourceError
from broker.config import Settings
from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import ConfigError
from broker.core.refs import LocalFileRef
from broker.crypto.keyfiles import private_key_file

log = logging.getLogger(__name__)

MIN_RENEW_SECONDS = 1.0  # never ask the launcher more often than this
RETRY_SECONDS = 5.0  # after a failed renewal, at most this long before the next try
NOT_IN_TEE = "this broker is not running in a Confidential Space TEE"
Clock = Callable[[], datetime]


class LauncherError(Exception):
    """The launcher did not answer with a token."""


@dataclass(frozen=True)
class BoundKeys:
    """The broker's public keys the token binds, as SubjectPublicKeyInfo DER, by role."""

    spki: dict[str, bytes]

    def nonces(self) -> list[str]:
        """The token's nonces: the lowercase hex SHA-256 of each key's SPKI DER."""
        return [hashlib.sha256(der).hexdigest() for der in self.spki.values()]

    def published(self) -> dict[str, str]:
        """``keys`` of the published document: base64url of each SPKI DER."""
        return {role: b64url_encode(der) for role, der in self.spki.items()}


def spki_der(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def collect_keys(settings: Settings) -> BoundKeys:
    """The keys this broker serves with that exist and are local (blocking file reads: call it
    in a thread). Keys held by Cloud KMS or an HSM are not bound here.

    Raises:
        ConfigError: a key file that cannot be read, or no TLS certificate.
    """
    server = settings.server
    if server.tls_cert is None:
        raise ConfigError("sealed.launcher_socket", "an attested broker needs [server] tls_cert")
    try:
        certificate = x509.load_pem_x509_certificates(server.tls_cert.read_bytes())[0]
    except (OSError, ValueError, IndexError) as exc:
        raise ConfigError("server.tls_cert", f"not a readable PEM certificate: {exc}") from exc
    spki = {"tls": spki_der(certificate.public_key())}
    if settings.keys.signing_key is not None:
        spki["statement"] = _public_der(settings.keys.signing_key, "keys.signing_key")
    if isinstance(settings.audit.signing_ref, LocalFileRef):
        spki["checkpoint"] = _public_der(settings.audit.signing_ref.path, "audit.signing_key")
    if settings.attest.enabled and isinstance(settings.attest.signing_ref, LocalFileRef):
        spki["result"] = _public_der(settings.attest.signing_ref.path, "attest.signing_key")
    return BoundKeys(spki)


def _public_der(path: Path, setting: str) -> bytes:
    return spki_der(private_key_file(path, setting).public_key())


async def launcher_token(
    socket_path: Path, *, audience: str, nonces: list[str], timeout_seconds: float
) -> str:
    """One token from the launcher (the SDK's client of its ``POST /v1/token``).

    Raises:
        LauncherError: no answer, a non-200 answer, or a body that is not a token.
    """
    source = ConfidentialSpaceTokenSource(str(socket_path), timeout_seconds=timeout_seconds)
    try:
        token = await source.token(audience, nonces)
    except TokenSourceError as exc:
        cause = exc.__cause__
        if isinstance(cause, aiohttp.ClientConnectorError):  # one readable line at start-up
            reason = cause.os_error.strerror or type(cause.os_error).__name__
            raise LauncherError(f"the launcher at {socket_path} did not answer ({reason})") from exc
        raise LauncherError(f"the launcher at {socket_path} failed: {exc}") from exc
    except TimeoutError as exc:
        raise LauncherError(f"the launcher at {socket_path} did not answer in time") from exc
    if token.count(".") != 2:
        raise LauncherError("the launcher's answer is not a JWT")
    return token


def unverified_expiry(token: str) -> datetime:
    """The ``exp`` claim of our own token, read without verifying it: it only schedules the
    renewal and says when to stop serving the token; clients verify the token themselves.

    Raises:
        LauncherError: a token without a numeric ``exp``.
    """
    try:
        claims = json.loads(b64url_decode(token.split(".")[1]))
        return datetime.fromtimestamp(int(claims["exp"]), UTC)
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as exc:
        raise LauncherError("the launcher's token has no readable exp claim") from exc


@dataclass(frozen=True)
class _Current:
    token: str
    expires: datetime
    body: bytes  # the published document, rendered once per token


class SelfAttestation:
    """The current token and the document published for it; ``run`` renews it."""

    def __init__(self, settings: Settings, keys: BoundKeys, clock: Clock) -> None:
        sealed = settings.sealed
        if sealed.launcher_socket is None:
            raise ValueError("SelfAttestation needs [sealed] launcher_socket")
        self._socket = sealed.launcher_socket
        self._audience = sealed.token_audience
        self._renew = timedelta(seconds=sealed.renew_seconds)
        self._timeout = sealed.timeout_seconds
        self._keys = keys
        self._clock = clock
        self._current: _Current | None = None

    async def start(self) -> None:
        """The first token, before the broker serves anything.

        Raises:
            ConfigError: the launcher does not answer (fail closed).
        """
        try:
            await self._fetch()
        except LauncherError as exc:
            raise ConfigError("sealed.launcher_socket", str(exc)) from exc

    async def _fetch(self) -> None:
        token = await launcher_token(
            self._socket,
            audience=self._audience,
            nonces=self._keys.nonces(),
            timeout_seconds=self._timeout,
        )
        expires = unverified_expiry(token)
        document = {
            "attested": True,
            "token": token,
            "token_type": "OIDC",
            "keys": self._keys.published(),
            "expires": expires.isoformat().replace("+00:00", "Z"),
        }
        self._current = _Current(token, expires, json.dumps(document).encode())

    def _renew_in(self, now: datetime) -> float:
        """Seconds until the renewal: ``renew_seconds`` before exp, at most half-way there."""
        if self._current is None:
            return MIN_RENEW_SECONDS
        left = (self._current.expires - now).total_seconds()
        return max(MIN_RENEW_SECONDS, left - min(self._renew.total_seconds(), left / 2))

    async def run(self) -> None:
        """Renew before expiry, forever (a background task); a failure is logged and retried
        while the old token keeps serving."""
        while True:
            await asyncio.sleep(self._renew_in(self._clock()))
            try:
                await self._fetch()
            except LauncherError as exc:
                log.error("broker attestation not renewed: %s", exc)  # noqa: TRY400 - one line
                await asyncio.sleep(RETRY_SECONDS)

    def expired(self, now: datetime) -> bool:
        return self._current is None or now >= self._current.expires

    def document(self, now: datetime) -> bytes:
        """The published document at ``now`` (one clock reading per request)."""
        current = self._current
        if current is None or now >= current.expires:
            reason = "the broker's attestation token expired and could not be renewed"
            return json.dumps({"attested": False, "reason": reason}).encode()
        return current.body


NOT_ATTESTED = json.dumps({"attested": False, "reason": NOT_IN_TEE}).encode()
SELF_ATTESTATION = web.AppKey("self_attestation", SelfAttestation)  # set only when sealed


async def open_self_attestation(settings: Settings, clock: Clock) -> SelfAttestation | None:
    """The started self-attestation when ``[sealed] launcher_socket`` is set, else ``None``.

    Raises:
        ConfigError: a key that cannot be read, or a launcher that does not answer.
    """
    if settings.sealed.launcher_socket is None:
        return None
    keys = await asyncio.to_thread(collect_keys, settings)
    attestation = SelfAttestation(settings, keys, clock)
    await attestation.start()
    log.info(
        "broker attested through %s: keys %s", settings.sealed.launcher_socket, sorted(keys.spki)
    )
    return attestation


async def broker_attestation(request: web.Request) -> web.Response:
    """``GET /.well-known/broker-attestation``: the token and the keys it binds (docs/api.md)."""
    attestation = request.app.get(SELF_ATTESTATION)
    body = NOT_ATTESTED if attestation is None else attestation.document(request.app[CLOCK]())
    return web.Response(
        body=body,
        content_type="application/json",
        headers={"Cache-Control": "public, max-age=60"},
    )
