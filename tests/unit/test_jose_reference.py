"""Differential test: our JWS signature check (``jose.verify_jws``, cryptography directly) against
PyJWT, the reference implementation it replaced, on generated and mutated tokens.

For every algorithm the broker can be configured with (RS256, PS384 and, for completeness, the
other RS/PS/ES sizes) tokens are signed by PyJWT, then mutated: a flipped byte in the signature,
the payload or the header, a truncated or extended signature, a signature from another key, an
alg header that does not fit the key. Both sides must agree on accept/refuse for every token.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from broker.core.encoding import b64url_decode
from broker.core.errors import AttestationError
from broker.crypto import jose

NOW = datetime(2026, 1, 1, tzinfo=UTC)
RSA_KEYS = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(2)]
EC_KEYS = {
    "ES256": [ec.generate_private_key(ec.SECP256R1()) for _ in range(2)],
    "ES384": [ec.generate_private_key(ec.SECP384R1()) for _ in range(2)],
    "ES512": [ec.generate_private_key(ec.SECP521R1()) for _ in range(2)],
}
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512"]


def keys_for(alg: str) -> list[object]:
    return list(RSA_KEYS) if alg[:2] in ("RS", "PS") else list(EC_KEYS[alg])


def mutate(token: str, rng: random.Random, other: str) -> str:
    head, body, sig = token.split(".")
    choice = rng.randrange(7)
    if choice == 0:
        return token
    if choice == 1:  # flip one character of a part
        part = rng.choice([0, 1, 2])
        pieces = [head, body, sig]
        text = pieces[part]
        index = rng.randrange(len(text))
        replacement = rng.choice(
            [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789-_" if c != text[index]]
        )
        pieces[part] = text[:index] + replacement + text[index + 1 :]
        return ".".join(pieces)
    if choice == 2:
        return f"{head}.{body}.{sig[:-4]}"
    if choice == 3:
        return f"{head}.{body}.{sig}AAAA"
    if choice == 4:  # a signature made by another key over another token
        return f"{head}.{body}.{other.split('.')[2]}"
    if choice == 5:
        return f"{head}.{body}."
    return f"{head}.{other.split('.')[1]}.{sig}"  # payload swapped


def reference_accepts(token: str, key: object, alg: str) -> bool:
    try:
        jwt.decode(
            token,
            key=key,  # type: ignore[arg-type]
            algorithms=[alg],
            options={"verify_exp": False, "verify_iat": False, "verify_nbf": False},
        )
    except jwt.InvalidTokenError:
        return False
    return True


def ours_accepts(token: str, key: object, alg: str) -> bool:
    try:
        header = jose.parse_header(token, [alg])
        jose.verify_jws(token, header, key, now=NOW, required_claims=("exp", "iat"))
    except AttestationError:
        return False
    return True


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_signature_check_agrees_with_pyjwt(alg: str) -> None:
    rng = random.Random(alg)
    signer, stranger = keys_for(alg)
    agreed = accepted = 0
    for number in range(120):
        claims = {
            "iat": int(NOW.timestamp()) - 10,
            "exp": int(NOW.timestamp()) + 600,
            "sub": f"runner-{number}",
            "n": rng.randrange(10**9),
        }
        token = jwt.encode(claims, signer, algorithm=alg)  # type: ignore[arg-type]
        other = jwt.encode({**claims, "sub": "other"}, stranger, algorithm=alg)  # type: ignore[arg-type]
        candidate = mutate(token, rng, other)
        public = signer.public_key()  # type: ignore[attr-defined]
        expected = reference_accepts(candidate, public, alg)
        assert ours_accepts(candidate, public, alg) is expected, (alg, number, candidate)
        agreed += 1
        accepted += expected
    assert agreed == 120
    assert 0 < accepted < 120  # both outcomes were exercised


def test_alg_that_does_not_fit_the_key_is_refused() -> None:
    token = jwt.encode({"iat": 1, "exp": 2}, RSA_KEYS[0], algorithm="RS256")
    header = jose.parse_header(token, ["RS256"])
    with pytest.raises(AttestationError) as caught:
        jose.verify_jws(token, header, EC_KEYS["ES256"][0].public_key(), now=NOW)
    assert caught.value.code.value == "token_algorithm_forbidden"


def test_ecdsa_curve_must_match_the_alg() -> None:
    token = jwt.encode({"iat": 1, "exp": 2}, EC_KEYS["ES384"][0], algorithm="ES384")
    header = jose.parse_header(token, ["ES384"])
    with pytest.raises(AttestationError):
        jose.verify_jws(token, header, EC_KEYS["ES256"][0].public_key(), now=NOW)


def test_non_canonical_base64_is_refused_like_pyjwt_does() -> None:
    """A signature spelled with other unused trailing bits decodes to the same bytes; PyJWT
    refuses it and so must we (one signed token, one spelling)."""
    now = int(NOW.timestamp())
    token = jwt.encode({"iat": now - 10, "exp": now + 600}, RSA_KEYS[0], algorithm="PS512")
    assert ours_accepts(token, RSA_KEYS[0].public_key(), "PS512")  # the canonical spelling
    head, body, signature = token.split(".")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    canonical = b64url_decode(signature)
    variants = []
    for char in alphabet:
        spelled = signature[:-1] + char
        if char != signature[-1] and _loose(spelled) == canonical:
            variants.append(f"{head}.{body}.{spelled}")
    assert variants  # 2048-bit signatures leave unused bits in the last character
    for variant in variants:
        assert not reference_accepts(variant, RSA_KEYS[0].public_key(), "PS512")
        assert not ours_accepts(variant, RSA_KEYS[0].public_key(), "PS512")


def _loose(text: str) -> bytes:
    import base64  # noqa: PLC0415

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
