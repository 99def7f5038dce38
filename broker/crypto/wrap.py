"""Wrapping released key material to the runner's ephemeral key.

Two forms, chosen by the request's ``wrap``:

* ``jwe`` (default): a compact JWE whose protected header (the AEAD's associated data) carries
  ``kid = <key>#<version>`` and the decision id.
* ``hpke``: RFC 9180 to an X25519 or ML-KEM-768+X25519 runner key, with
  ``info = {"decision_id", "key", "version", "wrap": "broker-release/v1"}`` (canonical JSON).
* ``jwe-cek``: a compact JWE to an RSA runner key whose content-encryption key is the DEK and
  whose content is the release statement (``crypto/jwe_cek.py``). The only form an HSM that keeps
  the DEK (``x-hsm-rewrap``) can make; made in software for any other AES-256 DEK.

A release on an attestation result (``decisions/attested_release.py``) also binds the digest of the
policy that allowed it: ``policy_digest`` in the JWE header, or in the HPKE ``info``.

Either way a wrapped key cannot be passed off as another key, version or release.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hpke as pyca_hpke
from cryptography.hazmat.primitives.asymmetric import rsa, x25519

from broker.core.encoding import b64url_encode
from broker.core.errors import ErrorCode, InputError
from broker.crypto import hpke, jwe, jwe_cek
from broker.crypto.jwk import RunnerKey

DECISION_HEADER = "decision_id"
POLICY_HEADER = "policy_digest"
JWE_CEK = "jwe-cek"
WRAP_MODES = ("jwe", "hpke", JWE_CEK)
HPKE_CONTEXT = "broker-release/v1"


def key_id(name: str, version: int) -> str:
    return f"{name}#{version}"


def release_info(
    name: str, version: int, decision_id: str, policy_digest: str | None = None
) -> bytes:
    """The HPKE ``info`` of a release (also recomputed by the runner SDK)."""
    info: dict[str, object] = {
        "decision_id": decision_id,
        "key": name,
        "version": version,
        "wrap": HPKE_CONTEXT,
    }
    if policy_digest is not None:
        info[POLICY_HEADER] = policy_digest
    return hpke.context_info(info)


def check_wrap_mode(mode: str, runner_key: RunnerKey) -> None:
    """Refuse, before anything is decided, a runner key that cannot receive this wrap.

    Raises:
        InputError: ``runner_key_invalid``.
    """
    hpke_capable = isinstance(
        runner_key.key, x25519.X25519PublicKey | pyca_hpke.MLKEM768X25519PublicKey
    )
    if mode == "hpke" and not hpke_capable:
        raise InputError(
            "wrap hpke needs an X25519 or MLKEM768-X25519 runner key",
            code=ErrorCode.RUNNER_KEY_INVALID,
        )
    if mode == "jwe" and isinstance(runner_key.key, pyca_hpke.MLKEM768X25519PublicKey):
        raise InputError(
            "a hybrid ML-KEM runner key needs wrap hpke", code=ErrorCode.RUNNER_KEY_INVALID
        )
    if mode == JWE_CEK and not isinstance(runner_key.key, rsa.RSAPublicKey):
        raise InputError("wrap jwe-cek needs an RSA runner key", code=ErrorCode.RUNNER_KEY_INVALID)


def wrap_to_runner(
    material: bytes,
    runner_key: RunnerKey,
    *,
    name: str,
    version: int,
    decision_id: str,
    mode: str = "jwe",
    policy_digest: str | None = None,
) -> str:
    """The wrapped form of ``material`` for ``runner_key`` with the release bound into it."""
    if mode == "hpke":
        info = release_info(name, version, decision_id, policy_digest)
        sealed = hpke.seal(material, runner_key.key, info)  # type: ignore[arg-type]
        return b64url_encode(sealed)
    if mode == JWE_CEK:
        if not isinstance(runner_key.key, rsa.RSAPublicKey):
            raise TypeError("wrap jwe-cek needs an RSA runner key (check_wrap_mode)")
        release = jwe_cek.CekRelease(name, version, decision_id, policy_digest)
        return jwe_cek.encrypt(material, runner_key.key, release)
    header = {"kid": key_id(name, version), DECISION_HEADER: decision_id, "cty": "dek"}
    if policy_digest is not None:
        header[POLICY_HEADER] = policy_digest
    return jwe.encrypt(material, runner_key, header)
