"""What a worker keeps between releases on one attestation result (issue 31,
``decisions/attested_cache.py``): each cache concludes exactly what the work it saves would
have, and lets go when that could differ — an expired result, a retired or replaced result key,
another audience, a stored entry that changed; the encodings it splices are ``canonical``'s,
byte for byte (records keep their format: ``test_decision_records.py``)."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.attestation.claims import RequestFacts, build_input
from broker.attestation.ear import Submod, ear_claims, sign_ear
from broker.attestation.stored import AttestationEntry, ParsedEntries
from broker.audit.mask import masked
from broker.audit.records import sealed_line
from broker.core.encoding import Encoded, canonical, canonical_members
from broker.core.errors import AttestationError, ErrorCode, UpstreamError
from broker.crypto.jwk import public_jwk, thumbprint
from broker.decisions.attested_cache import ResultCache, StoredInput, prepare

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
AUDIENCE = "https://broker.example"
TTL = timedelta(seconds=120)
STORED = {
    "schema": "broker.input/v1",
    "request": {"kind": "attest", "runner_key_thumbprint": "r", "pop_key_thumbprint": "p"},
    "tee": {"verifier": "gca", "workload": {"image_digest": "sha256:" + "a1" * 32}},
    "gpus": [{"verifier": "local", "ueid": "7"}],
    "claims": {"gca": {"sub": "runner@example", "aud": AUDIENCE}},
    "time": NOW.isoformat(),
}


class Issued:
    """A result signed by a result key, as ``/v1/attest`` makes one, and its stored entry."""

    def __init__(
        self, key: ec.EllipticCurvePrivateKey, policy_input: dict[str, Any], now: datetime = NOW
    ) -> None:
        self.key = key
        self.kid = thumbprint(public_jwk(key.public_key()))
        self.keys = {self.kid: key.public_key()}  # what the broker holds: the same objects
        self.pop_jwk = public_jwk(ec.generate_private_key(ec.SECP256R1()).public_key())
        self.encryption_jwk = public_jwk(x25519.X25519PrivateKey.generate().public_key())
        jti = str(uuid.uuid4())
        claims = ear_claims(
            issuer=AUDIENCE,
            audience=AUDIENCE,
            jti=jti,
            now=now,
            ttl=TTL,
            not_after=None,
            nonce="n" * 43,
            verifier_build="test",
            submods=[Submod("cpu0", "affirming")],
            pop_jwk=self.pop_jwk,
            encryption_jwk=self.encryption_jwk,
            policy_digest="sha256:" + "0" * 64,
            evidence_digests={},
            input_digest="sha256:" + hashlib.sha256(canonical(policy_input)).hexdigest(),
        )
        self.token = sign_ear(claims, kid=self.kid, sign=self._sign)
        self.entry = AttestationEntry(
            jti=jti,
            expires_at=now + TTL,
            pop_thumbprint=thumbprint(self.pop_jwk),
            policy_input=policy_input,
        )

    def _sign(self, data: bytes) -> bytes:
        r, s = decode_dss_signature(self.key.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")


@pytest.fixture(scope="module")
def issued() -> Issued:
    return Issued(ec.generate_private_key(ec.SECP256R1()), STORED)


def _code(error: pytest.ExceptionInfo[Exception]) -> str:
    assert isinstance(error.value, AttestationError | UpstreamError)
    return error.value.code.value


# --- verified results --------------------------------------------------------------------------


def test_a_result_is_verified_once_and_its_times_at_every_request(issued: Issued) -> None:
    cache = ResultCache()
    first = cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=NOW)
    later = NOW + timedelta(seconds=60)
    assert cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=later) is first
    assert first.ear.jti == issued.entry.jti
    assert first.kid == issued.kid


def test_an_expired_result_is_refused_though_it_verified_before(issued: Issued) -> None:
    cache = ResultCache()
    cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=NOW)
    expired = NOW + TTL + timedelta(seconds=10)
    with pytest.raises(AttestationError) as caught:
        cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=expired)
    assert _code(caught) == ErrorCode.TOKEN_EXPIRED.value
    assert len(cache) == 0  # forgotten: verified in full next time
    early = NOW - timedelta(seconds=60)  # not yet valid (iat in the future) is refused too
    cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=NOW)
    with pytest.raises(AttestationError) as caught:
        cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=early)
    assert _code(caught) == ErrorCode.TOKEN_ISSUED_IN_FUTURE.value


def test_a_retired_or_replaced_result_key_verifies_again(issued: Issued) -> None:
    """Rotation: the key a result was verified with must still be the one its ``kid`` names."""
    cache = ResultCache()
    cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=NOW)
    successor = ec.generate_private_key(ec.SECP256R1()).public_key()
    retired = {thumbprint(public_jwk(successor)): successor}
    with pytest.raises(AttestationError) as caught:
        cache.verify(issued.token, keys=retired, audience=AUDIENCE, now=NOW)
    assert _code(caught) == ErrorCode.TOKEN_KEY_UNKNOWN.value
    replaced = {issued.kid: successor}  # the same kid naming another key
    with pytest.raises(AttestationError) as caught:
        cache.verify(issued.token, keys=replaced, audience=AUDIENCE, now=NOW)
    assert _code(caught) == ErrorCode.TOKEN_SIGNATURE_INVALID.value
    same = {issued.kid: issued.key.public_key()}  # an equal key, loaded again: verified again
    assert cache.verify(issued.token, keys=same, audience=AUDIENCE, now=NOW).key is same[issued.kid]


def test_another_audience_or_other_bytes_verify_again(issued: Issued) -> None:
    cache = ResultCache()
    cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=NOW)
    with pytest.raises(AttestationError) as caught:
        cache.verify(issued.token, keys=issued.keys, audience="https://other.example", now=NOW)
    assert _code(caught) == ErrorCode.AUDIENCE_MISMATCH.value
    header, claims, signature = issued.token.split(".")
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    with pytest.raises(AttestationError):
        cache.verify(f"{header}.{claims}.{flipped}", keys=issued.keys, audience=AUDIENCE, now=NOW)


def test_the_results_held_are_bounded() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    cache = ResultCache(max_entries=8)
    for _ in range(30):
        issued = Issued(key, STORED)
        cache.verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=NOW)
        assert len(cache) <= 8
    later = NOW + TTL + timedelta(seconds=10)  # when full, the expired go first
    fresh = Issued(key, STORED, now=later)
    cache.verify(fresh.token, keys=fresh.keys, audience=AUDIENCE, now=later)
    assert len(cache) == 1


# --- prepared entries --------------------------------------------------------------------------


def test_a_stored_entry_that_changed_is_matched_again(issued: Issued) -> None:
    held = ResultCache().verify(issued.token, keys=issued.keys, audience=AUDIENCE, now=NOW)
    held.prepared = prepared = prepare(held.ear, issued.entry)
    assert held.prepared_for(issued.entry) is prepared
    assert prepared.encryption_key.thumbprint == thumbprint(issued.encryption_jwk)
    revoked = dataclasses.replace(issued.entry, status="revoked")  # another object: checked
    assert held.prepared_for(revoked) is None
    assert prepare(held.ear, revoked).stored.encoded == prepared.stored.encoded
    other = {
        **STORED,
        "tee": {"verifier": "gca", "workload": {"image_digest": "sha256:" + "e" * 64}},
    }
    tampered = dataclasses.replace(issued.entry, policy_input=other)
    assert held.prepared_for(tampered) is None
    with pytest.raises(UpstreamError) as caught:
        prepare(held.ear, tampered)
    assert _code(caught) == ErrorCode.ATTESTATION_STORE_MISMATCH.value
    rebound = dataclasses.replace(issued.entry, pop_thumbprint="x" * 43)
    with pytest.raises(UpstreamError):
        prepare(held.ear, rebound)


def test_equal_text_parses_to_the_same_entry_and_other_text_to_another(issued: Issued) -> None:
    parsed = ParsedEntries(max_entries=2)
    text = issued.entry.to_json()
    assert parsed.parse(text) is parsed.parse(text)
    assert parsed.parse(text.encode()) == parsed.parse(text)
    changed = text.replace('"active"', '"revoked"')
    assert parsed.parse(changed) is not parsed.parse(text)
    assert parsed.parse(changed).status == "revoked"
    for n in range(5):  # bounded
        parsed.parse(text.replace("0", str(n), 1))
    assert len(parsed._parsed) <= 2


# --- encodings: canonical's, byte for byte ------------------------------------------------------

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),  # lone surrogates included
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)
_names = st.sampled_from(
    ["", "hash", "index", "prev", "replica", "seq", "keys", "input", "time", "é", "\ud800", "z"]
) | st.text(max_size=7)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.dictionaries(_names, _values, max_size=8), st.data())
def test_spliced_members_are_canonical(members: dict[str, Any], data: st.DataObject) -> None:
    encoded = {
        n: Encoded(canonical(v)) if data.draw(st.booleans()) else v for n, v in members.items()
    }
    assert canonical_members(encoded) == canonical(members)[1:-1]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.dictionaries(_names, _values, max_size=8), st.data())
def test_a_record_with_spliced_parts_seals_to_the_same_line(
    body: dict[str, Any], data: st.DataObject
) -> None:
    """The log writer's ``sealed_line`` of a record whose parts were encoded once equals its
    line for the record as values: the hash and the line, byte for byte."""
    spliced = {n: Encoded(canonical(v)) if data.draw(st.booleans()) else v for n, v in body.items()}
    assert sealed_line(spliced) == sealed_line(body)


_parts = st.dictionaries(st.text(max_size=6), _values, max_size=4)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    _parts, st.lists(_parts, max_size=2), st.dictionaries(st.text(max_size=5), _parts, max_size=2)
)
def test_the_spliced_release_input_is_the_canonical_input(
    tee: dict[str, Any], gpus: list[dict[str, Any]], claims: dict[str, dict[str, Any]]
) -> None:
    """The input a release on a result is decided on: what ``build_input`` made of the stored
    claims (plus ``request.attestation``), and its canonical JSON, spliced."""
    stored = StoredInput.of({"tee": tee, "gpus": gpus, "claims": claims})
    facts = RequestFacts(
        key="models/k", version=3, purpose="model-weights", runner_key_thumbprint="t"
    )
    attestation = {"jti": "j", "expires_at": NOW.isoformat()}
    policy_input, encoded = stored.release_input(facts, attestation, NOW)
    reference = build_input(request=facts, tee=tee, raw_claims=claims, gpus=gpus, now=NOW)
    reference["request"]["attestation"] = attestation
    assert policy_input == reference
    assert encoded == canonical(reference)


_pointers = st.lists(
    st.sampled_from(
        [
            "/claims",
            "/claims/gca",
            "/claims/gca/sub",
            "/claims/gca/nope",
            "/gpus/0/ueid",
            "/gpus/1",
            "/tee/workload/image_digest",
            "/tee",
            "/request/key",
            "/request/attestation/jti",
            "/time",
            "/schema",
            "/",
            "no slash",
            "/a~1b",
            "/claims/a~1b",
            "/claims/a~1b/c",
            "/nothing/here",
        ]
    ),
    max_size=4,
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(_pointers, _pointers)
def test_the_masked_input_is_canonical_of_masked(first: list[str], second: list[str]) -> None:
    """Each set of masks, one after the other on the same attestation (a new policy's masks):
    ``masked_encoding`` equals ``canonical(masked(input))`` every time."""
    stored = StoredInput.of({**STORED, "claims": {"gca": {"sub": "s"}, "a/b": {"c": 1}}})
    facts = RequestFacts(
        key="models/k", version=1, purpose="model-weights", runner_key_thumbprint="t"
    )
    policy_input, _ = stored.release_input(facts, {"jti": "j", "expires_at": "x"}, NOW)
    for pointers in (first, second, first):
        expected = canonical(masked(policy_input, pointers, b"k" * 32))
        assert stored.masked_encoding(policy_input, pointers, b"k" * 32) == expected
