"""PKCS#11 KEK: a non-extractable AES-256 key on an HSM token (SoftHSM2 in tests).

Addressed by an RFC 7512 URI::

    pkcs11:token=broker;object=kek?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/secrets/hsm-pin

Path attributes ``token`` and ``object`` (and optionally ``id``, hex) select the key; query
attributes ``module-path`` and ``pin-value`` or ``pin-source`` (``file:PATH``; preferred, so the
PIN stays out of the config file) open the session. Wrapping is CKM_AES_GCM with a 96-bit IV from
the token's RNG and the DEK's associated data; the wrapped form is
``0x02 || iv(12) || ciphertext || tag``. All PKCS#11 calls are blocking C calls: they run on one
dedicated thread that owns the session, and any failure is ``kek_unavailable``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import pkcs11
from pkcs11 import GCMParams, KeyType, Mechanism, ObjectClass

from broker.errors import ConfigError, ErrorCode, UpstreamError

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
    return Pkcs11Uri(attributes["token"], attributes["object"], key_id, Path(module), pin)


def _pairs(text: str, separator: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for part in filter(None, text.split(separator)):
        name, equals, value = part.partition("=")
        if not equals:
            raise ConfigError("keys.kek", f"pkcs11 URI attribute {name!r} has no value")
        pairs[unquote(name)] = unquote(value)
    return pairs


class Pkcs11Kek:
    """``KekProvider`` over an AES key on a PKCS#11 token."""

    def __init__(self, uri: Pkcs11Uri) -> None:
        self._uri = uri
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pkcs11")
        self._session: Any = None
        self._key: Any = None

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
        await self._run(self._open_sync)

    def _open_sync(self) -> None:
        lib = pkcs11.lib(str(self._uri.module_path))
        token = lib.get_token(token_label=self._uri.token)
        self._session = token.open(user_pin=self._uri.pin)
        search: Mapping[str, Any] = {"label": self._uri.object}
        if self._uri.key_id:
            search = {**search, "id": self._uri.key_id}
        key = self._session.get_key(
            key_type=KeyType.AES, object_class=ObjectClass.SECRET_KEY, **search
        )
        if key[pkcs11.Attribute.EXTRACTABLE] or not key[pkcs11.Attribute.SENSITIVE]:
            raise UpstreamError(
                "the PKCS#11 KEK must be sensitive and non-extractable",
                code=ErrorCode.KEK_UNAVAILABLE,
            )
        self._key = key

    async def close(self) -> None:
        if self._session is not None:
            await self._run(self._session.close)
            self._session = None
        self._executor.shutdown(wait=False)

    async def wrap(self, dek: bytes, aad: bytes) -> bytes:
        def encrypt() -> bytes:
            iv = bytes(self._session.generate_random(IV_BITS))
            sealed = self._key.encrypt(
                dek, mechanism=Mechanism.AES_GCM, mechanism_param=GCMParams(iv, aad, 128)
            )
            return FORMAT_V2 + iv + bytes(sealed)

        return await self._run(encrypt)

    async def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
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
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, work)
        except UpstreamError:
            raise
        except (pkcs11.PKCS11Error, RuntimeError, OSError) as exc:
            raise UpstreamError(
                f"the PKCS#11 KEK is unavailable ({type(exc).__name__})",
                code=ErrorCode.KEK_UNAVAILABLE,
            ) from exc


def create_pkcs11_kek(uri: Pkcs11Uri) -> str:
    """Generate the KEK on the token: AES-256, sensitive, non-extractable, persistent.

    Returns:
        A short, secret-free fingerprint of the new key's handle attributes.
    """
    lib = pkcs11.lib(str(uri.module_path))
    token = lib.get_token(token_label=uri.token)
    with token.open(user_pin=uri.pin, rw=True) as session:
        session.generate_key(
            KeyType.AES,
            256,
            label=uri.object,
            id=uri.key_id or b"",
            store=True,
            template={pkcs11.Attribute.SENSITIVE: True, pkcs11.Attribute.EXTRACTABLE: False},
        )
    return hashlib.sha256(uri.reference.encode()).hexdigest()[:16]
