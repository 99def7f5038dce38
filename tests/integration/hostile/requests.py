"""Release requests broken in their JSON shape, on the wire, in the runner key, or in the nonce."""

from __future__ import annotations

import json
from typing import Any

from broker.client.unwrap import new_ephemeral_key
from broker.core.encoding import b64url_encode
from broker.crypto.jwk import public_jwk
from tests.integration.hostile.common import (
    DELETE,
    Case,
    Ctx,
    fresh_body,
    release,
)

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
        # a number past a float's range would parse to inf, which no record can hold
        release(
            "wire.overflow", b'{"evidence": {"gca": 1e999}}', 400, "malformed_json", logged=False
        ),
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
