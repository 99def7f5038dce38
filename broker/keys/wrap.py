"""Wrapping a released DEK to the runner's ephemeral key.

The JWE protected header (the AEAD's associated data) carries ``kid = <key>#<version>`` and the
decision id, so a wrapped key cannot be passed off as another key, version or release.
"""

from __future__ import annotations

from broker.crypto import jwe
from broker.crypto.jwk import RunnerKey

DECISION_HEADER = "decision_id"


def key_id(name: str, version: int) -> str:
    return f"{name}#{version}"


def wrap_to_runner(
    dek: bytes, runner_key: RunnerKey, *, name: str, version: int, decision_id: str
) -> str:
    """A compact JWE of ``dek`` for ``runner_key`` with the release bound in its header."""
    header = {"kid": key_id(name, version), DECISION_HEADER: decision_id, "cty": "dek"}
    return jwe.encrypt(dek, runner_key, header)
