"""Attestation results signed by a Cloud KMS key version (``EC_SIGN_P256_SHA256``): the result
key never leaves the KMS. ``[attest] signing_key = "cloudkms:projects/P/locations/L/keyRings/R/
cryptoKeys/K/cryptoKeyVersions/N"``; the endpoint is ``[keys] kms_endpoint``, the credentials
``[keys] kms_credentials`` (Workload Identity Federation) when set. The digest and the
signature carry CRC32C checksums, checked both ways as for the KEK, and every signature is
verified with the version's public key before it is used. The same signer holds ``[identity]
ca_key``, the workload-certificate CA's key (``role``: its errors then name that setting)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, decode_dss_signature
from google.api_core import exceptions as api_exceptions
from google.cloud import kms_v1

from broker.cloud.google_api import crc32c
from broker.cloud.kms_key import KmsKeyVersion
from broker.core.errors import ConfigError, ErrorCode, UpstreamError
from broker.crypto.jwk import public_jwk, thumbprint
from broker.signers.results import RESULT_KEY, KeyRole, result_jwks


def _unavailable(role: KeyRole, message: str) -> UpstreamError:
    return UpstreamError(f"{role.name}: {message}", code=ErrorCode.KEK_UNAVAILABLE)


class KmsResultSigner:
    def __init__(
        self,
        uri: str,
        *,
        endpoint: str,
        timeout_seconds: float,
        credentials_file: Path | None = None,
        role: KeyRole = RESULT_KEY,
    ) -> None:
        self._role = role
        self._kms = KmsKeyVersion(
            uri,
            setting=role.setting,
            endpoint=endpoint,
            timeout_seconds=timeout_seconds,
            unavailable=functools.partial(_unavailable, role),
            credentials_file=credentials_file,
        )
        self._public: ec.EllipticCurvePublicKey | None = None
        self.jwk: dict[str, str] = {}
        self.kid = ""

    async def open(self) -> None:
        """Connect and read the version's public key (it must be EC P-256).

        Raises:
            UpstreamError / ConfigError (the setting names no such version, or another kind).
        """
        try:
            key = await self._kms.open()
        except api_exceptions.NotFound as exc:
            await self._kms.close()
            raise ConfigError(
                self._role.setting, f"Cloud KMS has no key version {self._kms.version}"
            ) from exc
        except BaseException:
            await self._kms.close()  # the channel is open; the caller closes only an open signer
            raise
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
            await self._kms.close()
            raise ConfigError(self._role.setting, "the KMS key version is not EC_SIGN_P256_SHA256")
        self._public = key
        self.jwk = public_jwk(key)
        self.kid = thumbprint(self.jwk)

    async def close(self) -> None:
        await self._kms.close()

    def jwks(self) -> dict[str, Any]:
        return result_jwks(self.jwk, self.kid)

    async def sign(self, data: bytes) -> bytes:
        """R || S of ``data``: the KMS signs its SHA-256 digest.

        Raises:
            UpstreamError: ``kek_unavailable`` when the KMS does not answer, a checksum fails or
                the signature does not verify with the version's public key.
        """
        if self._public is None:
            raise _unavailable(self._role, "not opened")
        digest = hashlib.sha256(data).digest()
        try:
            answer = await self._kms.call(
                "asymmetric_sign",
                kms_v1.AsymmetricSignRequest(
                    name=self._kms.version,
                    digest=kms_v1.Digest(sha256=digest),
                    digest_crc32c=crc32c(digest),
                ),
            )
        except api_exceptions.NotFound as exc:  # deleted since start-up: unavailable, no bug
            raise _unavailable(self._role, "the key version is gone") from exc
        if not answer.verified_digest_crc32c:
            raise _unavailable(self._role, "the service did not verify the digest checksum")
        der = bytes(answer.signature)
        if crc32c(der) != answer.signature_crc32c:
            raise _unavailable(self._role, "the signature was corrupted in transit")
        try:
            self._public.verify(der, digest, ec.ECDSA(Prehashed(hashes.SHA256())))
        except InvalidSignature as exc:
            raise _unavailable(
                self._role, "the signature does not verify with the key's public half"
            ) from exc
        r, s = decode_dss_signature(der)
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")
