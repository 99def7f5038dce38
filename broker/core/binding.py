"""Binding of evidence to one release: the broker's nonce and the runner's key. Pure.

Protocol v1 (docs/api.md): a Confidential Space runner asks the launcher for a token with
``nonces = [broker_nonce, runner_key_thumbprint]``; Google echoes them in ``eat_nonce``
(a string when there is one nonce, an array otherwise). Both values must be present. A token
without the broker's nonce would be a bearer token anyone could replay; a token without the
thumbprint would let a thief who saw the token wrap the key to their own key.

Values are compared as exact strings (docs/evidence.md: nonces are echoed verbatim).

Evidence that carries one opaque value instead of a list of nonces (Intel Trust Authority held
data, NVIDIA GPU SPDM nonces) binds ``binding_digest(nonce, thumbprint)``: SHA-256 over the
ASCII of the broker nonce followed by the ASCII of the runner key thumbprint (both 43-character
base64url strings, so the concatenation is unambiguous).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from broker.core.encoding import b64url_encode
from broker.core.errors import AttestationError, ErrorCode

MAX_EAT_NONCES = 16


def eat_nonce_values(claim: Any) -> list[str]:
    """Normalise ``eat_nonce`` (string or array of strings) to a list.

    Raises:
        AttestationError: ``nonce_missing`` when absent or empty, ``token_claim_invalid`` when
            it has another shape.
    """
    if claim in (None, [], ""):
        raise AttestationError(
            "token carries no eat_nonce; request it with the broker nonce",
            code=ErrorCode.NONCE_MISSING,
        )
    values = [claim] if isinstance(claim, str) else claim
    if (
        not isinstance(values, list)
        or len(values) > MAX_EAT_NONCES
        or not all(isinstance(v, str) for v in values)
    ):
        raise AttestationError(
            "token eat_nonce is not a string or an array of strings",
            code=ErrorCode.TOKEN_CLAIM_INVALID,
        )
    return values


def check_eat_nonce(claim: Any, *, nonce: str, thumbprint: str) -> None:
    """Require both the broker nonce and the runner key thumbprint in ``eat_nonce``.

    Raises:
        AttestationError: ``nonce_missing``, ``nonce_mismatch`` or ``key_binding_mismatch``.
    """
    values = eat_nonce_values(claim)
    if not _contains(values, nonce):
        raise AttestationError(
            "token eat_nonce does not contain this request's nonce", code=ErrorCode.NONCE_MISMATCH
        )
    if not _contains(values, thumbprint):
        raise AttestationError(
            "token eat_nonce does not bind runner_key (RFC 7638 thumbprint missing)",
            code=ErrorCode.KEY_BINDING_MISMATCH,
        )


def _contains(values: list[str], expected: str) -> bool:
    found = False
    for value in values:
        found |= hmac.compare_digest(value.encode(), expected.encode())
    return found


def binding_digest(nonce: str, thumbprint: str) -> bytes:
    """SHA-256(nonce || thumbprint): the 32 bytes a runner puts in ITA user data / GPU nonces."""
    return hashlib.sha256(nonce.encode("ascii") + thumbprint.encode("ascii")).digest()


def same_bytes(left: bytes, right: bytes) -> bool:
    return hmac.compare_digest(left, right)


def attestation_thumbprint(encryption_thumbprint: str, pop_thumbprint: str) -> str:
    """What an attestation's evidence binds in the runner-key slot (``POST /v1/attest``): both
    runner keys at once, as base64url(SHA-256) of the canonical JSON
    ``{"encryption_key": <thumbprint>, "pop_key": <thumbprint>}`` — 43 characters, like one
    key's thumbprint, so every evidence kind binds it the way it binds a release's key."""
    document = json.dumps(
        {"encryption_key": encryption_thumbprint, "pop_key": pop_thumbprint},
        separators=(",", ":"),
        sort_keys=True,
    )
    return b64url_encode(hashlib.sha256(document.encode("ascii")).digest())
