"""Attestation tokens attacked in their header, claims and signature."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from typing import Any

from broker.core.encoding import b64url_decode, b64url_encode
from broker.dev.issuer import DevIssuer
from tests.integration.hostile.common import (
    DELETE,
    Case,
    Ctx,
    Fresh,
    release,
    utc_now,
)
from tests.support.constants import DENIED

# --- token header and claim attacks -----------------------------------------------------------


def _raw_token(header: dict[str, Any], claims: dict[str, Any], signature: bytes) -> str:
    head = b64url_encode(json.dumps(header).encode())
    body = b64url_encode(json.dumps(claims).encode())
    return f"{head}.{body}.{b64url_encode(signature)}"


def token_case(
    name: str,
    status: int,
    code: str,
    *,
    claims: dict[str, Any] | None = None,
    header: dict[str, Any] | None = None,
    craft: Callable[[Ctx, Fresh], str] | None = None,
) -> Case:
    async def build(ctx: Ctx) -> Any:
        fresh = await ctx.fresh()
        if craft is not None:
            token = craft(ctx, fresh)
        else:
            full_header = None if header is None else {"kid": ctx.issuer.kid, **header}
            token = ctx.resign(fresh.claims, claims or {}, full_header)
        return fresh.body(evidence={"gca": token})

    return release(f"token.{name}", build, status, code)


def _hs256(ctx: Ctx, fresh: Fresh) -> str:
    header = {"alg": "HS256", "typ": "JWT", "kid": ctx.issuer.kid}
    secret = json.dumps(ctx.issuer.jwks()).encode()
    head = b64url_encode(json.dumps(header).encode())
    body = b64url_encode(json.dumps(fresh.claims).encode())
    mac = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64url_encode(mac)}"


def _tamper_payload(ctx: Ctx, fresh: Fresh) -> str:
    head, _, sig = fresh.token.split(".")
    claims = {
        **fresh.claims,
        "submods": {**fresh.claims["submods"], "container": {"image_digest": DENIED}},
    }
    return f"{head}.{b64url_encode(json.dumps(claims).encode())}.{sig}"


def _flip_signature(ctx: Ctx, fresh: Fresh) -> str:
    head, body, sig = fresh.token.split(".")
    raw = bytearray(b64url_decode(sig))
    raw[-1] ^= 1
    return f"{head}.{body}.{b64url_encode(bytes(raw))}"


def _attacker_signed(ctx: Ctx, fresh: Fresh) -> str:
    attacker = DevIssuer(dev_mode=True, issuer=ctx.issuer.issuer)
    return attacker.sign(fresh.claims, {"kid": ctx.issuer.kid})


def token_cases() -> list[Case]:
    now = int(utc_now().timestamp())
    cases = [
        token_case(
            "alg_none",
            401,
            "token_algorithm_forbidden",
            craft=lambda c, f: _raw_token({"alg": "none", "kid": c.issuer.kid}, f.claims, b""),
        ),
        token_case(
            "alg_none_upper",
            401,
            "token_algorithm_forbidden",
            craft=lambda c, f: _raw_token({"alg": "None", "kid": c.issuer.kid}, f.claims, b""),
        ),
        token_case("hs256_with_public_key", 401, "token_algorithm_forbidden", craft=_hs256),
        token_case(
            "alg_rs512",
            401,
            "token_algorithm_forbidden",
            craft=lambda c, f: _raw_token(
                {"alg": "RS512", "kid": c.issuer.kid}, f.claims, b"x" * 256
            ),
        ),
        token_case(
            "alg_ps256",
            401,
            "token_algorithm_forbidden",
            craft=lambda c, f: _raw_token(
                {"alg": "PS256", "kid": c.issuer.kid}, f.claims, b"x" * 256
            ),
        ),
        token_case(
            "alg_es256",
            401,
            "token_algorithm_forbidden",
            craft=lambda c, f: _raw_token(
                {"alg": "ES256", "kid": c.issuer.kid}, f.claims, b"x" * 64
            ),
        ),
        token_case(
            "alg_missing",
            401,
            "token_algorithm_forbidden",
            craft=lambda c, f: _raw_token({"kid": c.issuer.kid}, f.claims, b"x"),
        ),
        token_case(
            "alg_number",
            401,
            "token_algorithm_forbidden",
            craft=lambda c, f: _raw_token({"alg": 256, "kid": c.issuer.kid}, f.claims, b"x"),
        ),
        token_case(
            "jku_header",
            401,
            "token_header_forbidden",
            header={"jku": "https://attacker.invalid/jwks"},
        ),
        token_case(
            "x5u_header",
            401,
            "token_header_forbidden",
            header={"x5u": "https://attacker.invalid/c.pem"},
        ),
        token_case(
            "jwk_header",
            401,
            "token_header_forbidden",
            header={"jwk": {"kty": "RSA", "n": "AQAB", "e": "AQAB"}},
        ),
        token_case("crit_header", 401, "token_header_forbidden", header={"crit": ["exp"]}),
        token_case("x5c_without_pki", 401, "token_header_forbidden", header={"x5c": ["AAAA"]}),
        token_case(
            "kid_missing", 401, "token_malformed", craft=lambda c, f: c.issuer.sign(f.claims, {})
        ),
        token_case(
            "kid_number",
            401,
            "token_malformed",
            craft=lambda c, f: _raw_token({"alg": "RS256", "kid": 7}, f.claims, b"x"),
        ),
        token_case(
            "kid_unknown",
            401,
            "token_key_unknown",
            craft=lambda c, f: c.issuer.sign(f.claims, {"kid": "not-a-known-kid"}),
        ),
        token_case(
            "header_not_json",
            401,
            "token_malformed",
            craft=lambda c, f: b64url_encode(b"not json") + "." + f.token.split(".", 1)[1],
        ),
        token_case(
            "header_array",
            401,
            "token_malformed",
            craft=lambda c, f: b64url_encode(b"[]") + "." + f.token.split(".", 1)[1],
        ),
        token_case(
            "payload_not_json",
            401,
            "token_malformed",
            craft=lambda c, f: f.token.split(".")[0] + "." + b64url_encode(b"{oops") + ".sig",
        ),
        token_case(
            "two_parts", 401, "token_malformed", craft=lambda c, f: ".".join(f.token.split(".")[:2])
        ),
        token_case("four_parts", 401, "token_malformed", craft=lambda c, f: f.token + ".x"),
        token_case(
            "bad_base64",
            401,
            "token_malformed",
            craft=lambda c, f: "!!!." + f.token.split(".", 1)[1],
        ),
        token_case(
            "padded_base64",
            401,
            "token_malformed",
            craft=lambda c, f: f.token.split(".")[0] + "==." + f.token.split(".", 1)[1],
        ),
        token_case(
            "signature_stripped",
            401,
            "token_signature_invalid",
            craft=lambda c, f: f.token.rsplit(".", 1)[0] + ".",
        ),
        token_case("signature_flipped", 401, "token_signature_invalid", craft=_flip_signature),
        token_case("payload_tampered", 401, "token_signature_invalid", craft=_tamper_payload),
        token_case(
            "signed_by_attacker_same_kid", 401, "token_signature_invalid", craft=_attacker_signed
        ),
        token_case("too_large", 401, "token_too_large", craft=lambda c, f: f.token + "A" * 70_000),
        token_case(
            "iss_unknown", 401, "issuer_unknown", claims={"iss": "https://attacker.invalid"}
        ),
        token_case(
            "iss_google_spoof",
            401,
            "issuer_unknown",
            claims={"iss": "https://confidentialcomputing.googleapis.com"},
        ),
        token_case("iss_missing", 401, "token_malformed", claims={"iss": DELETE}),
        token_case(
            "iss_number",
            401,
            "token_malformed",
            craft=lambda c, f: _raw_token(
                {"alg": "RS256", "kid": c.issuer.kid}, {**f.claims, "iss": 1}, b"x"
            ),
        ),
        token_case("aud_wrong", 401, "audience_mismatch", claims={"aud": "https://other.invalid"}),
        token_case(
            "aud_list_without_us",
            401,
            "audience_mismatch",
            claims={"aud": ["https://other.invalid"]},
        ),
        token_case("aud_missing", 401, "token_claim_missing", claims={"aud": DELETE}),
        token_case(
            "exp_past",
            401,
            "token_expired",
            claims={"exp": now - 600, "iat": now - 1200, "nbf": now - 1200},
        ),
        token_case("exp_missing", 401, "token_claim_missing", claims={"exp": DELETE}),
        token_case("exp_string", 401, "token_claim_invalid", claims={"exp": "tomorrow"}),
        token_case("nbf_future", 401, "token_not_yet_valid", claims={"nbf": now + 600}),
        token_case(
            "iat_future", 401, "token_issued_in_future", claims={"iat": now + 600, "nbf": now}
        ),
        token_case("iat_missing", 401, "token_claim_missing", claims={"iat": DELETE}),
        token_case("lifetime_too_long", 401, "token_claim_invalid", claims={"exp": now + 7200}),
        token_case("eat_nonce_missing", 401, "nonce_missing", claims={"eat_nonce": DELETE}),
        token_case(
            "eat_nonce_other",
            401,
            "nonce_mismatch",
            claims={"eat_nonce": ["other-nonce-value-000000000", "x" * 43]},
        ),
        token_case("eat_nonce_number", 401, "token_claim_invalid", claims={"eat_nonce": 5}),
        token_case(
            "eat_nonce_without_thumbprint",
            401,
            "key_binding_mismatch",
            craft=lambda c, f: c.resign(f.claims, {"eat_nonce": [f.nonce, "A" * 43]}, None),
        ),
        token_case("debug_image", 403, "policy_denied", claims={"dbgstat": "enabled"}),
        token_case(
            "image_not_allowed",
            403,
            "policy_denied",
            craft=lambda c, f: c.resign(
                f.claims,
                {
                    "submods": {
                        **f.claims["submods"],
                        "container": {**f.claims["submods"]["container"], "image_digest": DENIED},
                    }
                },
                None,
            ),
        ),
        token_case("secure_boot_off", 403, "policy_denied", claims={"secboot": False}),
        token_case("swname_other", 403, "policy_denied", claims={"swname": "GCE"}),
    ]

    async def empty_token(ctx: Ctx) -> Any:
        return (await ctx.fresh()).body(evidence={"gca": ""})

    async def number_token(ctx: Ctx) -> Any:
        return (await ctx.fresh()).body(evidence={"gca": 12})

    cases.append(release("token.empty", empty_token, 400, "bad_request"))
    cases.append(release("token.number", number_token, 400, "bad_request"))
    return cases
