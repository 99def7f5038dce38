"""PKCS#11 KEK: a non-extractable AES-256 key on an HSM token (SoftHSM2 in tests).

Addressed by an RFC 7512 URI::

    pkcs11:token=broker;object=kek?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/secrets/hsm-pin

Path attributes ``token`` and ``object`` (and optionally ``id``, hex) select the key; query
attributes ``module-path`` and ``pin-value`` or ``pin-source`` (``file:PATH``; preferred, so the
PIN stays out of the config file) open the session. Wrapping is CKM_AES_GCM with a 96-bit IV from
the token's RNG and the DEK's associated data; the wrapped form is
``0x02 || iv(12) || ciphertext || tag``.

``x-hsm-rewrap=true`` (a vendor query attribute, RFC 7512 §2.3) keeps DEKs inside the token
instead: made, stored and released there, never in this process in plaintext
(``pkcs11_rewrap.py``; the KEK is then a derive-only key made for it).

One session per token per process. PKCS#11 login state belongs to the application, not to a
session: a second ``C_Login`` on the same token fails with ``CKR_USER_ALREADY_LOGGED_IN``. So
every key on a token — the current KEK, ``kek_previous`` entries on the same token during a
rotation, and ``keys kek-create`` — shares one logged-in R/W session (``TokenSession``),
reference-counted, and one thread that makes every call on it (PKCS#11 calls block; sessions
are not to be used from two threads at once). Any failure is ``kek_unavailable``.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import pkcs11
from pkcs11 import GCMParams, KeyType, Mechanism, MechanismFlag, ObjectClass

from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.keys.kek.pkcs11_rewrap import (
    Pkcs11DekCustody,
    TokenSteps,
    check_custody_kek,
    probe_token,
)

T = TypeVar("T")
FORMAT_V2 = b"\x02"
IV_BITS = 96
IV_BYTES = IV_BITS // 8


@dataclass(frozen=True)
class Pkcs11Uri:
    token: str
    object: str
    key_id: bytes | None
    module_path: Path
    pin: str = field(repr=False)  # never in a log line or an error message
    hsm_rewrap: bool = False  # x-hsm-rewrap=true: DEKs stay in the token (pkcs11_rewrap.py)

    @property
    def reference(self) -> str:
        """Stable, secret-free name of the key (stored next to every DEK it wraps)."""
        ident = f";id={self.key_id.hex()}" if self.key_id else ""
        return f"pkcs11:token={self.token};object={self.object}{ident}"


def parse_pkcs11_uri(uri: str, *, read_pin: Callable[[Path], str] | None = None) -> Pkcs11Uri:
    """Parse an RFC 7512 PKCS#11 URI.

    Raises:
        ConfigError: ``keys.kek`` naming what is missing.
    """
    if not uri.startswith("pkcs11:"):
        raise ConfigError("keys.kek", "expected a pkcs11: URI")
    path, _, query = uri[len("pkcs11:") :].partition("?")
    attributes = _pairs(path, ";")
    options = _pairs(query, "&")
    for required in ("token", "object"):
        if not attributes.get(required):
            raise ConfigError("keys.kek", f"pkcs11 URI needs {required}=")
    module = options.get("module-path")
    if not module:
        raise ConfigError("keys.kek", "pkcs11 URI needs module-path=")
    pin = options.get("pin-value")
    source = options.get("pin-source")
    if pin is None and source:
        if not source.startswith("file:"):
            raise ConfigError("keys.kek", "pin-source must be file:PATH")
        reader = read_pin or (lambda p: p.read_text(encoding="utf-8").strip())
        try:
            pin = reader(Path(source.removeprefix("file:")))
        except OSError as exc:
            raise ConfigError("keys.kek", f"cannot read the PIN from {source}") from exc
    if not pin:
        raise ConfigError("keys.kek", "pkcs11 URI needs pin-value= or pin-source=file:PATH")
    try:
        key_id = bytes.fromhex(attributes["id"]) if attributes.get("id") else None
    except ValueError as exc:
        raise ConfigError("keys.kek", "pkcs11 id= must be hex") from exc
    rewrap = options.get("x-hsm-rewrap", "false")
    if rewrap not in ("true", "false"):
        raise ConfigError("keys.kek", "pkcs11 x-hsm-rewrap= must be true or false")
    return Pkcs11Uri(
        attributes["token"], attributes["object"], key_id, Path(module), pin, rewrap == "true"
    )


def _pairs(text: str, separator: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for part in filter(None, text.split(separator)):
        name, equals, value = part.partition("=")
        if not equals:
            raise ConfigError("keys.kek", f"pkcs11 URI attribute {name!r} has no value")
        pairs[unquote(name)] = unquote(value)
    return pairs


class TokenSession:
    """The one logged-in session of this process on one token, and the thread that uses it."""

    def __init__(self, uri: Pkcs11Uri) -> None:
        self.key = (str(uri.module_path), uri.token)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pkcs11")
        self.session: Any = None
        self.users = 0
        self.token_serial = ""

    def open_sync(self, uri: Pkcs11Uri) -> None:
        if self.session is None:
            token = pkcs11.lib(str(uri.module_path)).get_token(token_label=uri.token)
            self.session = token.open(user_pin=uri.pin, rw=True)
            self.token_serial = _text(token.serial)

    def close_sync(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


_SESSIONS: dict[tuple[str, str], TokenSession] = {}
_SESSIONS_LOCK = threading.Lock()


def acquire_session(uri: Pkcs11Uri) -> TokenSession:
    with _SESSIONS_LOCK:
        shared = _SESSIONS.get((str(uri.module_path), uri.token))
        if shared is None:
            shared = _SESSIONS[(str(uri.module_path), uri.token)] = TokenSession(uri)
        shared.users += 1
        return shared


def release_session(shared: TokenSession) -> bool:
    """Drop one user; True when it was the last (the caller then closes the session)."""
    with _SESSIONS_LOCK:
        shared.users -= 1
        if shared.users > 0:
            return False
        _SESSIONS.pop(shared.key, None)
        return True


async def leave_session(shared: TokenSession | None) -> None:
    """Drop one user of the token's session; the last one closes it (on its thread)."""
    if shared is not None and release_session(shared):
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(shared.executor, shared.close_sync)
        shared.executor.shutdown(wait=False)


def _text(value: Any) -> str:
    raw = bytes(value) if isinstance(value, bytes | bytearray) else str(value).encode()
    return raw.decode("ascii", "replace").strip()


def _find_key(session: Any, uri: Pkcs11Uri) -> Any:
    """The one secret key the URI names.

    Raises:
        ConfigError: none, or several (naming their ids: add ``id=`` to the URI).
    """
    search: dict[Any, Any] = {
        pkcs11.Attribute.LABEL: uri.object,
        pkcs11.Attribute.CLASS: ObjectClass.SECRET_KEY,
    }
    if uri.key_id:
        search[pkcs11.Attribute.ID] = uri.key_id
    found = list(session.get_objects(search))
    if not found:
        raise ConfigError("keys.kek", f"no key {uri.reference} on the token")
    if len(found) > 1:
        ids = ", ".join(sorted(bytes(o[pkcs11.Attribute.ID]).hex() or "(none)" for o in found))
        raise ConfigError(
            "keys.kek",
            f"{len(found)} keys match {uri.reference} (ids: {ids}); add id=<hex> to the URI",
        )
    return found[0]


def key_fingerprint(token_serial: str, key: Any) -> str:
    """Identifies the key *object*: token serial, CKA_ID and label (not the label alone)."""
    ident = bytes(key[pkcs11.Attribute.ID])
    label = str(key[pkcs11.Attribute.LABEL])
    material = f"{token_serial}\0{ident.hex()}\0{label}".encode()
    return hashlib.sha256(material).hexdigest()[:16]


class Pkcs11Kek:
    """``KekProvider`` over an AES key on a PKCS#11 token (with ``dek_custody`` in
    ``x-hsm-rewrap`` mode)."""

    def __init__(self, uri: Pkcs11Uri) -> None:
        self._uri = uri
        self._shared: TokenSession | None = None
        self._key: Any = None
        self._steps: TokenSteps | None = None  # x-hsm-rewrap: what the token does for DEKs

    @property
    def dek_custody(self) -> Pkcs11DekCustody | None:
        """The token keeping DEKs (``keys/custody.py``), in ``x-hsm-rewrap`` mode only."""
        return None if self._steps is None else Pkcs11DekCustody(self._steps, self._run)

    @property
    def reference(self) -> str:
        return self._uri.reference

    @property
    def development_only(self) -> bool:
        return False

    async def open(self) -> None:
        """Load the module, log in, find the key; it must be a sensitive, non-extractable AES key.

        Raises:
            UpstreamError: ``kek_unavailable`` when the token or key cannot be used.
        """
        self._shared = acquire_session(self._uri)
        try:
            await self._run(self._open_sync)
        except BaseException:
            await self.close()
            raise

    def _open_sync(self) -> None:
        assert self._shared is not None  # noqa: S101 - set by open()
        self._shared.open_sync(self._uri)
        key = _find_key(self._shared.session, self._uri)
        if key[pkcs11.Attribute.KEY_TYPE] != KeyType.AES:
            raise ConfigError("keys.kek", f"{self._uri.reference} is not an AES key")
        if key[pkcs11.Attribute.EXTRACTABLE] or not key[pkcs11.Attribute.SENSITIVE]:
            raise UpstreamError(
                "the PKCS#11 KEK must be sensitive and non-extractable",
                code=ErrorCode.KEK_UNAVAILABLE,
            )
        if self._uri.hsm_rewrap:
            check_custody_kek(self._uri.reference, key)
            token = "\0".join(self._shared.key)  # module path, token label
            self._steps = probe_token(self._shared.session, key, token)
        elif not (key[pkcs11.Attribute.ENCRYPT] and key[pkcs11.Attribute.DECRYPT]):
            raise ConfigError(
                "keys.kek",
                f"{self._uri.reference} cannot encrypt: a KEK made for x-hsm-rewrap needs "
                "x-hsm-rewrap=true on its URI",
            )
        self._key = key

    async def close(self) -> None:
        shared, self._shared, self._key, self._steps = self._shared, None, None, None
        await leave_session(shared)

    async def wrap(self, dek: bytes, aad: bytes) -> bytes:
        """Seal ``dek`` (in ``x-hsm-rewrap`` mode: a secret that is not a DEK in custody)."""
        steps = self._steps
        if steps is not None:
            return await self._run(lambda: steps.seal_secret_sync(dek, aad))

        def encrypt() -> bytes:
            assert self._shared is not None  # noqa: S101 - opened
            iv = bytes(self._shared.session.generate_random(IV_BITS))
            sealed = self._key.encrypt(
                dek, mechanism=Mechanism.AES_GCM, mechanism_param=GCMParams(iv, aad, 128)
            )
            return FORMAT_V2 + iv + bytes(sealed)

        return await self._run(encrypt)

    async def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        """Open what ``wrap`` sealed. A DEK in custody never opens here (``pkcs11_rewrap.py``)."""
        steps = self._steps
        if steps is not None:
            return await self._run(lambda: steps.open_secret_sync(wrapped, aad))
        if not wrapped.startswith(FORMAT_V2) or len(wrapped) < 1 + IV_BYTES + 16:
            raise UpstreamError("wrapped DEK is not a PKCS#11 wrap", code=ErrorCode.KEK_UNAVAILABLE)
        iv, body = wrapped[1 : 1 + IV_BYTES], wrapped[1 + IV_BYTES :]

        def decrypt() -> bytes:
            return bytes(
                self._key.decrypt(
                    body, mechanism=Mechanism.AES_GCM, mechanism_param=GCMParams(iv, aad, 128)
                )
            )

        return await self._run(decrypt)

    async def _run(self, work: Callable[[], T]) -> T:
        if self._shared is None:
            raise UpstreamError("the PKCS#11 KEK is closed", code=ErrorCode.KEK_UNAVAILABLE)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._shared.executor, work)
        except (UpstreamError, ConfigError):
            raise
        except (pkcs11.PKCS11Error, RuntimeError, OSError) as exc:
            raise UpstreamError(
                f"the PKCS#11 KEK is unavailable ({type(exc).__name__})",
                code=ErrorCode.KEK_UNAVAILABLE,
            ) from exc


def create_pkcs11_kek(uri: Pkcs11Uri) -> str:
    """Generate the KEK on the token: AES-256, sensitive, non-extractable, persistent (and
    derive-only for ``x-hsm-rewrap=true``).

    A key with the same label (and id, if the URI names one) must not exist: two would make
    every later lookup ambiguous. Without ``id=`` in the URI the key gets a random 16-byte
    CKA_ID, so that it can still be told apart from any key created later under the label.

    Returns:
        A fingerprint of the new key object (token serial, CKA_ID, label).

    Raises:
        ConfigError: a key with this label already exists (naming its ids).
        UpstreamError: ``kek_unavailable`` when the token cannot be used.
    """
    shared = acquire_session(uri)
    try:
        future = shared.executor.submit(_create_sync, shared, uri)
        return future.result()
    except pkcs11.PKCS11Error as exc:
        raise UpstreamError(
            f"the PKCS#11 token is unavailable ({type(exc).__name__})",
            code=ErrorCode.KEK_UNAVAILABLE,
        ) from exc
    finally:
        if release_session(shared):
            shared.executor.submit(shared.close_sync).result()
            shared.executor.shutdown(wait=False)


def _create_sync(shared: TokenSession, uri: Pkcs11Uri) -> str:
    shared.open_sync(uri)
    existing = list(
        shared.session.get_objects(
            {pkcs11.Attribute.LABEL: uri.object, pkcs11.Attribute.CLASS: ObjectClass.SECRET_KEY}
        )
    )
    if existing:
        ids = ", ".join(sorted(bytes(o[pkcs11.Attribute.ID]).hex() or "(none)" for o in existing))
        raise ConfigError(
            "keys.kek",
            f"a key labelled {uri.object!r} already exists on token {uri.token!r} (ids: {ids}); "
            "refusing to create a second one",
        )
    key = shared.session.generate_key(
        KeyType.AES,
        256,
        label=uri.object,
        id=uri.key_id or secrets.token_bytes(16),
        store=True,
        # x-hsm-rewrap: a key that only derives the per-version wrapping keys (pkcs11_rewrap.py)
        capabilities=MechanismFlag.DERIVE if uri.hsm_rewrap else None,
        template={pkcs11.Attribute.SENSITIVE: True, pkcs11.Attribute.EXTRACTABLE: False},
    )
    return key_fingerprint(shared.token_serial, key)
