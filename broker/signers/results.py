"""What signs this broker's attestation results (EARs, ES256) and what verifies them: the
``ResultSigner`` port (a PEM file here for development; Cloud KMS in ``results_kms.py``, a
PKCS#11 token in ``results_pkcs11.py``) and the keys ``/.well-known/jwks.json`` publishes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from broker.core.errors import ConfigError
from broker.crypto.jwk import parse_runner_key, public_jwk, thumbprint
from broker.crypto.keyfiles import p256_private_key_file, p256_public_key_file


@dataclass(frozen=True)
class KeyRole:
    """Which key an ES256 signer holds, for its errors: a start-up refusal names ``setting``,
    a failure of the KMS or token names ``name``. The same signers hold the result key and the
    workload-certificate CA's key."""

    setting: str
    name: str


RESULT_KEY = KeyRole("attest.signing_key", "result signing key")
IDENTITY_CA_KEY = KeyRole("identity.ca_key", "identity CA key")


class ResultSigner(Protocol):
    """What signs attestation results (ES256); its public half is at ``/.well-known/jwks.json``."""

    @property
    def kid(self) -> str:
        """The RFC 7638 thumbprint of ``jwk``: the EAR header's ``kid``."""
        ...

    @property
    def jwk(self) -> Mapping[str, str]: ...

    async def sign(self, data: bytes) -> bytes:
        """R || S of ``data``."""
        ...

    def jwks(self) -> dict[str, Any]: ...


def result_jwks(jwk: Mapping[str, str], kid: str) -> dict[str, Any]:
    return {"keys": [{**jwk, "kid": kid, "alg": "ES256", "use": "sig"}]}


@dataclass(frozen=True)
class ResultKeys:
    """The keys results are verified with, by ``kid``: the signer's, and the previous keys a
    rotation retired (``[attest] previous_keys``) until the results they signed expire; all
    are published at ``/.well-known/jwks.json``."""

    verifying: Mapping[str, ec.EllipticCurvePublicKey]
    jwks: dict[str, Any]


def result_keys(signer: ResultSigner, previous: Sequence[Path]) -> ResultKeys:
    """Raises: ConfigError naming a previous key that is not a P-256 PEM (public or private)."""
    jwks = signer.jwks()
    verifying = {signer.kid: _public_key(signer.jwk)}
    for path in previous:
        key = p256_public_key_file(path, "attest.previous_keys")
        jwk = public_jwk(key)
        kid = thumbprint(jwk)
        if kid not in verifying:
            verifying[kid] = key
            jwks["keys"].extend(result_jwks(jwk, kid)["keys"])
    return ResultKeys(verifying, jwks)


def _public_key(jwk: Mapping[str, str]) -> ec.EllipticCurvePublicKey:
    key = parse_runner_key(dict(jwk)).key
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ConfigError("attest.signing_key", "must be an EC P-256 key")
    return key


class LocalResultSigner:
    """An EC P-256 PEM file (``[attest] signing_key = "PATH"``): development and tests; in
    production the key lives in Cloud KMS (``signers/results_kms.py``)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey) -> None:
        if key.curve.name != "secp256r1":
            raise ConfigError("attest.signing_key", "must be an EC P-256 private key")
        self._key = key
        self.jwk = public_jwk(key.public_key())
        self.kid = thumbprint(self.jwk)

    @classmethod
    def from_pem(cls, path: Path) -> LocalResultSigner:
        """Raises: ConfigError naming the key when the file is unreadable or not P-256."""
        return cls(p256_private_key_file(path, "attest.signing_key"))

    async def sign(self, data: bytes) -> bytes:
        """ES256: R || S of the signing input (a local key: microseconds, on the loop)."""
        r, s = decode_dss_signature(self._key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")

    def jwks(self) -> dict[str, Any]:
        return result_jwks(self.jwk, self.kid)
