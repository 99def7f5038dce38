"""The workload certificates an attestation's store entry lists (issue 32,
``attestation/issued.py``): added in the store's atomic update only while the result is
active, the newest ``MAX_IDENTITIES`` kept (expired ones dropped), written and read back
strictly (a store holding them in another form answers ``attestation_store_mismatch``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from broker.attestation.issued import MAX_IDENTITIES, IssuedCertificate
from broker.attestation.stored import (
    AttestationEntry,
    MalformedEntry,
    note_certificate,
    revoke,
)
from broker.stores.attestations import MemoryAttestations

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
SPIFFE_ID = "spiffe://runners.example/shards/llama"


def _issued(n: int, *, lives: timedelta = timedelta(minutes=5)) -> IssuedCertificate:
    return IssuedCertificate(format(n + 1, "x"), SPIFFE_ID, f"{n:064x}", NOW + lives)


async def _store() -> MemoryAttestations:
    store = MemoryAttestations()
    await store.put(AttestationEntry("jti-1", NOW + timedelta(minutes=5), "p" * 43, {}))
    return store


async def test_each_certificate_is_listed_newest_last_and_bounded() -> None:
    store = await _store()
    entry: AttestationEntry | None = None
    for n in range(MAX_IDENTITIES + 3):
        entry = await note_certificate(store, "jti-1", _issued(n), NOW)
    assert entry is not None
    listed = entry.identities
    assert [c.serial for c in listed] == [format(n + 1, "x") for n in range(3, MAX_IDENTITIES + 3)]
    again = AttestationEntry.from_json(entry.to_json())
    assert again.identities == listed
    assert again == entry


async def test_an_expired_certificate_is_dropped_when_another_is_listed() -> None:
    store = await _store()
    await note_certificate(store, "jti-1", _issued(0, lives=timedelta(seconds=10)), NOW)
    later = NOW + timedelta(seconds=10)  # the first one's notAfter
    entry = await note_certificate(store, "jti-1", _issued(1), later)
    assert entry is not None
    assert [c.serial for c in entry.identities] == ["2"]


async def test_a_result_revoked_meanwhile_lists_nothing_more() -> None:
    store = await _store()
    await note_certificate(store, "jti-1", _issued(0), NOW)
    await revoke(store, "jti-1", "test", NOW, who="admin")
    entry = await note_certificate(store, "jti-1", _issued(1), NOW)
    assert entry is not None
    assert entry.status == "revoked"
    assert [c.serial for c in entry.identities] == ["1"]  # the second was not listed
    assert await note_certificate(store, "unknown", _issued(2), NOW) is None
    gone = NOW + timedelta(minutes=5)  # the result's expiry
    assert await note_certificate(store, "jti-1", _issued(3), gone) is None


def test_an_entry_without_certificates_keeps_its_text() -> None:
    """No ``identities`` member while none was issued: entries as every broker wrote them."""
    entry = AttestationEntry("jti-1", NOW, "p" * 43, {})
    assert "identities" not in json.loads(entry.to_json())


@pytest.mark.parametrize(
    "identities",
    [
        "not a list",
        [_issued(0).stored()] * (MAX_IDENTITIES + 1),
        [{**_issued(0).stored(), "serial": "ABC"}],  # upper-case hex
        [{**_issued(0).stored(), "serial": "1" * 41}],
        [{**_issued(0).stored(), "sha256": "00"}],
        [{**_issued(0).stored(), "spiffe_id": "https://x"}],
        [{**_issued(0).stored(), "not_after": "2030"}],
        [{**_issued(0).stored(), "not_after": True}],
        [{**_issued(0).stored(), "not_after": 1e300}],
        ["not an object"],
    ],
)
def test_identities_in_an_unexpected_form_are_the_store_answering_nonsense(
    identities: Any,
) -> None:
    body = json.loads(AttestationEntry("jti-1", NOW, "p" * 43, {}).to_json())
    body["identities"] = identities
    with pytest.raises(MalformedEntry):
        AttestationEntry.from_json(json.dumps(body))


def test_the_status_form_names_the_expiry_in_rfc3339() -> None:
    assert _issued(0).described() == {
        "serial": "1",
        "spiffe_id": SPIFFE_ID,
        "sha256": "0" * 64,
        "not_after": "2030-01-02T03:09:05Z",
    }
