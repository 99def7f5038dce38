"""The record envelope reads any record a broker wrote, of any version, and never crashes a
reader (issue 30, item 2): members of the wrong type read as absent, an unknown type is
``unknown``, only a line that is not a JSON object is refused (``RecordError``). The live log
of every type is read in ``tests/integration/test_record_readers.py``."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.audit.envelope import RecordError, parse_record
from broker.audit.ocsf import ocsf_events
from broker.audit.query import rows
from broker.audit.sink import syslog_severity
from broker.core.records import RecordType, record_head

# the records each plan writes per outcome, pinned byte for byte (test_decision_records.py)
PINNED = sorted((Path(__file__).parents[1] / "vectors" / "decision_records").glob("*.json"))
SEVERITY = {"allow": 6, "partial": 5, "deny": 4, "error": 3}

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
MEMBERS = [
    "decision_id", "request_id", "time", "result", "code", "message", "reasons",
    "policy_digest", "input_digest", "input", "identity", "key", "version", "kid", "index",
    "seq", "replica", "hash", "who", "jti", "attestation", "keys", "asked", "action",
]  # fmt: skip
TYPES = st.sampled_from([*(t.value for t in RecordType), "from_a_newer_broker"]) | JSON
KEY_ITEM = st.fixed_dictionaries(
    {}, optional={m: JSON | st.text(max_size=5) for m in ("key", "version", "result", "reasons")}
)
RECORDS = st.fixed_dictionaries(
    {"type": TYPES},
    optional={
        **dict.fromkeys(MEMBERS, JSON),
        "keys": st.lists(KEY_ITEM | JSON, max_size=3),
        "asked": st.lists(KEY_ITEM | JSON, max_size=3),
        "time": st.sampled_from(
            ["2026-12-01T12:00:00Z", "2026-12-01T12:00:00", "noon", "0001-01-01T00:00:00+01:00"]
        ),
    },
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(RECORDS)
def test_every_reader_reads_any_object_without_crashing(record: dict[str, Any]) -> None:
    envelope = parse_record(json.dumps(record).encode())
    assert envelope == parse_record(record)
    events = ocsf_events(envelope)
    assert events
    for event in events:
        assert all(r.get("name", "") is not None for r in event["resources"])
        json.dumps(event)
    assert syslog_severity(envelope) in (3, 4, 5, 6)
    produced = list(rows(envelope))
    assert produced
    for row in produced:
        json.dumps(row.as_json())


@pytest.mark.parametrize("line", [b"[1]", b'"release"', b"null", b"{", b"\xff"])
def test_a_line_that_is_not_an_object_is_refused_by_name(line: bytes) -> None:
    with pytest.raises(RecordError, match=r"not a (JSON )?record"):
        parse_record(line)


def test_an_attested_release_of_an_older_broker_reads_as_written() -> None:
    """Before issue 27 a release on a result refused before its keys listed no ``asked``; the
    leaf index of older logs is ``seq`` only."""
    envelope = parse_record(
        {"type": "attested_release", "seq": 4, "decision_id": "r-1", "result": "deny",
         "code": "dpop_proof_invalid", "attestation": {"jti": "a-1", "log_index": 2},
         "keys": []}
    )  # fmt: skip
    assert (envelope.index, envelope.keys, envelope.outcome) == (4, (), "deny")
    (decision,) = envelope.decisions  # the request as a whole, naming no key
    assert (decision.key, decision.code, decision.decided) == (None, "dpop_proof_invalid", False)
    (event,) = ocsf_events(envelope)
    assert (event["resources"], event["metadata"]["uid"]) == ([], "r-1")
    assert event["actor"]["session"] == {"uid": "a-1"}


def test_keys_asked_and_never_decided_follow_the_decided_ones() -> None:
    envelope = parse_record(
        {"type": "attested_release", "decision_id": "r-2", "result": "error",
         "code": "internal_error", "message": "internal error",
         "asked": [{"key": "a", "version": None}, {"key": "b", "version": 3}],
         "keys": [{"key": "a", "version": 1, "result": "error", "code": "internal_error",
                   "reasons": [], "input": {"x": 1}}]}
    )  # fmt: skip
    assert [(k.key, k.version, k.result, k.decided) for k in envelope.keys] == [
        ("a", 1, "error", True),
        ("b", 3, "error", False),
    ]
    assert envelope.outcome == "error"
    assert [e["resources"][0]["name"] for e in ocsf_events(envelope)] == ["a", "b"]


def test_a_record_without_a_type_is_unknown_not_a_release() -> None:
    envelope = parse_record({"result": "allow", "key": "models/a", "index": 1})
    assert (envelope.kind, envelope.type, envelope.keys) == (RecordType.UNKNOWN, "", ())
    (event,) = ocsf_events(envelope)
    assert (event["activity_id"], event["status"], event["api"]["operation"]) == (
        99, "Unknown", "unknown"
    )  # fmt: skip


def test_what_a_writer_writes_in_the_head_is_read_back_member_for_member() -> None:
    written = record_head(
        RecordType.ATTESTATION.value,
        decision_id="j-1",
        request_id="q-1",
        time=datetime(2026, 12, 1, 12, 0, tzinfo=UTC),
        result="deny",
        code="policy_denied",
        message="denied by policy",
    )
    assert json.loads(json.dumps(written)) == {
        "type": "attestation", "decision_id": "j-1", "request_id": "q-1",
        "time": "2026-12-01T12:00:00+00:00", "result": "deny", "code": "policy_denied",
        "message": "denied by policy",
    }  # fmt: skip
    envelope = parse_record(written)
    assert (envelope.kind, envelope.decision_id, envelope.request_id, envelope.time) == (
        RecordType.ATTESTATION, "j-1", "q-1", "2026-12-01T12:00:00+00:00"
    )  # fmt: skip
    assert (envelope.result, envelope.code, envelope.message) == (
        "deny", "policy_denied", "denied by policy"
    )  # fmt: skip
    assert envelope.at == datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize("path", PINNED, ids=[p.stem for p in PINNED])
def test_every_pinned_record_is_read_with_every_key_it_names(path: Path) -> None:
    """Each outcome of each plan (a bug after a key was wrapped, a record that could not be
    built, a cancelled client…): one OCSF event and one query row per key the record names,
    each named; syslog by the result written."""
    record = json.loads(path.read_text())
    named = {record.get("key")} | {
        k.get("key") for k in (record.get("keys") or []) + (record.get("asked") or [])
    }
    named.discard(None)
    envelope = parse_record(record)
    events = ocsf_events(envelope)
    exported = [r["name"] for e in events for r in e["resources"] if r["type"] == "key"]
    assert set(exported) == named
    assert len(events) == max(1, len(exported))  # one event per key
    assert {row.as_json().get("key") for row in rows(envelope)} - {None} == named
    assert syslog_severity(envelope) == SEVERITY[record["result"]]


def test_the_pinned_records_include_a_key_asked_and_never_decided() -> None:
    assert len(PINNED) >= 20
    withdrawn = json.loads(
        (PINNED[0].parent / "attested_release.internal-withdrawn.json").read_text()
    )
    assert len(withdrawn["asked"]) > len(withdrawn["keys"])  # the case the export missed
