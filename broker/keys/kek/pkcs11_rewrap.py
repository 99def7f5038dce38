"""DEKs kept inside the PKCS#11 token: ``pkcs11:…?…&x-hsm-rewrap=true`` (docs/keys.md).

With this mode an AES-256 DEK exists in plaintext only inside the token. It is made there
(``C_GenerateKey``), stored wrapped under the KEK (``C_WrapKey``), and on a release unwrapped
into a session object (``C_UnwrapKey``, sensitive: ``CKA_VALUE`` cannot be read), wrapped to the
runner's RSA key (``C_WrapKey``, ``CKM_RSA_PKCS_OAEP``) and used to encrypt the release statement
(``C_Encrypt``, ``CKM_AES_GCM``): the ``jwe-cek`` JWE of ``crypto/jwe_cek.py``. Every session
object is destroyed before the call returns. No method here returns a DEK.

Formats, and why (measured on SoftHSM2 2.6.1, docs/keys.md "What the token cannot do"):

* ``C_WrapKey``/``C_UnwrapKey`` with ``CKM_AES_GCM`` is ``CKR_MECHANISM_INVALID``, so a DEK in
  custody is wrapped with ``CKM_AES_KEY_WRAP_PAD`` (RFC 5649), which takes no associated data.
  The key name and version stay bound by the wrapping key instead: each DEK is wrapped under
  ``K(aad) = C_DeriveKey(KEK, CKM_AES_ECB_ENCRYPT_DATA, SHA-256(label || 0 || aad))``, an
  AES-256 session key (two AES blocks of the KEK over a hash of ``dek_aad(name, version)``). A
  wrapped DEK copied onto another version's record derives another key, and RFC 5649's integrity
  check refuses it, as AES-GCM's tag refused it before. Custody form: ``0x03 || KWP(K, DEK)``.
* The KEK only derives (``CKA_DERIVE``; encrypt, decrypt, wrap and unwrap off): one key, one use.
  Secrets that are not DEKs (query keys' HPKE private keys, the sealed broker's own keys) are
  sealed as ``0x04 || iv || AES-GCM(K'(aad), secret, aad)`` under a key derived with another label
  (``KekProvider.wrap``/``unwrap``); a DEK's wrap never opens as a secret, whatever its first byte.
* ``CKM_RSA_PKCS_OAEP`` with SHA-256 parameters is ``CKR_ARGUMENTS_BAD`` on SoftHSM2 2.6.1; at
  start-up the token is asked once (a throwaway key, checked by decrypting in software) and the
  runner's key is wrapped with SHA-256 (``RSA-OAEP-256``) where it can, SHA-1 (``RSA-OAEP``)
  where it cannot.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pkcs11
from cryptography.hazmat.primitives.asymmetric import rsa
from pkcs11 import GCMParams, KeyType, Mechanism, MechanismFlag, ObjectClass
from pkcs11.mechanisms import MGF

from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.crypto import jwe_cek

log = logging.getLogger(__name__)

FORMAT_CUSTODY = b"\x03"
FORMAT_SECRET = b"\x04"
KWP_DEK_BYTES = 40  # RFC 5649 of a 32-byte key: 8-byte integrity block + 32
DEK_LABEL = b"broker-dek-wrap/v1"
SECRET_LABEL = b"broker-secret/v1"
IV_BYTES = 12
OAEP_PARAMS = {
    jwe_cek.RSA_OAEP_256: (Mechanism.SHA256, MGF.SHA256, None),
    jwe_cek.RSA_OAEP: (Mechanism.SHA_1, MGF.SHA1, None),
}
DEK_TEMPLATE = {  # a DEK session object: never readable, wrappable (to the KEK, to the runner)
    pkcs11.Attribute.TOKEN: False,
    pkcs11.Attribute.SENSITIVE: True,
    pkcs11.Attribute.EXTRACTABLE: True,
}
SESSION_KEY = {
    pkcs11.Attribute.TOKEN: False,
    pkcs11.Attribute.SENSITIVE: True,
    pkcs11.Attribute.EXTRACTABLE: False,
}


T = TypeVar("T")
Run = Callable[[Callable[[], T]], Awaitable[T]]


def custody_refused(message: str) -> UpstreamError:
    return UpstreamError(message, code=ErrorCode.KEK_UNAVAILABLE)


class Pkcs11DekCustody:
    """The ``DekCustody`` port (``keys/custody.py``) of a KEK opened with ``x-hsm-rewrap``:
    each call runs its ``TokenSteps`` on the token's one thread (``run``: the KEK's)."""

    def __init__(self, steps: TokenSteps, run: Run[Any]) -> None:
        self._steps = steps
        self._run = run

    @property
    def token(self) -> str:
        return self._steps.token

    @property
    def runner_alg(self) -> str:
        return self._steps.runner_alg

    async def generate(self, aad: bytes) -> bytes:
        result: bytes = await self._run(lambda: self._steps.generate_sync(aad))
        return result

    async def import_(self, material: bytes, aad: bytes) -> bytes:
        result: bytes = await self._run(lambda: self._steps.import_sync(material, aad))
        return result

    async def rewrap_from(self, source: object, wrapped: bytes, aad: bytes) -> bytes:
        if not isinstance(source, Pkcs11DekCustody):
            raise custody_refused("a DEK in HSM custody moves only between hsm-rewrap KEKs")
        steps = source._steps
        result: bytes = await self._run(lambda: self._steps.rewrap_from_sync(steps, wrapped, aad))
        return result

    async def release(
        self, wrapped: bytes, aad: bytes, runner: rsa.RSAPublicKey, release: jwe_cek.CekRelease
    ) -> str:
        result: str = await self._run(
            lambda: self._steps.release_sync(wrapped, aad, runner, release)
        )
        return result


class TokenSteps:
    """What the token does for DEKs in custody, synchronously (on the token's thread)."""

    def __init__(self, session: Any, kek: Any, token: str, runner_alg: str) -> None:
        self._session = session
        self._kek = kek
        self.token = token
        self.runner_alg = runner_alg

    # --- DEKs --------------------------------------------------------------------------------

    def generate_sync(self, aad: bytes) -> bytes:
        with self._objects() as made:
            dek = made(
                self._session.generate_key(
                    KeyType.AES, 256, capabilities=MechanismFlag(0), template=DEK_TEMPLATE
                )
            )
            return self._wrap_dek(made, dek, aad)

    def import_sync(self, material: bytes, aad: bytes) -> bytes:
        if len(material) != 32:
            raise ValueError("a DEK in custody is 32 bytes of AES-256")
        with self._objects() as made:
            dek = made(
                self._session.create_object(
                    {
                        pkcs11.Attribute.CLASS: ObjectClass.SECRET_KEY,
                        pkcs11.Attribute.KEY_TYPE: KeyType.AES,
                        pkcs11.Attribute.VALUE: material,
                        **DEK_TEMPLATE,
                    }
                )
            )
            return self._wrap_dek(made, dek, aad)

    def rewrap_from_sync(self, source: TokenSteps, wrapped: bytes, aad: bytes) -> bytes:
        """Move a DEK from ``source``'s KEK to this one without it leaving the token."""
        if source.token != self.token:
            raise custody_refused(
                "a DEK in HSM custody moves only between hsm-rewrap KEKs on the same token"
            )
        with self._objects() as made:
            dek = source._unwrap_dek(made, wrapped, aad)
            return self._wrap_dek(made, dek, aad)

    def release_sync(
        self, wrapped: bytes, aad: bytes, runner: rsa.RSAPublicKey, release: jwe_cek.CekRelease
    ) -> str:
        """The ``jwe-cek`` JWE of a DEK in custody for ``runner``, made inside the token."""
        with self._objects() as made:
            dek = self._unwrap_dek(made, wrapped, aad, capabilities=MechanismFlag.ENCRYPT)
            numbers = runner.public_numbers()
            public = made(
                self._session.create_object(
                    {
                        pkcs11.Attribute.CLASS: ObjectClass.PUBLIC_KEY,
                        pkcs11.Attribute.KEY_TYPE: KeyType.RSA,
                        pkcs11.Attribute.TOKEN: False,
                        pkcs11.Attribute.MODULUS: _unsigned(numbers.n),
                        pkcs11.Attribute.PUBLIC_EXPONENT: _unsigned(numbers.e),
                        pkcs11.Attribute.WRAP: True,
                        pkcs11.Attribute.ENCRYPT: False,
                        pkcs11.Attribute.VERIFY: False,
                    }
                )
            )
            encrypted_key = bytes(
                public.wrap_key(
                    dek,
                    mechanism=Mechanism.RSA_PKCS_OAEP,
                    mechanism_param=OAEP_PARAMS[self.runner_alg],
                )
            )

            def seal(plaintext: bytes, header: bytes) -> tuple[bytes, bytes]:
                iv = bytes(self._session.generate_random(IV_BYTES * 8))
                params = GCMParams(iv, header, 128)
                return iv, bytes(
                    dek.encrypt(plaintext, mechanism=Mechanism.AES_GCM, mechanism_param=params)
                )

            return jwe_cek.assemble(
                release, alg=self.runner_alg, encrypted_key=encrypted_key, seal=seal
            )

    # --- other secrets (KekProvider.wrap / unwrap in this mode) ---------------------------

    def seal_secret_sync(self, secret: bytes, aad: bytes) -> bytes:
        with self._objects() as made:
            key = made(self._derive(SECRET_LABEL, aad, MechanismFlag.ENCRYPT))
            iv = bytes(self._session.generate_random(IV_BYTES * 8))
            sealed = key.encrypt(
                secret, mechanism=Mechanism.AES_GCM, mechanism_param=GCMParams(iv, aad, 128)
            )
            return FORMAT_SECRET + iv + bytes(sealed)

    def open_secret_sync(self, wrapped: bytes, aad: bytes) -> bytes:
        if not wrapped.startswith(FORMAT_SECRET) or len(wrapped) < 1 + IV_BYTES + 16:
            raise custody_refused("this is not a secret sealed by an hsm-rewrap KEK")
        iv, body = wrapped[1 : 1 + IV_BYTES], wrapped[1 + IV_BYTES :]
        with self._objects() as made:
            key = made(self._derive(SECRET_LABEL, aad, MechanismFlag.DECRYPT))
            params = GCMParams(iv, aad, 128)
            return bytes(key.decrypt(body, mechanism=Mechanism.AES_GCM, mechanism_param=params))

    # --- the steps ---------------------------------------------------------------------------

    def _derive(self, label: bytes, aad: bytes, capabilities: MechanismFlag) -> Any:
        data = hashlib.sha256(label + b"\0" + aad).digest()
        return self._kek.derive_key(
            KeyType.AES,
            256,
            mechanism=Mechanism.AES_ECB_ENCRYPT_DATA,
            mechanism_param=data,
            capabilities=capabilities,
            template=SESSION_KEY,
        )

    def _wrap_dek(self, made: Callable[[Any], Any], dek: Any, aad: bytes) -> bytes:
        wrapping = made(self._derive(DEK_LABEL, aad, MechanismFlag.WRAP))
        return FORMAT_CUSTODY + bytes(wrapping.wrap_key(dek, mechanism=Mechanism.AES_KEY_WRAP_PAD))

    def _unwrap_dek(
        self,
        made: Callable[[Any], Any],
        wrapped: bytes,
        aad: bytes,
        capabilities: MechanismFlag = MechanismFlag(0),  # noqa: B008 - an int flag, immutable
    ) -> Any:
        if not wrapped.startswith(FORMAT_CUSTODY) or len(wrapped) != 1 + KWP_DEK_BYTES:
            raise custody_refused("the stored DEK is not in the HSM custody form")
        unwrapping = made(self._derive(DEK_LABEL, aad, MechanismFlag.UNWRAP))
        try:
            return made(
                unwrapping.unwrap_key(
                    ObjectClass.SECRET_KEY,
                    KeyType.AES,
                    wrapped[1:],
                    mechanism=Mechanism.AES_KEY_WRAP_PAD,
                    capabilities=capabilities,
                    template=DEK_TEMPLATE,
                )
            )
        except pkcs11.PKCS11Error as exc:  # SoftHSM2: CKR_GENERAL_ERROR; others: *_INVALID
            raise custody_refused(
                "the wrapped DEK does not unwrap under this KEK for this key version "
                "(changed, or another version's)"
            ) from exc

    @contextmanager
    def _objects(self) -> Iterator[Callable[[Any], Any]]:
        """Session objects made in the block, destroyed when it ends (whatever happens)."""
        made: list[Any] = []

        def keep(obj: Any) -> Any:
            made.append(obj)
            return obj

        try:
            yield keep
        finally:
            for obj in reversed(made):
                try:
                    obj.destroy()
                except pkcs11.PKCS11Error:  # closing the session destroys it too
                    log.warning("could not destroy a PKCS#11 session object", exc_info=True)


def _unsigned(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 7) // 8, "big")


def check_custody_kek(reference: str, key: Any) -> None:
    """A KEK for ``x-hsm-rewrap`` derives and does nothing else.

    Raises:
        ConfigError: ``keys.kek`` saying what the key can or cannot do.
    """
    if not key[pkcs11.Attribute.DERIVE]:
        raise ConfigError(
            "keys.kek",
            f"{reference} cannot derive keys: x-hsm-rewrap needs a KEK made for it "
            "(broker keys kek-create 'pkcs11:…&x-hsm-rewrap=true')",
        )
    uses = (
        pkcs11.Attribute.ENCRYPT,
        pkcs11.Attribute.DECRYPT,
        pkcs11.Attribute.WRAP,
        pkcs11.Attribute.UNWRAP,
    )
    enabled = [attribute.name for attribute in uses if key[attribute]]
    if enabled:
        raise ConfigError(
            "keys.kek",
            f"{reference} has CKA_{', CKA_'.join(enabled)} set: a KEK for x-hsm-rewrap only "
            "derives (make one with broker keys kek-create '…&x-hsm-rewrap=true')",
        )


def probe_token(session: Any, kek: Any, token: str) -> TokenSteps:
    """Check once, at start-up, that the token does every step, and pick the runner's OAEP.

    Raises:
        ConfigError: ``keys.kek`` naming the step the token refuses (and its CKR_ code).
    """
    custody = TokenSteps(session, kek, token, jwe_cek.RSA_OAEP)
    try:
        wrapped = custody.generate_sync(b"broker-probe")
        with custody._objects() as made:
            custody._unwrap_dek(made, wrapped, b"broker-probe")
    except (pkcs11.PKCS11Error, UpstreamError) as exc:
        raise ConfigError(
            "keys.kek",
            f"this token cannot keep DEKs (derive, AES key wrap): {_ckr(exc)}",
        ) from exc
    for alg in (jwe_cek.RSA_OAEP_256, jwe_cek.RSA_OAEP):
        if _oaep_works(session, alg):
            custody.runner_alg = alg
            return custody
    raise ConfigError(
        "keys.kek",
        "this token cannot wrap a key to an RSA public key with CKM_RSA_PKCS_OAEP "
        "(SHA-256 or SHA-1): x-hsm-rewrap needs it",
    )


def _oaep_works(session: Any, alg: str) -> bool:
    """Wrap a known throwaway AES key to a throwaway RSA key; decrypt it in software."""
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    numbers = private.public_key().public_numbers()
    value = os.urandom(32)
    objects: list[Any] = []
    try:
        probe = session.create_object(
            {
                pkcs11.Attribute.CLASS: ObjectClass.SECRET_KEY,
                pkcs11.Attribute.KEY_TYPE: KeyType.AES,
                pkcs11.Attribute.VALUE: value,
                pkcs11.Attribute.TOKEN: False,
                pkcs11.Attribute.EXTRACTABLE: True,
            }
        )
        objects.append(probe)
        public = session.create_object(
            {
                pkcs11.Attribute.CLASS: ObjectClass.PUBLIC_KEY,
                pkcs11.Attribute.KEY_TYPE: KeyType.RSA,
                pkcs11.Attribute.TOKEN: False,
                pkcs11.Attribute.MODULUS: _unsigned(numbers.n),
                pkcs11.Attribute.PUBLIC_EXPONENT: _unsigned(numbers.e),
                pkcs11.Attribute.WRAP: True,
            }
        )
        objects.append(public)
        made = public.wrap_key(
            probe, mechanism=Mechanism.RSA_PKCS_OAEP, mechanism_param=OAEP_PARAMS[alg]
        )
        works = private.decrypt(bytes(made), jwe_cek.oaep(alg)) == value
    except (pkcs11.PKCS11Error, ValueError) as exc:
        log.info("PKCS#11 token: %s to an RSA key is not available (%s)", alg, _ckr(exc))
        works = False
    finally:
        for obj in objects:
            obj.destroy()
    return works


def _ckr(exc: BaseException) -> str:
    """The PKCS#11 return code of a python-pkcs11 exception, as the spec spells it."""
    names = {
        "MechanismInvalid": "CKR_MECHANISM_INVALID",
        "MechanismParamInvalid": "CKR_MECHANISM_PARAM_INVALID",
        "ArgumentsBad": "CKR_ARGUMENTS_BAD",
        "GeneralError": "CKR_GENERAL_ERROR",
        "KeyFunctionNotPermitted": "CKR_KEY_FUNCTION_NOT_PERMITTED",
    }
    return names.get(type(exc).__name__, type(exc).__name__)
