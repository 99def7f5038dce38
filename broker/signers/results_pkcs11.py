"""Attestation results signed by an EC P-256 key on a PKCS#11 token (an HSM; SoftHSM2 in the
tests): ``[attest] signing_key = "pkcs11:token=broker;object=results?module-path=…&pin-source=
file:…"`` (RFC 7512, as for the KEK: ``keys/kek/pkcs11.py``).

The URI names a private key (``CKO_PRIVATE_KEY``, ``CKK_EC`` on P-256, sensitive and not
extractable) and the public key object of the same label (and ``id``), whose ``CKA_EC_POINT`` is
published at ``/.well-known/jwks.json``. The token signs the SHA-256 digest of each result with
``CKM_ECDSA`` (raw R || S); every signature is verified with the public half before it is used.
Calls share the token's one logged-in session and its thread with a PKCS#11 KEK on the same token.
Any failure is ``503 kek_unavailable``: no result is issued. The same signer holds ``[identity]
ca_key``, the workload-certificate CA's key (``role``: its errors then name that setting).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pkcs11
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, encode_dss_signature
from pkcs11 import KeyType, Mechanism, ObjectClass
from pkcs11.util.ec import encode_ec_public_key

from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.crypto.jwk import public_jwk, thumbprint
from broker.keys.kek.pkcs11 import (
    Pkcs11Uri,
    TokenSession,
    acquire_session,
    leave_session,
    parse_pkcs11_uri,
)
from broker.signers.results import RESULT_KEY, KeyRole, result_jwks


def _unavailable(role: KeyRole, message: str) -> UpstreamError:
    return UpstreamError(f"{role.name}: {message}", code=ErrorCode.KEK_UNAVAILABLE)


def parse_result_key(uri: str, role: KeyRole = RESULT_KEY) -> Pkcs11Uri:
    """The URI, its PIN read (``pin-source``: a file; call off the event loop).

    Raises: ConfigError naming ``role.setting``."""
    try:
        return parse_pkcs11_uri(uri)
    except ConfigError as exc:
        raise ConfigError(role.setting, exc.message) from exc


class Pkcs11ResultSigner:
    def __init__(self, uri: Pkcs11Uri, role: KeyRole = RESULT_KEY) -> None:
        self._uri = uri
        self._role = role
        self._shared: TokenSession | None = None
        self._private: Any = None
        self._public: ec.EllipticCurvePublicKey | None = None
        self.jwk: dict[str, str] = {}
        self.kid = ""

    async def open(self) -> None:
        """Log in (or join this process's session on the token) and find both halves.

        Raises:
            ConfigError: no such key pair, or not EC P-256 / extractable.
            UpstreamError: the token does not answer.
        """
        self._shared = acquire_session(self._uri)
        try:
            await self._run(self._open_sync)
        except pkcs11.PKCS11Error as exc:
            await self.close()
            raise _unavailable(self._role, "the token does not answer") from exc
        except BaseException:
            await self.close()
            raise

    def _open_sync(self) -> None:
        assert self._shared is not None  # noqa: S101 - set by open()
        self._shared.open_sync(self._uri)
        private = self._one(ObjectClass.PRIVATE_KEY)
        public = self._one(ObjectClass.PUBLIC_KEY)
        if private[pkcs11.Attribute.KEY_TYPE] != KeyType.EC:
            raise ConfigError(self._role.setting, f"{self._uri.reference} is not an EC key")
        if private[pkcs11.Attribute.EXTRACTABLE] or not private[pkcs11.Attribute.SENSITIVE]:
            raise ConfigError(
                self._role.setting, f"the {self._role.name} must be sensitive and non-extractable"
            )
        key = serialization.load_der_public_key(encode_ec_public_key(public))
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
            raise ConfigError(self._role.setting, f"{self._uri.reference} is not P-256")
        self._private, self._public = private, key
        self.jwk = public_jwk(key)
        self.kid = thumbprint(self.jwk)

    def _one(self, kind: ObjectClass) -> Any:
        assert self._shared is not None  # noqa: S101 - opened
        search: dict[Any, Any] = {
            pkcs11.Attribute.LABEL: self._uri.object,
            pkcs11.Attribute.CLASS: kind,
        }
        if self._uri.key_id:
            search[pkcs11.Attribute.ID] = self._uri.key_id
        found = list(self._shared.session.get_objects(search))
        if len(found) != 1:
            raise ConfigError(
                self._role.setting,
                f"{len(found)} {kind.name.lower()} objects match {self._uri.reference} "
                "(one is needed; add id=<hex> to the URI)",
            )
        return found[0]

    async def close(self) -> None:
        shared, self._shared, self._private = self._shared, None, None
        await leave_session(shared)

    def jwks(self) -> dict[str, Any]:
        return result_jwks(self.jwk, self.kid)

    async def sign(self, data: bytes) -> bytes:
        """R || S of ``data`` (ES256), made by the token.

        Raises:
            UpstreamError: ``kek_unavailable`` when the token fails or the signature does not
                verify with the public half.
        """
        if self._public is None or self._private is None:
            raise _unavailable(self._role, "not opened")
        digest = hashlib.sha256(data).digest()
        private = self._private

        def sign() -> bytes:
            return bytes(private.sign(digest, mechanism=Mechanism.ECDSA))

        try:
            raw: bytes = await self._run(sign)
        except pkcs11.PKCS11Error as exc:
            raise _unavailable(self._role, "the token did not sign") from exc
        if len(raw) != 64:
            raise _unavailable(self._role, "the token's ECDSA signature is not 64 bytes")
        der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
        try:
            self._public.verify(der, digest, ec.ECDSA(Prehashed(hashes.SHA256())))
        except InvalidSignature as exc:
            raise _unavailable(
                self._role, "the signature does not verify with the key's public half"
            ) from exc
        return raw

    async def _run(self, call: Any) -> Any:
        if self._shared is None:
            raise _unavailable(self._role, "not opened")
        return await asyncio.get_running_loop().run_in_executor(self._shared.executor, call)
