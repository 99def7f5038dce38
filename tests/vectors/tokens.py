"""Test tokens minted from the fixed keys in this folder at fixed times."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from broker.crypto.jwk import public_jwk

HERE = Path(__file__).parent
ISSUER = "https://issuer.test.invalid"
AUDIENCE = "https://broker.test.invalid"
KID = "test-issuer-key-1"
NOW = datetime(2026, 1, 15, 12, 0, 0, tzinfo=UTC)
DIGEST = "sha256:" + "ab" * 32


@cache
def key(name: str = "issuer_rsa.pem") -> rsa.RSAPrivateKey:
    loaded = serialization.load_pem_private_key((HERE / name).read_bytes(), password=None)
    assert isinstance(loaded, rsa.RSAPrivateKey)
    return loaded


def jwks(kid: str = KID, alg: str | None = "RS256") -> dict[str, Any]:
    entry: dict[str, Any] = {**public_jwk(key().public_key()), "kid": kid, "use": "sig"}
    if alg:
        entry["alg"] = alg
    return {"keys": [entry]}


def claims(**overrides: Any) -> dict[str, Any]:
    issued = int(NOW.timestamp())
    base: dict[str, Any] = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "iat": issued,
        "nbf": issued,
        "exp": issued + 3600,
        "sub": "https://www.googleapis.com/compute/v1/projects/p/zones/z/instances/i",
        "eat_nonce": ["nonce-placeholder-0000", "thumbprint-placeholder"],
        "secboot": True,
        "hwmodel": "GCP_INTEL_TDX",
        "swname": "CONFIDENTIAL_SPACE",
        "swversion": ["250301"],
        "dbgstat": "disabled-since-boot",
        "submods": {
            "confidential_space": {"support_attributes": ["STABLE", "LATEST"]},
            "container": {"image_digest": DIGEST, "image_reference": "r/img:1"},
            "gce": {"project_id": "p", "zone": "z", "instance_id": "1", "instance_name": "i"},
        },
    }
    base.update(overrides)
    return base


def sign(
    payload: dict[str, Any],
    *,
    headers: dict[str, Any] | None = None,
    signer: str = "issuer_rsa.pem",
    alg: str = "RS256",
) -> str:
    return jwt.encode(payload, key(signer), algorithm=alg, headers={"kid": KID, **(headers or {})})


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned(header: dict[str, Any], payload: dict[str, Any], signature: bytes = b"") -> str:
    """Hand-assemble a JWS (for attacks that a JWT library refuses to produce)."""
    return ".".join(
        [b64(json.dumps(header).encode()), b64(json.dumps(payload).encode()), b64(signature)]
    )
