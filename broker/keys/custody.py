"""DEKs in HSM custody: the port, and the rules the key service applies to them.

A KEK may keep the DEKs it wraps inside its token (``pkcs11:…&x-hsm-rewrap=true``,
``keys/kek/pkcs11_rewrap.py``): an AES-256 DEK is made there, stored wrapped, and released by the
token itself as a ``jwe-cek`` JWE to an RSA runner key (``crypto/jwe_cek.py``). Such a KEK has
a ``dek_custody`` attribute; every other KEK leaves DEKs to the key service as before.

Rules (docs/keys.md, "DEKs that never leave the HSM"):

* a DEK in custody is released only with ``wrap: "jwe-cek"`` to an RSA runner key; an EC, X25519
  or ML-KEM key, and ``jwe``/``hpke``, are refused (``runner_key_invalid``, with ``custody:
  "hsm"`` in the details) — the token cannot make those (ECDH-ES needs the Concat KDF, HPKE
  needs HKDF; SoftHSM2 has neither inside the token);
* its plaintext is never returned: ``KeyService.unwrap`` refuses it (owners bring their own
  DEK with ``keys import`` to encrypt weights first), and the DEK cache never holds it;
* KEK rotation moves it between custody KEKs on the same token, inside the token; into custody
  from another KEK by importing it (the one moment its plaintext passes through the rotating
  process); never out of custody.
* Query keys (HPKE private keys) are not DEKs: the token has no HPKE, so they are sealed by the
  same KEK as secrets and released by the broker as before.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cryptography.hazmat.primitives.asymmetric import rsa

from broker.core.errors import ErrorCode, InputError, KeyUnavailable
from broker.core.protocol import Algorithm
from broker.crypto.jwe_cek import CekRelease
from broker.crypto.jwk import RunnerKey
from broker.crypto.wrap import JWE_CEK
from broker.keys.kek.base import KekProvider, dek_aad
from broker.keys.store.base import KeyVersionRecord, Purpose


@runtime_checkable
class DekCustody(Protocol):
    """A token that keeps DEKs: none of these returns one."""

    @property
    def token(self) -> str:
        """Which token (DEKs move inside one token only)."""
        ...

    async def generate(self, aad: bytes) -> bytes:
        """A new AES-256 DEK made in the token; its wrapped form."""
        ...

    async def import_(self, material: bytes, aad: bytes) -> bytes:
        """Bring a 32-byte DEK into custody; its wrapped form."""
        ...

    async def rewrap_from(self, source: object, wrapped: bytes, aad: bytes) -> bytes:
        """A DEK ``source`` wraps, wrapped by this KEK instead, inside the token."""
        ...

    async def release(
        self, wrapped: bytes, aad: bytes, runner: rsa.RSAPublicKey, release: CekRelease
    ) -> str:
        """The ``jwe-cek`` JWE of a DEK in custody for ``runner``, made by the token."""
        ...


def custody_of(kek: KekProvider, purpose: Purpose) -> DekCustody | None:
    """The token that keeps the DEKs ``kek`` wraps, or None (query keys are never in custody)."""
    found = getattr(kek, "dek_custody", None)
    # ``found is None`` first: a runtime protocol check costs ~20 µs, and most KEKs keep none
    if found is None or purpose is Purpose.QUERY or not isinstance(found, DekCustody):
        return None
    return found


def check_release_wrap(
    record: KeyVersionRecord, mode: str, runner_key: RunnerKey, custody: DekCustody | None
) -> None:
    """Refuse, before the policy runs, a wrap this version cannot be released with.

    Raises:
        InputError: ``runner_key_invalid``: ``jwe-cek`` for a key that is not AES-256, or a DEK
            in custody asked for with another wrap or a key that is not RSA.
    """
    if mode == JWE_CEK and record.algorithm is not Algorithm.AES_256:
        raise InputError(
            f"wrap jwe-cek carries AES-256 keys; {record.name!r} is {record.algorithm.value}",
            code=ErrorCode.RUNNER_KEY_INVALID,
        )
    if custody is not None and (
        mode != JWE_CEK or not isinstance(runner_key.key, rsa.RSAPublicKey)
    ):
        raise InputError(
            f"key {record.name!r} version {record.version} never leaves its HSM: it is "
            "released only with wrap jwe-cek to an RSA runner key (docs/keys.md)",
            code=ErrorCode.RUNNER_KEY_INVALID,
            custody="hsm",
            wrap=JWE_CEK,
            runner_key_kty="RSA",
        )


async def release_from_custody(
    custody: DekCustody,
    record: KeyVersionRecord,
    runner_key: RunnerKey,
    *,
    decision_id: str,
    policy_digest: str | None = None,
) -> str:
    """The token's ``jwe-cek`` JWE of this version for ``runner_key``.

    Raises:
        InputError: ``runner_key_invalid`` (as ``check_release_wrap``).
        UpstreamError: ``kek_unavailable`` when the token fails or the wrapped DEK does not
            unwrap for this version (changed, or copied from another).
    """
    check_release_wrap(record, JWE_CEK, runner_key, custody)
    if not isinstance(runner_key.key, rsa.RSAPublicKey):  # checked above; for the type
        raise InputError("wrap jwe-cek needs an RSA runner key", code=ErrorCode.RUNNER_KEY_INVALID)
    release = CekRelease(record.name, record.version, decision_id, policy_digest)
    aad = dek_aad(record.name, record.version)
    return await custody.release(record.wrapped_dek, aad, runner_key.key, release)


def refuse_plaintext(record: KeyVersionRecord) -> KeyUnavailable:
    return KeyUnavailable(
        f"key {record.name!r} version {record.version} is held in HSM custody: its DEK never "
        "leaves the token in plaintext (release it with wrap jwe-cek; owners encrypt weights "
        "under their own DEK and bring it with `broker keys import`)"
    )


async def rewrap_to(record: KeyVersionRecord, source: KekProvider, target: KekProvider) -> bytes:
    """``record``'s DEK wrapped by ``target`` instead of ``source`` (KEK rotation).

    Raises:
        KeyUnavailable: moving a DEK out of custody, or to a custody KEK on another token.
        UpstreamError: ``kek_unavailable``.
    """
    aad = dek_aad(record.name, record.version)
    held, keeper = custody_of(source, record.purpose), custody_of(target, record.purpose)
    if held is not None:
        if keeper is None or keeper.token != held.token:
            raise KeyUnavailable(
                f"key {record.name!r} version {record.version} is held in HSM custody: it "
                "moves only to another x-hsm-rewrap KEK on the same token"
            )
        return await keeper.rewrap_from(held, record.wrapped_dek, aad)
    material = await source.unwrap(record.wrapped_dek, aad)
    if keeper is not None:
        return await keeper.import_(material, aad)
    return await target.wrap(material, aad)
