"""DPoP proof verification (RFC 9449) against proofs an independent JOSE implementation makes
(jwcrypto signs them here; ``broker.crypto.jose`` never signs a proof), and the hostile cases:
every check refuses on its own."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from jwcrypto import jwk, jws
from jwcrypto.common import json_encode

from broker.core.errors import ErrorCode
from broker.crypto.dpop import (
    DpopError,
    DpopNonceRequired,
    access_token_hash,
    target_uri,
    verify_dpop_proof,
)
from broker.crypto.jwk import thumbprint

URL = "https://broker.example:8443/v1/release"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TOKEN = "eyJhbGciOiJFUzI1NiJ9.eyJqdGkiOiJhdHQifQ.c2ln"  # the access token (an EAR) it accompanies


def make_proof(
    key: jwk.JWK,
    *,
    header: dict[str, Any] | None = None,
    claims: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> str:
    """A proof signed by jwcrypto: ``header``/``claims`` override the defaults, ``drop`` removes."""
    protected = {"typ": "dpop+jwt", "alg": "ES256", "jwk": key.export_public(as_dict=True)}
    protected.update(header or {})
    body = {
        "jti": "e1j3V_bKic8-LAEB",
        "htm": "POST",
        "htu": URL,
        "iat": int(NOW.timestamp()),
        "ath": access_token_hash(TOKEN),
    }
    body.update(claims or {})
    for name in drop:
        protected.pop(name, None)
        body.pop(name, None)
    signer = jws.JWS(json.dumps(body).encode())
    signer.add_signature(key, alg=protected.get("alg", "ES256"), protected=json_encode(protected))
    return str(signer.serialize(compact=True))


@pytest.fixture(scope="module")
def key() -> jwk.JWK:
    return jwk.JWK.generate(kty="EC", crv="P-256")


def verify(proof: object, **overrides: Any) -> Any:
    arguments: dict[str, Any] = {"method": "POST", "url": URL, "now": NOW, "access_token": TOKEN}
    arguments.update(overrides)
    return verify_dpop_proof(proof, **arguments)


def test_a_proof_from_an_independent_implementation_verifies(key: jwk.JWK) -> None:
    verified = verify(make_proof(key))
    public = key.export_public(as_dict=True)
    assert verified.thumbprint == thumbprint({k: public[k] for k in ("crv", "kty", "x", "y")})
    assert verified.thumbprint == key.thumbprint()  # jwcrypto's own RFC 7638 thumbprint
    assert verified.jti == "e1j3V_bKic8-LAEB"
    assert verified.issued_at == NOW


def test_htu_compares_without_query_fragment_default_port_or_case(key: jwk.JWK) -> None:
    proof = make_proof(key, claims={"htu": "HTTPS://Broker.Example:8443/v1/release?x=1#f"})
    assert verify(proof).jti
    assert target_uri("https://a.example:443/p") == "https://a.example/p"
    assert target_uri("https://[::1]:8443") == "https://[::1]:8443/"
    assert target_uri("https://a.example/P") != target_uri("https://a.example/p")  # path as is


def test_a_proof_without_an_access_token_is_for_the_attest_call(key: jwk.JWK) -> None:
    proof = make_proof(key, drop=("ath",))
    assert verify(proof, access_token=None).jti
    with pytest.raises(DpopError, match="ath"):
        verify(proof)  # the release carries a token: its proof must name it
    with pytest.raises(DpopError, match="does not carry"):
        verify(make_proof(key), access_token=None)


def test_the_server_nonce_is_required_when_asked_for(key: jwk.JWK) -> None:
    current = {"n-1"}

    def valid(nonce: str) -> bool:
        return nonce in current

    with pytest.raises(DpopNonceRequired) as caught:
        verify(make_proof(key), nonce_valid=valid)
    assert caught.value.code is ErrorCode.DPOP_NONCE_REQUIRED
    assert caught.value.status == 401
    with pytest.raises(DpopNonceRequired):
        verify(make_proof(key, claims={"nonce": "n-0"}), nonce_valid=valid)
    assert verify(make_proof(key, claims={"nonce": "n-1"}), nonce_valid=valid).nonce == "n-1"


PATH = "/v1/release"
OTHER = "https://other.example/v1/release"
HTU, IAT = ErrorCode.DPOP_HTU_MISMATCH, ErrorCode.DPOP_IAT_INVALID


def at(seconds: int) -> int:
    return int((NOW + timedelta(seconds=seconds)).timestamp())


Build = Callable[[jwk.JWK], str]


def claim(**claims: Any) -> Build:
    return lambda k: make_proof(k, claims=claims)


HOSTILE: list[tuple[str, Build, str] | tuple[str, Build, str, ErrorCode]] = [
    ("typ", lambda k: make_proof(k, header={"typ": "JWT"}), "typ"),
    ("no typ", lambda k: make_proof(k, drop=("typ",)), "typ"),
    ("alg ES384", lambda k: make_proof(k, header={"alg": "ES384"}), "alg"),
    ("kid", lambda k: make_proof(k, header={"kid": "k1"}), "refused"),
    ("jku", lambda k: make_proof(k, header={"jku": "https://evil.example/k"}), "refused"),
    ("crit", lambda k: make_proof(k, header={"crit": ["b64"], "b64": True}), "refused"),
    ("no jwk", lambda k: make_proof(k, drop=("jwk",)), "jwk"),
    (
        "private jwk",
        lambda k: make_proof(k, header={"jwk": k.export_private(as_dict=True)}),
        "private",
    ),
    (
        "another key's jwk",
        lambda k: make_proof(
            k, header={"jwk": jwk.JWK.generate(kty="EC", crv="P-256").export_public(as_dict=True)}
        ),
        "signature",
    ),
    ("htm", claim(htm="GET"), "htm"),
    ("htm case", claim(htm="post"), "htm"),
    ("htu host", claim(htu=URL.replace("broker", "other")), "htu", HTU),
    ("htu port", claim(htu="https://broker.example" + PATH), "htu", HTU),
    ("htu path", claim(htu=URL.replace("release", "attest")), "htu", HTU),
    ("htu http", claim(htu=URL.replace("https", "http")), "htu", HTU),
    ("htu relative", claim(htu="/v1/release"), "htu", HTU),
    ("ath", claim(ath=access_token_hash(TOKEN + "x")), "ath"),
    ("no ath", lambda k: make_proof(k, drop=("ath",)), "ath"),
    ("no jti", lambda k: make_proof(k, drop=("jti",)), "jti"),
    ("long jti", claim(jti="j" * 129), "jti"),
    ("jti number", claim(jti=7), "jti"),
    ("old", claim(iat=at(-61)), "older", IAT),
    ("future", claim(iat=at(6)), "future", IAT),
    ("iat string", claim(iat=str(int(NOW.timestamp()))), "iat", IAT),
    ("no iat", lambda k: make_proof(k, drop=("iat",)), "iat", IAT),
    ("iat huge", claim(iat=1e20), "integer", IAT),
    ("iat huge integer", claim(iat=10**20), "range", IAT),
    ("iat negative", claim(iat=-(10**20)), "range", IAT),
    ("iat fraction", claim(iat=1.5), "integer", IAT),
    ("iat now, fractional", claim(iat=at(0) + 0.5), "integer", IAT),
    ("iat bool", claim(iat=True), "integer", IAT),
    ("htu another service", claim(htu=OTHER), "htu", HTU),
    ("htu port 99999", claim(htu="https://broker.example:99999/v1/release"), "htu", HTU),
    ("htu not a string", claim(htu=["https://broker.example:8443/v1/release"]), "htu", HTU),
]  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_every_check_refuses_on_its_own(key: jwk.JWK, case: tuple[Any, ...]) -> None:
    name, build, says, code = (*case, ErrorCode.DPOP_PROOF_INVALID)[:4]
    with pytest.raises(DpopError) as caught:
        verify(build(key))
    assert caught.value.code is code, name
    assert caught.value.status == 401
    assert says in caught.value.message, caught.value.message


def test_a_proof_for_another_services_url_is_refused_whatever_the_request_says(
    key: jwk.JWK,
) -> None:
    """The htu is compared with this broker's configured URLs only: a proof the runner made for
    https://other.example/v1/release (presented to us with Host: other.example) names none."""
    with pytest.raises(DpopError) as caught:
        verify(
            make_proof(key, claims={"htu": OTHER}), url=(URL, "https://broker.internal/v1/release")
        )
    assert caught.value.code is ErrorCode.DPOP_HTU_MISMATCH
    with pytest.raises(DpopError) as caught:  # no configured URL: nothing is accepted
        verify(make_proof(key), url=())
    assert caught.value.code is ErrorCode.DPOP_HTU_MISMATCH
    assert verify(make_proof(key), url=("https://broker.internal/v1/release", URL)).jti


def test_the_proof_key_is_matched_to_cnf_before_its_claims_are_read(key: jwk.JWK) -> None:
    """A proof by another key is refused as such even when its claims are garbage (iat 1e20,
    htu elsewhere): its claims are never interpreted."""
    other = jwk.JWK.generate(kty="EC", crv="P-256")
    garbage = make_proof(other, claims={"iat": 1e20, "htu": OTHER, "jti": 7})
    with pytest.raises(DpopError) as caught:
        verify(garbage, bound_to=key.thumbprint())
    assert caught.value.code is ErrorCode.DPOP_KEY_MISMATCH
    assert verify(make_proof(key), bound_to=key.thumbprint()).thumbprint == key.thumbprint()


def test_non_ascii_proofs_are_refused_not_crashed(key: jwk.JWK) -> None:
    head, body, signature = make_proof(key).split(".")
    for bad in (f"{head}.{body}\udcff.{signature}", f"{head}.é{body}.{signature}"):
        with pytest.raises(DpopError) as caught:
            verify(bad)
        assert caught.value.code is ErrorCode.DPOP_PROOF_INVALID


def test_a_tampered_or_unsigned_proof_is_refused(key: jwk.JWK) -> None:
    proof = make_proof(key)
    head, body, signature = proof.split(".")
    forged_body = json.loads(_b64d(body)) | {"htu": URL}
    forged = f"{head}.{_b64e(json.dumps(forged_body | {'jti': 'other'}).encode())}.{signature}"
    for bad in (forged, f"{head}.{body}.", f"{head}.{body}", "x" * 9000, "", None, 5):
        with pytest.raises(DpopError):
            verify(bad)
    none_header = _b64e(json.dumps({"typ": "dpop+jwt", "alg": "none"}).encode())
    with pytest.raises(DpopError, match="alg"):
        verify(f"{none_header}.{body}.{signature}")


def _b64e(data: bytes) -> str:
    import base64  # noqa: PLC0415

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64d(segment: str) -> bytes:
    import base64  # noqa: PLC0415

    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


INTEROP = Path(__file__).parents[1] / "interop" / "dpop"


def panva_proofs(requests: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Proofs made by panva's ``dpop`` (Node, WebCrypto): an implementation we did not write."""
    if not (INTEROP / "node_modules" / ".installed").exists():
        pytest.fail("tests/interop/dpop is not installed: `make test` runs npm ci there")
    done = subprocess.run(
        ["node", str(INTEROP / "proofs.mjs"), *(json.dumps(r) for r in requests)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_proofs_from_panvas_dpop_verify_and_bind_the_same_key() -> None:
    now = datetime.now(UTC)
    made = panva_proofs(
        [
            {"url": URL, "method": "POST", "token": TOKEN},
            {"url": URL + "?q=1", "method": "POST", "token": TOKEN, "nonce": "n-1"},
            {"url": URL.replace("release", "attest"), "method": "POST"},
        ]
    )
    with_token, with_nonce, attest = (m["proof"] for m in made)
    first = verify_dpop_proof(with_token, method="POST", url=URL, now=now, access_token=TOKEN)
    assert first.thumbprint == made[0]["thumbprint"]  # the same RFC 7638 thumbprint as theirs
    second = verify_dpop_proof(
        with_nonce,
        method="POST",
        url=URL,
        now=now,
        access_token=TOKEN,
        nonce_valid=lambda nonce: nonce == "n-1",
    )
    assert second.nonce == "n-1"
    assert first.jti != second.jti
    third = verify_dpop_proof(attest, method="POST", url=URL.replace("release", "attest"), now=now)
    assert third.thumbprint == made[2]["thumbprint"]
    with pytest.raises(DpopError, match="htu"):  # their proof for /v1/attest, used elsewhere
        verify_dpop_proof(attest, method="POST", url=URL, now=now)
    with pytest.raises(DpopError, match="ath"):  # their proof for another token
        verify_dpop_proof(with_token, method="POST", url=URL, now=now, access_token=TOKEN + "x")
