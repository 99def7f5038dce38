"""The hostile-input table: every endpoint, as an attacker would call it. Each case names the
exact status and error code it must get; ``logged`` marks release requests whose body parsed,
which must each leave exactly one decision record.

Cases are generated from small tables (fields x wrong values, JWK members, token headers and
claims, evidence shapes), so adding a row adds cases. ``test_hostile_inputs.py`` runs them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from broker.attestation.binding import binding_digest
from broker.attestation.jose import b64url_decode, b64url_encode
from broker.client.sdk import new_ephemeral_key
from broker.crypto.jwk import public_jwk, thumbprint
from broker.dev.issuer import DevIssuer, Workload
from tests.integration.conftest import ALLOWED, DENIED, GPU_KEY, KEY, QUERY_KEY
from tests.vectors.gpu import SimulatedGpu, SimulatedNras, pem

ADMIN_TOKEN = "hostile-suite-admin-token-7c1e"
DELETE = object()  # a claim override that removes the claim
NO_BODY = object()  # a request without a body (``None`` is the JSON body ``null``)


@dataclass
class Fresh:
    """A fresh, well-formed release: nonce, runner key, thumbprint, bound token."""

    nonce: str
    jwk: dict[str, str]
    thumb: str
    claims: dict[str, Any]
    token: str

    def body(self, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "key": KEY,
            "nonce": self.nonce,
            "evidence": {"gca": self.token},
            "runner_key": self.jwk,
        }
        for name, value in fields.items():
            if value is DELETE:
                body.pop(name, None)
            else:
                body[name] = value
        return body

    @property
    def gpu_nonce(self) -> bytes:
        return binding_digest(self.nonce, self.thumb)


@dataclass
class Ctx:
    """What case bodies are built from (set up by the test)."""

    issuer: DevIssuer
    audience: str
    gpu: SimulatedGpu
    nras: SimulatedNras
    stranger_gpu: SimulatedGpu
    challenge: Callable[[], Awaitable[str]]

    async def fresh(self, *, digest: str = ALLOWED, gpu_cc_mode: str | None = None) -> Fresh:
        nonce = await self.challenge()
        jwk = public_jwk(new_ephemeral_key().public_key())
        thumb = thumbprint(jwk)
        token = self.issuer.mint(
            audience=self.audience,
            nonces=[nonce, thumb],
            workload=Workload(image_digest=digest, gpu_cc_mode=gpu_cc_mode),
            now=_now(),
        )
        claims = json.loads(b64url_decode(token.split(".")[1]))
        return Fresh(nonce, jwk, thumb, claims, token)

    def resign(
        self, claims: dict[str, Any], overrides: dict[str, Any], header: dict[str, Any] | None
    ) -> str:
        changed = {k: v for k, v in {**claims, **overrides}.items() if v is not DELETE}
        return self.issuer.sign(changed, header)


def _now() -> Any:
    from datetime import UTC, datetime  # noqa: PLC0415

    return datetime.now(UTC)


Body = Callable[[Ctx], Awaitable[Any]]


@dataclass
class Case:
    name: str
    method: str
    path: str
    status: int
    code: str | None  # None: a success
    body: Any = NO_BODY  # JSON value, raw bytes, or an async builder taking Ctx
    headers: dict[str, str] = field(default_factory=dict)
    logged: bool = False  # a release whose body parsed: exactly one decision record
    admin: bool = False  # send the admin bearer token


def fresh_body(**fields: Any) -> Body:
    async def build(ctx: Ctx) -> Any:
        return (await ctx.fresh()).body(**fields)

    return build


def release(name: str, body: Any, status: int, code: str | None, *, logged: bool = True) -> Case:
    return Case(name, "POST", "/v1/release", status, code, body, logged=logged)


# --- JSON shape and type confusion --------------------------------------------------------

WRONG_VALUES: dict[str, Any] = {
    "null": None,
    "true": True,
    "zero": 0,
    "float": 1.5,
    "negative": -1,
    "empty": "",
    "array": [],
    "object": {},
    "nested": [[{}]],
    "nul": "\u0000",
    "huge_int": 10**30,
    "long": "x" * 5000,
}
FIELD_CODES = {"key": "bad_request", "nonce": "bad_request", "runner_key": "runner_key_invalid"}


def shape_cases() -> list[Case]:
    cases = []
    for field_name, code in FIELD_CODES.items():
        for label, value in WRONG_VALUES.items():
            if field_name == "nonce" and label == "nul":
                continue  # a one-character string is a well-formed (unknown) nonce: below
            cases.append(
                release(
                    f"release.{field_name}={label}",
                    fresh_body(**{field_name: value}),
                    400,
                    code,
                )
            )
    for label, value in WRONG_VALUES.items():
        if label != "null":  # version null means "latest"
            cases.append(
                release(f"release.version={label}", fresh_body(version=value), 400, "bad_request")
            )
        cases.append(release(f"release.wrap={label}", fresh_body(wrap=value), 400, "bad_request"))
        evidence_code = "bad_request"
        cases.append(
            release(f"release.evidence={label}", fresh_body(evidence=value), 400, evidence_code)
        )
    for missing in ("key", "nonce", "evidence", "runner_key"):
        cases.append(
            release(
                f"release.missing.{missing}",
                fresh_body(**{missing: DELETE}),
                400,
                "bad_request",
                logged=False,
            )
        )
    cases.append(
        release("release.unknown_field", fresh_body(extra=1), 400, "bad_request", logged=False)
    )
    cases.append(release("release.version=0", fresh_body(version=0), 400, "bad_request"))
    cases.append(
        release("release.version=2^31+1", fresh_body(version=2**31 + 1), 400, "bad_request")
    )
    cases.append(release("release.wrap=JWE", fresh_body(wrap="JWE"), 400, "bad_request"))
    for label, top in {"array": [], "string": "x", "number": 1, "null": None, "true": True}.items():
        cases.append(release(f"release.top={label}", top, 400, "bad_request", logged=False))
    bad_names = ["Models/UPPER", "../etc/passwd", "a" * 200, "models//x", "/abs", "models/x y", "é"]
    for index, name in enumerate(bad_names):
        cases.append(
            release(f"release.key.bad_name[{index}]", fresh_body(key=name), 400, "bad_request")
        )
    cases.append(release("release.key.unknown", fresh_body(key="models/none"), 404, "key_unknown"))
    cases.append(release("release.version.unknown", fresh_body(version=99), 404, "key_unknown"))
    return cases


# --- sizes, nesting, encodings, content types ------------------------------------------------


def wire_cases(max_body: int) -> list[Case]:
    ok_json = {"Content-Type": "application/json"}
    cases = [
        release(
            "wire.over_limit", b"{" + b" " * max_body + b"}", 413, "body_too_large", logged=False
        ),
        release("wire.empty", b"", 400, "malformed_json", logged=False),
        release("wire.whitespace", b"   ", 400, "malformed_json", logged=False),
        release("wire.trailing_garbage", b"{} x", 400, "malformed_json", logged=False),
        release("wire.invalid_utf8", b'{"key": "\xff\xfe"}', 400, "malformed_json", logged=False),
        release("wire.bom", b'\xef\xbb\xbf{"key": "x"}', 400, "malformed_json", logged=False),
        release("wire.nan", b'{"key": NaN}', 400, "malformed_json", logged=False),
        release("wire.infinity", b'{"version": Infinity}', 400, "malformed_json", logged=False),
        release(
            "wire.duplicate_members",
            b'{"key": "a", "key": "b"}',
            400,
            "malformed_json",
            logged=False,
        ),
        release("wire.single_quotes", b"{'key': 'a'}", 400, "malformed_json", logged=False),
        release("wire.utf16", '{"key": "a"}'.encode("utf-16"), 400, "malformed_json", logged=False),
        release("wire.lone_surrogate_key", fresh_body(key="\ud800"), 400, "bad_request"),
    ]
    for depth in (65, 500, 5000, 40_000):
        cases.append(
            release(
                f"wire.nested_array[{depth}]",
                b"[" * depth + b"]" * depth,
                400,
                "malformed_json",
                logged=False,
            )
        )
        cases.append(
            release(
                f"wire.nested_object[{depth}]",
                b'{"a":' * depth + b"1" + b"}" * depth,
                400,
                "malformed_json",
                logged=False,
            )
        )

    async def deep_evidence(ctx: Ctx) -> Any:
        nested: Any = "x"
        for _ in range(80):
            nested = {"a": nested}
        return (await ctx.fresh()).body(evidence={"nvidia": nested})

    cases.append(
        release("wire.nested_evidence", deep_evidence, 400, "malformed_json", logged=False)
    )
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "application/jsonx",
        "multipart/form-data; boundary=x",
    ):
        case = release(
            f"wire.content_type={content_type}", b"{}", 415, "unsupported_media_type", logged=False
        )
        case.headers = {"Content-Type": content_type}
        cases.append(case)
    missing = release("wire.no_content_type", b"{}", 415, "unsupported_media_type", logged=False)
    missing.headers = {"Content-Type": ""}
    cases.append(missing)
    # (not "br": whether aiohttp's parser knows it depends on an optional package)
    for encoding in ("gzip", "deflate", "compress", "identity, gzip"):
        case = release(
            f"wire.encoding={encoding}",
            b"\x1f\x8bgarbage",
            415,
            "unsupported_media_type",
            logged=False,
        )
        case.headers = {**ok_json, "Content-Encoding": encoding}
        cases.append(case)
    challenge_junk = Case(
        "challenge.body=junk", "POST", "/v1/challenge", 400, "malformed_json", b"{oops"
    )
    challenge_extra = Case(
        "challenge.body=unknown_field", "POST", "/v1/challenge", 400, "bad_request", {"a": 1}
    )
    challenge_array = Case("challenge.body=array", "POST", "/v1/challenge", 400, "bad_request", [])
    challenge_text = Case(
        "challenge.content_type",
        "POST",
        "/v1/challenge",
        415,
        "unsupported_media_type",
        b"{}",
        headers={"Content-Type": "text/plain"},
    )
    challenge_big = Case(
        "challenge.over_limit",
        "POST",
        "/v1/challenge",
        413,
        "body_too_large",
        b"{" + b" " * max_body + b"}",
    )
    return [*cases, challenge_junk, challenge_extra, challenge_array, challenge_text, challenge_big]


# --- runner keys (JWK edge cases) ---------------------------------------------------------------

B64_32 = b64url_encode(b"\x09" + bytes(31))


def jwk_cases() -> list[Case]:
    ec = public_jwk(new_ephemeral_key().public_key())
    rsa = public_jwk(new_ephemeral_key("RSA-3072").public_key())
    small = [
        "00" * 32,
        "01" + "00" * 31,
        "ec" + "ff" * 30 + "7f",
        "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
    ]
    keys: dict[str, Any] = {
        "kty_missing": {"crv": "P-256", "x": ec["x"], "y": ec["y"]},
        "kty_unknown": {**ec, "kty": "oct"},
        "kty_lower": {**ec, "kty": "ec"},
        "ec_p521": {**ec, "crv": "P-521"},
        "ec_secp256k1": {**ec, "crv": "secp256k1"},
        "ec_missing_y": {k: v for k, v in ec.items() if k != "y"},
        "ec_short_x": {**ec, "x": ec["x"][:-2]},
        "ec_off_curve": {**ec, "y": ec["x"]},
        "ec_private_d": {**ec, "d": ec["x"]},
        "ec_padded_b64": {**ec, "x": ec["x"] + "="},
        "ec_std_b64": {**ec, "x": ec["x"].replace("-", "+").replace("_", "/") + "+"},
        "ec_x_number": {**ec, "x": 12345},
        "ec_zero_point": {**ec, "x": b64url_encode(bytes(32)), "y": b64url_encode(bytes(32))},
        "rsa_1024": {"kty": "RSA", "n": b64url_encode(b"\xc1" + bytes(126) + b"\x01"), "e": "AQAB"},
        "rsa_e_even": {**rsa, "e": b64url_encode(b"\x01\x00\x00")},
        "rsa_e_one": {**rsa, "e": "AQ"},
        "rsa_n_even": {**rsa, "n": b64url_encode(b"\xc1" + bytes(254) + b"\x02")},
        "rsa_private": {**rsa, "d": rsa["n"], "p": rsa["e"]},
        "rsa_9000_bits": {
            "kty": "RSA",
            "n": b64url_encode(b"\xc1" + bytes(1125) + b"\x01"),
            "e": "AQAB",
        },
        "okp_ed25519": {"kty": "OKP", "crv": "Ed25519", "x": B64_32},
        "okp_short": {"kty": "OKP", "crv": "X25519", "x": B64_32[:-4]},
        "okp_long": {"kty": "OKP", "crv": "X25519", "x": b64url_encode(bytes(33))},
        "hpke_wrong_kem": {"kty": "HPKE", "kem": "X25519", "pk": B64_32},
        "hpke_short_pk": {"kty": "HPKE", "kem": "MLKEM768-X25519", "pk": B64_32},
        "hpke_huge_pk": {"kty": "HPKE", "kem": "MLKEM768-X25519", "pk": "A" * 5000},
        "list": [ec],
        "string": json.dumps(ec),
    }
    for index, point in enumerate(small):
        keys[f"x25519_small_order[{index}]"] = {
            "kty": "OKP",
            "crv": "X25519",
            "x": b64url_encode(bytes.fromhex(point)),
        }
    cases = [
        release(f"jwk.{name}", fresh_body(runner_key=key), 400, "runner_key_invalid")
        for name, key in keys.items()
    ]
    cases.append(
        release("jwk.hpke_wrap_with_ec_key", fresh_body(wrap="hpke"), 400, "runner_key_invalid")
    )
    return cases


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
    now = int(_now().timestamp())
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


# --- evidence of every kind --------------------------------------------------------------------


def evidence_case(
    name: str,
    status: int,
    code: str | None,
    make: Callable[[Ctx, Fresh], Any],
    *,
    key: str = GPU_KEY,
) -> Case:
    async def build(ctx: Ctx) -> Any:
        fresh = await ctx.fresh(gpu_cc_mode="ON")
        evidence = {"gca": fresh.token, **make(ctx, fresh)}
        return fresh.body(key=key, evidence={k: v for k, v in evidence.items() if v is not DELETE})

    return release(f"evidence.{name}", build, status, code)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _item(ctx: Ctx, fresh: Fresh, **change: Any) -> dict[str, Any]:
    return {**ctx.gpu.evidence(fresh.gpu_nonce)["evidence_list"][0], **change}


def _truncated(ctx: Ctx, fresh: Fresh, cut: int) -> dict[str, Any]:
    report = ctx.gpu.report(fresh.gpu_nonce)
    return {"nvidia": {"evidence_list": [_item(ctx, fresh, evidence=_b64(report[:cut]))]}}


def _flipped_report(ctx: Ctx, fresh: Fresh) -> dict[str, Any]:
    report = bytearray(ctx.gpu.report(fresh.gpu_nonce))
    report[60] ^= 1  # inside the measurement record: the signature no longer verifies
    return {"nvidia": {"evidence_list": [_item(ctx, fresh, evidence=_b64(bytes(report)))]}}


def evidence_cases() -> list[Case]:
    nv = "nvidia"
    cases = [
        evidence_case(
            "control.local_gpu", 200, None, lambda c, f: {nv: c.gpu.evidence(f.gpu_nonce)}
        ),
        evidence_case("control.nras", 200, None, lambda c, f: {"nras": c.nras.result(f.gpu_nonce)}),
        evidence_case("unsupported_kind", 400, "evidence_unsupported", lambda c, f: {"sev": "x"}),
        evidence_case(
            "ita_not_configured", 400, "evidence_unsupported", lambda c, f: {"ita": f.token}
        ),
        evidence_case(
            "two_gpu_kinds", 400, "evidence_unsupported", lambda c, f: {nv: {}, "nras": []}
        ),
        evidence_case("nvidia.not_object", 401, "evidence_malformed", lambda c, f: {nv: "x"}),
        evidence_case("nvidia.empty", 401, "evidence_malformed", lambda c, f: {nv: {}}),
        evidence_case(
            "nvidia.extra_member",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "x": 1}},
        ),
        evidence_case(
            "nvidia.arch_list",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "arch": ["HOPPER"]}},
        ),
        evidence_case(
            "nvidia.arch_unknown",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "arch": "VOLTA"}},
        ),
        evidence_case(
            "nvidia.arch_contradicts",
            401,
            "gpu_arch_mismatch",
            lambda c, f: {nv: {**c.gpu.evidence(f.gpu_nonce), "arch": "BLACKWELL"}},
        ),
        evidence_case(
            "nvidia.list_empty", 401, "evidence_malformed", lambda c, f: {nv: {"evidence_list": []}}
        ),
        evidence_case(
            "nvidia.list_9",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f)] * 9}},
        ),
        evidence_case(
            "nvidia.list_not_list",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": {"a": 1}}},
        ),
        evidence_case(
            "nvidia.item_not_object",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": ["x"]}},
        ),
        evidence_case(
            "nvidia.item_extra",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, extra=1)]}},
        ),
        evidence_case(
            "nvidia.item_number",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence=7)]}},
        ),
        evidence_case(
            "nvidia.bad_base64",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence="!!!")]}},
        ),
        evidence_case(
            "nvidia.report_garbage",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence=_b64(bytes(300)))]}},
        ),
        evidence_case(
            "nvidia.report_empty",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, evidence="")]}},
        ),
        evidence_case("nvidia.report_flipped", 401, "evidence_signature_invalid", _flipped_report),
        evidence_case(
            "nvidia.chain_not_pem",
            401,
            "cert_chain_invalid",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, certificate=_b64(b"not pem"))]}},
        ),
        evidence_case(
            "nvidia.chain_short",
            401,
            "cert_chain_invalid",
            lambda c, f: {
                nv: {"evidence_list": [_item(c, f, certificate=_b64(pem(c.gpu.chain[:4])))]}
            },
        ),
        evidence_case(
            "nvidia.chain_other_root",
            401,
            "cert_chain_invalid",
            lambda c, f: {nv: c.stranger_gpu.evidence(f.gpu_nonce)},
        ),
        evidence_case(
            "nvidia.chain_too_big",
            401,
            "evidence_malformed",
            lambda c, f: {nv: {"evidence_list": [_item(c, f, certificate=_b64(b"A" * 70_000))]}},
        ),
        evidence_case(
            "nvidia.nonce_other",
            401,
            "nonce_mismatch",
            lambda c, f: {nv: c.gpu.evidence(bytes(32))},
        ),
        evidence_case(
            "nras.not_json", 401, "evidence_malformed", lambda c, f: {"nras": "not json"}
        ),
        evidence_case("nras.empty_list", 401, "evidence_malformed", lambda c, f: {"nras": []}),
        evidence_case("nras.object", 401, "evidence_malformed", lambda c, f: {"nras": {"a": 1}}),
        evidence_case(
            "nras.non_ascii",
            401,
            "evidence_malformed",
            lambda c, f: {"nras": [["JWT", "é.é.é"], {"GPU-0": "a.b.c"}]},
        ),
        evidence_case(
            "nras.no_gpus", 401, "evidence_malformed", lambda c, f: {"nras": [["JWT", "a.b.c"], {}]}
        ),
        evidence_case(
            "nras.garbage_tokens",
            401,
            "token_malformed",
            lambda c, f: {"nras": [["JWT", "a.b.c"], {"GPU-0": "a.b.c"}]},
        ),
        evidence_case(
            "nras.other_nonce",
            401,
            "nonce_mismatch",
            lambda c, f: {"nras": c.nras.result(bytes(32))},
        ),
        evidence_case(
            "nras.string_form_nested",
            401,
            "evidence_malformed",
            lambda c, f: {"nras": json.dumps([[["JWT"]]])},
        ),
    ]
    for cut in (0, 10, 37, 80, 200, -97, -1):
        cases.append(
            evidence_case(
                f"nvidia.report_truncated[{cut}]",
                401,
                "evidence_malformed",
                lambda c, f, cut=cut: _truncated(c, f, cut),
            )
        )
    cases.append(
        evidence_case(
            "cpu_missing",
            400,
            "evidence_unsupported",
            lambda c, f: {"gca": DELETE, nv: c.gpu.evidence(f.gpu_nonce)},
        )
    )
    return cases


# --- nonces ---------------------------------------------------------------------------------


def nonce_cases() -> list[Case]:
    async def unknown(ctx: Ctx) -> Any:
        return (await ctx.fresh()).body(nonce="A" * 43)

    async def short(ctx: Ctx) -> Any:
        return (await ctx.fresh()).body(nonce="x")

    async def other_nonce_in_token(ctx: Ctx) -> Any:
        fresh, other = await ctx.fresh(), await ctx.fresh()
        return fresh.body(evidence={"gca": other.token})

    async def other_key_in_token(ctx: Ctx) -> Any:
        fresh, other = await ctx.fresh(), await ctx.fresh()
        return fresh.body(runner_key=other.jwk)

    return [
        release("nonce.unknown", unknown, 401, "nonce_unknown"),
        release("nonce.short_unknown", short, 401, "nonce_unknown"),
        release("nonce.token_for_another_nonce", other_nonce_in_token, 401, "nonce_mismatch"),
        release("nonce.token_for_another_key", other_key_in_token, 401, "key_binding_mismatch"),
    ]


# --- query, admin, health, metrics --------------------------------------------------------------


def surface_cases() -> list[Case]:
    public = f"/v1/keys/{QUERY_KEY}/public"
    cases = [
        Case("health.get", "GET", "/healthz", 200, None),
        Case("health.post", "POST", "/healthz", 405, "method_not_allowed", {}),
        Case("health.delete", "DELETE", "/healthz", 405, "method_not_allowed"),
        Case("health.query_string", "GET", "/healthz?x=%00%ff", 200, None),
        Case("ready.get", "GET", "/readyz", 200, None),
        Case("ready.put", "PUT", "/readyz", 405, "method_not_allowed", {}),
        Case("metrics.get", "GET", "/metrics", 200, None),
        Case("metrics.post", "POST", "/metrics", 405, "method_not_allowed", {}),
        Case("openapi.get", "GET", "/openapi.json", 200, None),
        Case("unknown.path", "GET", "/v2/release", 404, "not_found"),
        Case("unknown.traversal", "GET", "/v1/../../etc/passwd", 404, "not_found"),
        Case("unknown.encoded", "GET", "/v1/%2e%2e/admin/keys", 404, "not_found"),
        Case("release.get", "GET", "/v1/release", 405, "method_not_allowed"),
        Case("challenge.get", "GET", "/v1/challenge", 405, "method_not_allowed"),
        Case("challenge.empty", "POST", "/v1/challenge", 200, None),
        Case("challenge.object", "POST", "/v1/challenge", 200, None, {}),
        Case("query.public", "GET", public, 200, None),
        Case("query.public_v1", "GET", public + "?version=1", 200, None),
        Case("query.statement_keys", "GET", "/v1/statement-keys", 200, None),
        Case(
            "query.statement_keys.post", "POST", "/v1/statement-keys", 405, "method_not_allowed", {}
        ),
        Case("query.public.post", "POST", public, 405, "method_not_allowed", {}),
        Case("query.not_a_query_key", "GET", f"/v1/keys/{KEY}/public", 404, "key_unknown"),
        Case("query.unknown_key", "GET", "/v1/keys/models/none/public", 404, "key_unknown"),
        Case("query.upper_case", "GET", "/v1/keys/Models/X/public", 404, "not_found"),
        # the client normalises the path to /v1/keys/x/public, as HTTP clients do
        Case("query.dotdot", "GET", "/v1/keys/models/../x/public", 404, "key_unknown"),
    ]
    for label, version in {
        "abc": "abc",
        "zero": "0",
        "negative": "-1",
        "float": "1.5",
        "superscript": "%C2%B2",
        "huge": "99999999999",
        "empty": "",
        "arabic_digit": "%D9%A1",
    }.items():
        cases.append(
            Case(f"query.version={label}", "GET", f"{public}?version={version}", 400, "bad_request")
        )
    cases.append(Case("query.version=99", "GET", f"{public}?version=99", 404, "key_unknown"))
    return cases


LOG_ROUTES = [
    "/v1/log/checkpoint",
    "/v1/log/entries",
    "/v1/log/proof/inclusion?index=0&tree_size=1",
    "/v1/log/proof/consistency?first=1&second=1",
]


def log_cases() -> list[Case]:
    cases = [
        Case(f"log{path.split('?')[0]}.auth=none", "GET", path, 401, "unauthorized")
        for path in LOG_ROUTES
    ]
    cases += [
        Case(
            f"log{path.split('?')[0]}.post",
            "POST",
            path.split("?")[0],
            405,
            "method_not_allowed",
            {},
        )
        for path in LOG_ROUTES
    ]
    bad = {
        "inclusion.index_missing": "/v1/log/proof/inclusion?tree_size=1",
        "inclusion.beyond": "/v1/log/proof/inclusion?index=0&tree_size=999999999",
        "inclusion.index_eq_size": "/v1/log/proof/inclusion?index=1&tree_size=1",
        "inclusion.negative": "/v1/log/proof/inclusion?index=-1&tree_size=1",
        "inclusion.huge": "/v1/log/proof/inclusion?index=0&tree_size=99999999999999999999",
        "inclusion.unicode_digit": "/v1/log/proof/inclusion?index=%D9%A1&tree_size=2",
        "consistency.zero": "/v1/log/proof/consistency?first=0&second=1",
        "consistency.reversed": "/v1/log/proof/consistency?first=2&second=1",
        "consistency.text": "/v1/log/proof/consistency?first=a&second=b",
        "entries.start_beyond": "/v1/log/entries?start=999999999",
        "entries.start_text": "/v1/log/entries?start=abc",
        "entries.end_negative": "/v1/log/entries?end=-5",
    }
    cases += [
        Case(f"log.{name}", "GET", path, 400, "bad_request", admin=True)
        for name, path in bad.items()
    ]
    cases.append(
        Case("log.entries.ok", "GET", "/v1/log/entries?start=0&end=2", 200, None, admin=True)
    )
    cases.append(Case("log.checkpoint.ok", "GET", "/v1/log/checkpoint", 200, None, admin=True))
    return cases


ADMIN_ROUTES = [
    ("GET", "/v1/admin/keys"),
    ("POST", "/v1/admin/keys"),
    ("POST", "/v1/admin/keys/rotate"),
    ("POST", "/v1/admin/keys/disable"),
    ("POST", "/v1/admin/keys/enable"),
    ("POST", "/v1/admin/keys/destroy"),
]


def admin_cases() -> list[Case]:
    cases = []
    credentials = {
        "none": {},
        "wrong": {"Authorization": "Bearer wrong-token"},
        "basic": {"Authorization": "Basic " + _b64(b"admin:" + ADMIN_TOKEN.encode())},
        "empty_bearer": {"Authorization": "Bearer "},
        "bearer_only": {"Authorization": "Bearer"},
        "token_with_suffix": {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        "token_prefix": {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"},
        "lowercase_scheme_wrong": {"Authorization": "bearer nope"},
    }
    for method, path in ADMIN_ROUTES:
        for label, headers in credentials.items():
            cases.append(
                Case(
                    f"admin{path}.{method}.auth={label}",
                    method,
                    path,
                    401,
                    "unauthorized",
                    {} if method == "POST" else None,
                    headers,
                )
            )
    bodies: list[tuple[str, str, Any, int, str | None]] = [
        (
            "create.purpose_unknown",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": "everything"},
            400,
            "bad_request",
        ),
        (
            "create.purpose_number",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": 1},
            400,
            "bad_request",
        ),
        (
            "create.algorithm_unknown",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": "generic", "algorithm": "DES"},
            400,
            "bad_request",
        ),
        (
            "create.name_bad",
            "/v1/admin/keys",
            {"name": "../x", "purpose": "generic"},
            400,
            "bad_request",
        ),
        (
            "create.name_number",
            "/v1/admin/keys",
            {"name": 5, "purpose": "generic"},
            400,
            "bad_request",
        ),
        ("create.missing_purpose", "/v1/admin/keys", {"name": "models/a"}, 400, "bad_request"),
        (
            "create.unknown_field",
            "/v1/admin/keys",
            {"name": "models/a", "purpose": "generic", "x": 1},
            400,
            "bad_request",
        ),
        ("create.exists", "/v1/admin/keys", {"name": KEY, "purpose": "generic"}, 409, "key_exists"),
        (
            "create.ok",
            "/v1/admin/keys",
            {"name": "models/hostile-created", "purpose": "generic"},
            201,
            None,
        ),
        ("rotate.unknown", "/v1/admin/keys/rotate", {"name": "models/none"}, 404, "key_unknown"),
        ("rotate.name_list", "/v1/admin/keys/rotate", {"name": ["x"]}, 400, "bad_request"),
        ("rotate.empty", "/v1/admin/keys/rotate", {}, 400, "bad_request"),
        ("disable.version_missing", "/v1/admin/keys/disable", {"name": KEY}, 400, "bad_request"),
        (
            "disable.version_bool",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": True},
            400,
            "bad_request",
        ),
        (
            "disable.version_string",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": "1"},
            400,
            "bad_request",
        ),
        (
            "disable.version_null",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": None},
            400,
            "bad_request",
        ),
        (
            "disable.unknown_version",
            "/v1/admin/keys/disable",
            {"name": KEY, "version": 77},
            404,
            "key_unknown",
        ),
        (
            "enable.unknown_key",
            "/v1/admin/keys/enable",
            {"name": "models/none", "version": 1},
            404,
            "key_unknown",
        ),
        (
            "destroy.unknown",
            "/v1/admin/keys/destroy",
            {"name": "models/none", "version": 1},
            404,
            "key_unknown",
        ),
        (
            "destroy.version_float",
            "/v1/admin/keys/destroy",
            {"name": KEY, "version": 1.0},
            400,
            "bad_request",
        ),
        ("create.malformed", "/v1/admin/keys", b"{", 400, "malformed_json"),
        ("create.nested", "/v1/admin/keys", b"[" * 1000 + b"]" * 1000, 400, "malformed_json"),
        ("create.array", "/v1/admin/keys", [], 400, "bad_request"),
    ]
    for name, path, body, status, code in bodies:
        cases.append(Case(f"admin.{name}", "POST", path, status, code, body, admin=True))
    cases.append(Case("admin.list", "GET", "/v1/admin/keys", 200, None, admin=True))
    cases.append(
        Case("admin.list.name_filter", "GET", "/v1/admin/keys?name=%00", 200, None, admin=True)
    )
    cases.append(
        Case(
            "admin.list.post_wrong_type",
            "POST",
            "/v1/admin/keys",
            415,
            "unsupported_media_type",
            b"{}",
            {"Content-Type": "text/plain"},
            admin=True,
        )
    )
    cases.append(
        Case(
            "admin.delete_method", "DELETE", "/v1/admin/keys", 405, "method_not_allowed", admin=True
        )
    )
    return cases


def all_cases(max_body: int) -> list[Case]:
    return [
        *shape_cases(),
        *wire_cases(max_body),
        *jwk_cases(),
        *token_cases(),
        *evidence_cases(),
        *nonce_cases(),
        *surface_cases(),
        *admin_cases(),
        *log_cases(),
    ]
