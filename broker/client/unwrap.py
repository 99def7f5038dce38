"""The runner's side of a release: its ephemeral key pair, made in this process (inside the
TEE), and the opening of what the broker wrapped to it (JWE, HPKE, or ``jwe-cek`` for a DEK an
HSM keeps), checked against the release it asked for before the key material is returned."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec, rsa, x25519

from broker.core.encoding import b64url_decode
from broker.crypto import hpke, jwe, jwe_cek
from broker.crypto.jwk import hybrid_jwk, public_jwk
from broker.crypto.wrap import JWE_CEK, release_info

RunnerSecret = jwe.RunnerPrivateKey | hpke.HpkePrivateKey
KEY_TYPES = ("EC-P256", "EC-P384", "X25519", "RSA-3072", "MLKEM768-X25519")


@dataclass(frozen=True)
class ReleasedDek:
    """Released key material: a DEK, or for query keys the HPKE private key (``algorithm``)."""

    key: str
    version: int
    decision_id: str
    dek: bytes = field(repr=False)
    algorithm: str = "AES-256"
    log_index: int = -1  # the decision record's index in the broker's log
    leaf_hash: bytes = b""  # its RFC 6962 leaf hash: ``BrokerClient.prove`` checks its inclusion
    log_origin: str = ""  # the origin of the log it is in (each replica keeps its own log)


def new_runner_key(key_type: str) -> tuple[RunnerSecret, dict[str, str]]:
    """A fresh key pair for one release and its public JWK."""
    if key_type == "MLKEM768-X25519":
        private, raw = hpke.new_hybrid_key()
        return private, hybrid_jwk(raw)
    classic = new_ephemeral_key(key_type)
    return classic, public_jwk(classic.public_key())


def new_ephemeral_key(key_type: str = "EC-P256") -> jwe.RunnerPrivateKey:
    """A fresh key pair for one release, held only in this process."""
    if key_type == "EC-P256":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "EC-P384":
        return ec.generate_private_key(ec.SECP384R1())
    if key_type == "X25519":
        return x25519.X25519PrivateKey.generate()
    if key_type == "RSA-3072":
        return rsa.generate_private_key(public_exponent=65537, key_size=3072)
    raise ValueError(f"key_type must be one of {KEY_TYPES}")


def unwrap_release(
    body: dict[str, Any],
    private_key: RunnerSecret,
    *,
    expected_key: str,
    expected_version: int | None,
    policy_digest: str | None = None,
    expected_wrap: str | None = None,
) -> ReleasedDek:
    """Decrypt a release response and check that its binding matches the request.
    ``policy_digest``: a release on an attestation result binds the policy that allowed it too.
    ``expected_wrap``: the wrap asked for; an answer in another form is refused.

    Raises:
        jwe.JweError: on decryption failure or a binding that names another key or release.
    """
    version = int(body["version"])
    if body.get("key") != expected_key or (
        expected_version is not None and version != expected_version
    ):
        raise jwe.JweError("the broker answered for another key or version")
    algorithm = str(body.get("algorithm", "AES-256"))
    if expected_wrap is not None and body.get("wrap", "jwe") != expected_wrap:
        raise jwe.JweError(f"asked for wrap {expected_wrap}, the broker answered another")
    if body.get("wrap") == JWE_CEK:
        return _unwrap_cek(body, private_key, expected_key, version, policy_digest)
    if body.get("wrap", "jwe") == "hpke":
        info = release_info(expected_key, version, str(body["decision_id"]), policy_digest)
        try:
            sealed = b64url_decode(str(body["wrapped_key"]))
            material = hpke.open_(sealed, private_key, info)  # type: ignore[arg-type]
        except (ValueError, hpke.HpkeError) as exc:
            raise jwe.JweError("the HPKE-wrapped key does not open for this release") from exc
        return ReleasedDek(
            expected_key,
            version,
            str(body["decision_id"]),
            material,
            algorithm,
            int(body.get("log_index", -1)),
            _leaf_hash(body),
            str(body.get("log_origin", "")),
        )
    decrypted = jwe.decrypt(str(body["wrapped_key"]), private_key)  # type: ignore[arg-type]
    header = decrypted.protected_header
    if header.get("kid") != f"{expected_key}#{version}":
        raise jwe.JweError("wrapped key header names another key or version")
    if header.get("decision_id") != body.get("decision_id"):
        raise jwe.JweError("wrapped key header names another decision")
    if header.get("policy_digest") != policy_digest:
        raise jwe.JweError("wrapped key header names another policy")
    return ReleasedDek(
        key=expected_key,
        version=version,
        decision_id=str(body["decision_id"]),
        dek=decrypted.plaintext,
        algorithm=algorithm,
        log_index=int(body.get("log_index", -1)),
        leaf_hash=_leaf_hash(body),
        log_origin=str(body.get("log_origin", "")),
    )


def _unwrap_cek(
    body: dict[str, Any],
    private_key: RunnerSecret,
    key: str,
    version: int,
    policy_digest: str | None,
) -> ReleasedDek:
    """``wrap: "jwe-cek"`` (a DEK an HSM keeps): the JWE's content-encryption key is the DEK."""
    if not isinstance(private_key, rsa.RSAPrivateKey):
        raise jwe.JweError("wrap jwe-cek is made for RSA runner keys")
    decision_id = str(body["decision_id"])
    expected = jwe_cek.CekRelease(key, version, decision_id, policy_digest)
    return ReleasedDek(
        key=key,
        version=version,
        decision_id=decision_id,
        dek=jwe_cek.open_release(str(body["wrapped_key"]), private_key, expected),
        algorithm=str(body.get("algorithm", "AES-256")),
        log_index=int(body.get("log_index", -1)),
        leaf_hash=_leaf_hash(body),
        log_origin=str(body.get("log_origin", "")),
    )


def _leaf_hash(body: dict[str, Any]) -> bytes:
    try:
        return base64.b64decode(str(body.get("leaf_hash", "")), validate=True)
    except ValueError:
        return b""
