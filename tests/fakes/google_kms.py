"""An in-memory Cloud KMS speaking the real gRPC API (google.cloud.kms.v1.KeyManagementService).

Implements the RPCs the broker uses, Encrypt and Decrypt (symmetric KEKs), GetPublicKey and
AsymmetricSign (EC_SIGN_ED25519 checkpoint keys), the way the documentation says the
service behaves: CRC32C fields are checked when present (INVALID_ARGUMENT on mismatch) and
echoed as ``verified_*`` flags; unknown keys are NOT_FOUND; disabled versions are
FAILED_PRECONDITION; ciphertexts name the version that made them, so rotation keeps old
ciphertexts decryptable. Knobs let tests break it on purpose (outage, corrupted responses).

With ``iam`` set (``KmsIam``) it also authenticates and authorizes as Cloud KMS does: it serves
gRPC local credentials (a client sends its bearer token only over a secure channel), requires
``authorization: Bearer …`` call metadata (UNAUTHENTICATED without one, or for a token its
issuer does not know), resolves the token to the caller's IAM identities (a federated
principal's ``principal://…/subject/…`` and ``principalSet://…`` members, from the loopback STS,
``google_sts.py``) and allows a method only if a role bound on the CryptoKey grants its permission
to one of them (PERMISSION_DENIED otherwise, in Google's words).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import grpc
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.cloud import kms_v1

from tests.fakes import start_grpc_server, stop_grpc_server

SERVICE = "google.cloud.kms.v1.KeyManagementService"


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


# The predefined Cloud KMS roles the broker's keys use, and the permissions they hold
# (cloud.google.com/kms/docs/reference/permissions-and-roles).
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "roles/cloudkms.cryptoKeyEncrypterDecrypter": frozenset({"useToEncrypt", "useToDecrypt"}),
    "roles/cloudkms.cryptoKeyEncrypter": frozenset({"useToEncrypt"}),
    "roles/cloudkms.cryptoKeyDecrypter": frozenset({"useToDecrypt"}),
    "roles/cloudkms.signerVerifier": frozenset({"useToSign", "useToVerify", "viewPublicKey"}),
    "roles/cloudkms.signer": frozenset({"useToSign"}),
    "roles/cloudkms.publicKeyViewer": frozenset({"viewPublicKey"}),
}
METHOD_PERMISSION = {
    "Encrypt": "useToEncrypt",
    "Decrypt": "useToDecrypt",
    "AsymmetricSign": "useToSign",
    "GetPublicKey": "viewPublicKey",
}


@dataclass
class KmsIam:
    """Who may use which key: ``identities_of`` resolves a bearer token to the caller's IAM
    identities (``None``: an unknown token); ``bindings``: CryptoKey name → role → members."""

    identities_of: Callable[[str], frozenset[str] | None]
    bindings: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    denied: list[str] = field(default_factory=list)  # "METHOD CODE" of each refusal

    def grant(self, key: str, role: str, member: str) -> None:
        assert role in ROLE_PERMISSIONS, role
        self.bindings.setdefault(key, {}).setdefault(role, set()).add(member)

    def allows(self, identities: frozenset[str], resource: str, permission: str) -> bool:
        key = resource.split("/cryptoKeyVersions/", maxsplit=1)[0]
        return any(
            permission in ROLE_PERMISSIONS[role] and members & identities
            for role, members in self.bindings.get(key, {}).items()
        )


@dataclass
class FakeKey:
    versions: list[bytes] = field(default_factory=list)  # AES-256 keys; index + 1 = version
    disabled: set[int] = field(default_factory=set)
    primary: int = 1


class FakeKms:
    def __init__(self) -> None:
        self.keys: dict[str, FakeKey] = {}
        self.server: grpc.aio.Server | None = None
        self.endpoint = ""
        self.unavailable = False
        self.corrupt_ciphertext = False
        self.skip_verification = False
        self.calls: list[str] = []
        self.iam: KmsIam | None = None  # set before start(): authenticate and authorize
        # version name -> key: Ed25519 (checkpoints) or EC P-256 (attestation results)
        self.signing_keys: dict[str, ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey] = {}

    def create_signing_key(self, version_name: str) -> None:
        """An EC_SIGN_ED25519 key version (``…/cryptoKeys/K/cryptoKeyVersions/N``)."""
        self.signing_keys[version_name] = ed25519.Ed25519PrivateKey.generate()

    def create_ec_signing_key(self, version_name: str) -> None:
        """An EC_SIGN_P256_SHA256 key version: it signs a SHA-256 digest, DER-encoded."""
        self.signing_keys[version_name] = ec.generate_private_key(ec.SECP256R1())

    def create_key(self, name: str) -> None:
        self.keys[name] = FakeKey(versions=[AESGCM.generate_key(bit_length=256)])

    def rotate(self, name: str) -> None:
        key = self.keys[name]
        key.versions.append(AESGCM.generate_key(bit_length=256))
        key.primary = len(key.versions)

    async def start(self) -> str:
        self.server, self.endpoint = await start_grpc_server(
            SERVICE,
            {
                "Encrypt": (self._encrypt, kms_v1.EncryptRequest, kms_v1.EncryptResponse),
                "Decrypt": (self._decrypt, kms_v1.DecryptRequest, kms_v1.DecryptResponse),
                "GetPublicKey": (self._public_key, kms_v1.GetPublicKeyRequest, kms_v1.PublicKey),
                "AsymmetricSign": (
                    self._sign,
                    kms_v1.AsymmetricSignRequest,
                    kms_v1.AsymmetricSignResponse,
                ),
            },
            local_credentials=self.iam is not None,
        )
        return self.endpoint

    async def stop(self) -> None:
        await stop_grpc_server(self)

    async def _guard(self, context: Any, name: str, method: str) -> FakeKey:
        self.calls.append(method)
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the service is unavailable")
        await self._authorize(context, name, method)
        key = self.keys.get(name)
        if key is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{name} not found")
        assert key is not None
        return key

    async def _encrypt(
        self, request: kms_v1.EncryptRequest, context: Any
    ) -> kms_v1.EncryptResponse:
        key = await self._guard(context, request.name, "Encrypt")
        raw = kms_v1.EncryptRequest.pb(request)
        await _check(context, raw, "plaintext_crc32c", request.plaintext)
        await _check(
            context,
            raw,
            "additional_authenticated_data_crc32c",
            request.additional_authenticated_data,
        )
        if key.primary in key.disabled:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "primary version disabled")
        nonce = os.urandom(12)
        sealed = AESGCM(key.versions[key.primary - 1]).encrypt(
            nonce, request.plaintext, request.additional_authenticated_data
        )
        ciphertext = struct.pack(">I", key.primary) + nonce + sealed
        if self.corrupt_ciphertext:
            ciphertext = ciphertext[:-1] + bytes([ciphertext[-1] ^ 1])
        return kms_v1.EncryptResponse(
            name=f"{request.name}/cryptoKeyVersions/{key.primary}",
            ciphertext=ciphertext,
            ciphertext_crc32c=crc(ciphertext)
            if not self.corrupt_ciphertext
            else crc(ciphertext) ^ 1,
            verified_plaintext_crc32c=raw.HasField("plaintext_crc32c")
            and not self.skip_verification,
            verified_additional_authenticated_data_crc32c=raw.HasField(
                "additional_authenticated_data_crc32c"
            )
            and not self.skip_verification,
            protection_level=kms_v1.ProtectionLevel.HSM,
        )

    async def _decrypt(
        self, request: kms_v1.DecryptRequest, context: Any
    ) -> kms_v1.DecryptResponse:
        key = await self._guard(context, request.name, "Decrypt")
        raw = kms_v1.DecryptRequest.pb(request)
        await _check(context, raw, "ciphertext_crc32c", request.ciphertext)
        await _check(
            context,
            raw,
            "additional_authenticated_data_crc32c",
            request.additional_authenticated_data,
        )
        ciphertext = bytes(request.ciphertext)
        version = struct.unpack(">I", ciphertext[:4])[0] if len(ciphertext) > 4 else 0
        if not 1 <= version <= len(key.versions):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Decryption failed")
        if version in key.disabled:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "version is disabled")
        try:
            plaintext = AESGCM(key.versions[version - 1]).decrypt(
                ciphertext[4:16], ciphertext[16:], request.additional_authenticated_data
            )
        except InvalidTag:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Decryption failed")
            raise
        return kms_v1.DecryptResponse(
            plaintext=plaintext,
            plaintext_crc32c=crc(plaintext),
            used_primary=version == key.primary,
            protection_level=kms_v1.ProtectionLevel.HSM,
        )

    async def _signing_key(self, context: Any, name: str, method: str) -> Any:
        self.calls.append(method)
        if self.unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the service is unavailable")
        await self._authorize(context, name, method)
        key = self.signing_keys.get(name)
        if key is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{name} not found")
        return key

    async def _public_key(self, request: kms_v1.GetPublicKeyRequest, context: Any) -> Any:
        key = await self._signing_key(context, request.name, "GetPublicKey")
        pem = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        algorithms = kms_v1.CryptoKeyVersion.CryptoKeyVersionAlgorithm
        return kms_v1.PublicKey(
            pem=pem.decode(),
            pem_crc32c=crc(pem),
            algorithm=algorithms.EC_SIGN_P256_SHA256
            if isinstance(key, ec.EllipticCurvePrivateKey)
            else algorithms.EC_SIGN_ED25519,
            name=request.name,
        )

    async def _sign(self, request: kms_v1.AsymmetricSignRequest, context: Any) -> Any:
        key = await self._signing_key(context, request.name, "AsymmetricSign")
        raw = kms_v1.AsymmetricSignRequest.pb(request)
        if isinstance(key, ec.EllipticCurvePrivateKey):  # EC_SIGN_P256_SHA256: a digest, DER
            digest = bytes(request.digest.sha256)
            if len(digest) != 32:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "digest.sha256 is required")
            await _check(context, raw, "digest_crc32c", digest)
            der = key.sign(digest, ec.ECDSA(Prehashed(hashes.SHA256())))
            return kms_v1.AsymmetricSignResponse(
                signature=der,
                signature_crc32c=crc(der),
                verified_digest_crc32c=raw.HasField("digest_crc32c") and not self.skip_verification,
                name=request.name,
            )
        await _check(context, raw, "data_crc32c", request.data)
        signature = key.sign(bytes(request.data))  # PureEdDSA over the data itself
        return kms_v1.AsymmetricSignResponse(
            signature=signature,
            signature_crc32c=crc(signature),
            verified_data_crc32c=raw.HasField("data_crc32c") and not self.skip_verification,
            name=request.name,
        )

    async def _authorize(self, context: Any, name: str, method: str) -> None:
        """As Cloud KMS: the bearer token first, then the permission on the key (before the
        key's existence, hence Google's "(or it may not exist)")."""
        if self.iam is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        identities = self.iam.identities_of(token) if scheme == "Bearer" and token else None
        if identities is None:
            self.iam.denied.append(f"{method} UNAUTHENTICATED")
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "Request had invalid authentication credentials. Expected OAuth 2 access token, "
                "login cookie or other valid authentication credential.",
            )
        assert identities is not None
        permission = METHOD_PERMISSION[method]
        if not self.iam.allows(identities, name, permission):
            self.iam.denied.append(f"{method} PERMISSION_DENIED")
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"Permission 'cloudkms.cryptoKeyVersions.{permission}' denied on resource "
                f"'{name}' (or it may not exist).",
            )


async def _check(context: Any, raw: Any, field_name: str, data: bytes) -> None:
    if raw.HasField(field_name) and getattr(raw, field_name).value != crc(bytes(data)):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"The checksum in field {field_name} did not match"
        )
