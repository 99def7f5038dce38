"""Query keys: clients encrypt inference queries to a broker-published HPKE public key.

The broker publishes each query key's public half in a statement it signs (ES256 JWS) with
``[keys] signing_key``: ``{"key", "version", "kem", "suite", "public_key", "policy_digest",
"iat"}``. A client pins the broker's statement key, verifies the statement, and seals queries
with HPKE, ``info`` binding the key name and version. Only a runner that the policy allowed gets
the private half (through ``/v1/release``) and can open them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError
from broker.core.protocol import Algorithm
from broker.crypto import hpke, jose
from broker.crypto.jwk import public_jwk, thumbprint

KEM_OF_ALGORITHM = {Algorithm.HPKE_X25519: hpke.X25519, Algorithm.HPKE_MLKEM768_X25519: hpke.HYBRID}
STATEMENT_TYPE = "broker-query-key+jwt"


class StatementError(ValueError):
    """A query-key statement does not verify."""


@dataclass(frozen=True)
class QueryPublicKey:
    key: str
    version: int
    kem: str
    public_key: hpke.HpkePublicKey
    policy_digest: str
    public_raw: bytes = (
        b""  # the raw encoding (HPKE contexts need it; the hybrid key object hides it)
    )


def query_info(key: str, version: int) -> bytes:
    return hpke.context_info({"key": key, "purpose": "query", "version": version})


def sign_statement(
    signer: ec.EllipticCurvePrivateKey,
    *,
    key: str,
    version: int,
    algorithm: Algorithm,
    public_raw: bytes,
    policy_digest: str,
    now: datetime,
) -> str:
    kem = KEM_OF_ALGORITHM[algorithm]
    claims = {
        "key": key,
        "version": version,
        "kem": kem,
        "suite": hpke.SUITE_NAMES[kem],
        "public_key": b64url_encode(public_raw),
        "policy_digest": policy_digest,
        "iat": int(now.timestamp()),
    }
    kid = thumbprint(public_jwk(signer.public_key()))
    return jwt.encode(
        claims, signer, algorithm="ES256", headers={"kid": kid, "typ": STATEMENT_TYPE}
    )


def verify_statement(
    statement: str, signing_key: ec.EllipticCurvePublicKey, *, now: datetime
) -> QueryPublicKey:
    """Verify a statement with the pinned broker statement key, by the one JWS verifier
    (``jose.verify_jws``: ES256 only, ``iat`` required and not in the future at ``now``).

    Raises:
        StatementError: when the signature, type or contents are wrong.
    """
    try:
        header = jose.parse_header(statement, ("ES256",))
        claims = jose.verify_jws(
            statement, header, signing_key, now=now, required_claims=("iat",)
        ).claims
    except AttestationError as exc:
        raise StatementError("statement does not verify with the broker statement key") from exc
    if header.fields.get("typ") != STATEMENT_TYPE:
        raise StatementError("not a query-key statement")
    try:
        raw = b64url_decode(str(claims["public_key"]))
        public = hpke.public_from_raw(str(claims["kem"]), raw)
        return QueryPublicKey(
            public_raw=raw,
            key=str(claims["key"]),
            version=int(claims["version"]),
            kem=str(claims["kem"]),
            public_key=public,
            policy_digest=str(claims["policy_digest"]),
        )
    except (KeyError, ValueError) as exc:
        raise StatementError("statement contents are malformed") from exc


def seal_query(target: QueryPublicKey, query: bytes) -> bytes:
    return hpke.seal(query, target.public_key, query_info(target.key, target.version))


def open_query(
    ciphertext: bytes, *, secret: bytes, algorithm: str, key: str, version: int
) -> bytes:
    """Open a query with a released query key (``ReleasedDek.dek`` and its ``algorithm``).

    Raises:
        HpkeError: when it does not open.
    """
    kem = KEM_OF_ALGORITHM[Algorithm(algorithm)]
    private = hpke.private_from_secret(kem, secret)
    return hpke.open_(ciphertext, private, query_info(key, version))


def statement_jwks(signer: ec.EllipticCurvePrivateKey) -> dict[str, Any]:
    jwk = public_jwk(signer.public_key())
    return {"keys": [{**jwk, "kid": thumbprint(jwk), "alg": "ES256", "use": "sig"}]}
