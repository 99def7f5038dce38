"""KBS protocol vectors (tests/vectors/kbs/kbs.json, from make_vectors.py): the exact protected
header bytes, the whole answer for fixed keys and randomness, the Concat KDF, the report data
and the error bodies. Each expectation is derived here again from the guest's algorithm
(``tests/support/kbs_guest.py``, which shares no code with ``broker/crypto/kbs_jwe.py``), and the
broker's output must equal both."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from broker.crypto.jwe import concat_kdf
from broker.crypto.kbs_jwe import check_context, parse_tee_pubkey, seal_fixed
from broker.kbs.wire import error_body, error_status, expected_report_data, jcs
from tests.support import kbs_guest

HERE = Path(__file__).parents[1] / "vectors" / "kbs"
VECTORS = json.loads((HERE / "kbs.json").read_text(encoding="utf-8"))
CURVES = {"P-256": ec.SECP256R1(), "P-521": ec.SECP521R1()}


def _keys(
    case: dict[str, Any],
) -> tuple[kbs_guest.GuestPrivateKey, ec.EllipticCurvePrivateKey | None]:
    if "recipient_d" not in case:
        key = serialization.load_pem_private_key((HERE / "guest_rsa.pem").read_bytes(), None)
        assert isinstance(key, rsa.RSAPrivateKey)
        return key, None
    curve = CURVES[case["tee_pubkey"]["crv"]]
    recipient = ec.derive_private_key(int(case["recipient_d"], 16), curve)
    return recipient, ec.derive_private_key(int(case["ephemeral_d"], 16), curve)


def _guest_header(case: dict[str, Any], ephemeral: ec.EllipticCurvePrivateKey | None) -> bytes:
    """The header text the guest rebuilds: alg, enc, then the other members by name."""
    members: dict[str, Any] = dict(case["context"])
    if ephemeral is not None:
        members["epk"] = kbs_guest.epk(ephemeral)
    head = {"alg": case["tee_pubkey"]["alg"], "enc": "A256GCM"}
    return kbs_guest.serde_header(json.dumps({**head, **members}).encode())


@pytest.mark.parametrize("case", VECTORS["jwe"], ids=[c["name"] for c in VECTORS["jwe"]])
def test_protected_header_is_the_one_the_guest_rebuilds(case: dict[str, Any]) -> None:
    key, ephemeral = _keys(case)
    expected = _guest_header(case, ephemeral)
    assert case["protected_header"].encode() == expected
    answer = seal_fixed(
        bytes.fromhex(case["plaintext"]),
        parse_tee_pubkey(kbs_guest.tee_pubkey(key)),
        check_context(case["context"]),
        cek=bytes.fromhex(case["cek"]),
        iv=bytes.fromhex(case["iv"]),
        ephemeral=ephemeral,
    )
    assert kbs_guest.unb64u(answer["protected"]) == expected
    # under either serde_json map (sorted, or in the order received) the rebuilt header is ours
    for preserve_order in (False, True):
        assert kbs_guest.serde_header(expected, preserve_order=preserve_order) == expected
    pinned = case["answer"]
    assert {k: v for k, v in answer.items() if k in pinned} == pinned
    assert kbs_guest.open_as_guest(answer, key) == bytes.fromhex(case["plaintext"])


def test_unsorted_context_is_sent_sorted() -> None:
    (case,) = (c for c in VECTORS["jwe"] if c["name"] == "p256-unsorted-context")
    assert list(case["context"]) == ["release_id", "key_version", "cty"]
    text = case["protected_header"]
    assert text.index('"cty"') < text.index('"epk"') < text.index('"key_version"')
    assert text.index('"key_version"') < text.index('"release_id"')


@pytest.mark.parametrize("case", VECTORS["concat_kdf"], ids=["p256-z", "p521-z"])
def test_concat_kdf_for_a_fixed_shared_secret(case: dict[str, str]) -> None:
    z = bytes.fromhex(case["z"])
    other_info = b"\0\0\0\x0eECDH-ES+A256KW" + bytes(8) + b"\0\0\x01\0"
    by_hand = hashlib.sha256(b"\0\0\0\x01" + z + other_info).digest()
    assert by_hand.hex() == case["key"]
    assert concat_kdf(z, "ECDH-ES+A256KW") == by_hand


@pytest.mark.parametrize("case", VECTORS["report_data"], ids=lambda c: c["hash"])
def test_report_data(case: dict[str, Any]) -> None:
    args = (case["tee_pubkey"], case["nonce"], case["additional_evidence"], case["hash"])
    expected = bytes.fromhex(case["report_data"])
    assert len(expected) == 64
    assert kbs_guest.report_data(*args) == expected
    assert expected_report_data(*args) == expected


def test_report_data_ignores_members_the_typed_key_drops() -> None:
    plain, extra = VECTORS["report_data"][0], VECTORS["report_data"][5]
    assert set(extra["tee_pubkey"]) - set(plain["tee_pubkey"]) == {"kid", "use"}
    assert extra["report_data"] == plain["report_data"]


def test_report_data_binds_nonce_key_and_evidence() -> None:
    case = VECTORS["report_data"][1]
    args = [case["tee_pubkey"], case["nonce"], case["additional_evidence"], case["hash"]]
    expected = bytes.fromhex(case["report_data"])
    other_key = VECTORS["report_data"][6]["tee_pubkey"]
    for index, changed in ((0, other_key), (1, case["nonce"][:-2] + "A="), (2, "")):
        altered = list(args)
        altered[index] = changed
        assert expected_report_data(*altered) != expected


def test_jcs_matches_trustees_own_vector() -> None:
    """attestation-service/src/lib.rs's test: SHA-384 of JCS({"b":1,"a":"test","c":{"d":"e"}})."""
    digest = hashlib.sha384(jcs({"b": 1, "a": "test", "c": {"d": "e"}})).hexdigest()
    assert digest == (
        "e71ce8e70d814ba6639c3612ebee0ff1f76f650f8dbb5e47157e0f3f525cd22c"
        "4597480a186427c813ca941da78870c3"
    )


def test_jcs_sorts_by_utf16_code_units_and_escapes_like_ecmascript() -> None:
    # RFC 8785 §3.2.3: U+1F600 (D83D DE00) sorts before U+FB01 in UTF-16, after in code points
    assert jcs({"\ufb01": 1, "\U0001f600": 2}) == '{"\U0001f600":2,"\ufb01":1}'.encode()
    assert jcs('\u0001\n"\\/\u007f\u2028é') == '"\\u0001\\n\\"\\\\/\u007f\u2028é"'.encode()


@pytest.mark.parametrize("value", [1.5, 2**53 + 1, "\ud800", {1: "a"}])
def test_jcs_refuses_what_it_cannot_write_exactly(value: object) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each raises its own message
        jcs(value)


@pytest.mark.parametrize("case", VECTORS["errors"], ids=[c["name"] for c in VECTORS["errors"]])
def test_error_bodies(case: dict[str, str]) -> None:
    expected = (
        '{"type":"https://github.com/confidential-containers/kbs/errors/'
        + case["name"]
        + '","detail":'
        + json.dumps(case["detail"], ensure_ascii=False)
        + "}"
    )
    assert case["body"] == expected
    assert error_body(case["name"], case["detail"]) == expected.encode("utf-8")
    status = 404 if case["name"] == "PluginNotFound" else 401
    assert error_status(case["name"]) == status


def test_error_body_refuses_a_name_trustee_lacks() -> None:
    with pytest.raises(ValueError, match="not an error Trustee answers"):
        error_body("Forbidden", "no")
