"""The guest's SEV-SNP evidence object (serde JSON of the ``sev`` crate's report) parsed strictly
back into the signed bytes (``attestation/raw/snp_evidence.py``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from broker.attestation.raw.snp import load_certificate, verify_snp_report
from broker.attestation.raw.snp_certs import load_trust
from broker.attestation.raw.snp_evidence import MAX_CERT_ENTRIES, parse_evidence
from broker.attestation.raw.snp_report import parse_report
from broker.core.errors import AttestationError, ErrorCode
from tests.support.snp import AT, fixture, guest_evidence, milan_report, serde_object

VERSION_2: dict[str, Any] = {
    "attestation_report": serde_object(milan_report(), "Milan"),
    "cert_chain": None,
}


def refused(code: ErrorCode, evidence: dict[str, Any]) -> None:
    with pytest.raises(AttestationError) as caught:
        parse_evidence(evidence)
    assert caught.value.code == code, caught.value.message


def test_the_guests_evidence_object_verifies() -> None:
    evidence = parse_evidence(guest_evidence())
    assert [cert.cert_type for cert in evidence.certs] == ["VCEK"]
    report = parse_report(evidence.report)
    vcek = load_certificate(evidence.certs[0].data)
    tee = verify_snp_report(report, vcek, load_trust(), now=AT).tee
    assert (tee["product"], tee["tcb"]["snp"], report.version) == ("Genoa", 23, 3)


@pytest.mark.parametrize(
    ("name", "product"),
    [
        ("virtee_report_milan.hex", "Milan"),
        ("trustee_test-report.bin", "Milan"),
        ("trustee_test-vlek-report.bin", "Milan"),
        ("omne_attestation.bin", "Milan"),
    ],
)
def test_serde_form_rebuilds_the_exact_signed_bytes(name: str, product: str) -> None:
    raw = milan_report() if name.endswith(".hex") else fixture(name)
    rebuilt = parse_evidence({"attestation_report": serde_object(raw, product)}).report
    assert rebuilt == raw


def test_older_sev_without_the_mitigation_vectors_accepted() -> None:
    evidence = copy.deepcopy(VERSION_2)
    del evidence["attestation_report"]["launch_mit_vector"]
    del evidence["attestation_report"]["current_mit_vector"]
    assert parse_evidence(evidence).report == milan_report()


def _report(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    evidence = copy.deepcopy(VERSION_2)
    change(evidence["attestation_report"])
    return evidence


MALFORMED_REPORTS = {
    "unknown member": lambda r: r.update(extra=1),
    "missing member": lambda r: r.pop("measurement"),
    "boolean for an integer": lambda r: r.update(vmpl=True),
    "negative integer": lambda r: r.update(guest_svn=-1),
    "u32 overflow": lambda r: r.update(key_info=2**32),
    "short byte array": lambda r: r.update(report_data=[0] * 63),
    "byte over 255": lambda r: r.update(host_data=[256] + [0] * 31),
    "string for bytes": lambda r: r.update(measurement="00" * 48),
    "fmc on Milan": lambda r: r["reported_tcb"].update(fmc=1),
    "tcb member unknown": lambda r: r["launch_tcb"].update(extra=0),
    "cpuid on version 2": lambda r: r.update(cpuid_fam_id=25, cpuid_mod_id=1, cpuid_step=1),
    "mitigation vector on version 2": lambda r: r.update(launch_mit_vector=1),
    "masked chip id on version 2": lambda r: r.update(chip_id=[0] * 64),
    "signature not an object": lambda r: r.update(signature=[0] * 144),
    "signature r short": lambda r: r["signature"].update(r=[0] * 48),
    "version object member": lambda r: r["current"].update(patch=1),
}


@pytest.mark.parametrize("change", MALFORMED_REPORTS.values(), ids=MALFORMED_REPORTS.keys())
def test_malformed_report_object_rejected(change: Callable[[dict[str, Any]], object]) -> None:
    refused(ErrorCode.SNP_REPORT_MALFORMED, _report(change))


def test_other_versions_and_unknown_cpus_rejected() -> None:
    refused(ErrorCode.SNP_REPORT_VERSION_UNSUPPORTED, _report(lambda r: r.update(version=5)))
    genoa = guest_evidence()
    genoa["attestation_report"]["cpuid_fam_id"] = 0x17  # Zen 2: no SEV-SNP product
    refused(ErrorCode.SNP_PRODUCT_UNKNOWN, genoa)


def _chain(entries: Any) -> dict[str, Any]:
    return {**VERSION_2, "cert_chain": entries}


def test_cert_chain_entries_parsed_and_bounded() -> None:
    vcek = list(fixture("virtee_vcek_milan.der"))
    other = {"OTHER": "4f2b2a4b-0000-0000-0000-000000000000"}
    parsed = parse_evidence(
        _chain([{"cert_type": other, "data": [1]}, {"cert_type": "VCEK", "data": vcek}])
    )
    assert [c.cert_type for c in parsed.certs] == ["OTHER", "VCEK"]
    assert parsed.certs[1].data == bytes(vcek)
    too_many = [{"cert_type": "CRL", "data": [1]}] * (MAX_CERT_ENTRIES + 1)
    for bad in (
        too_many,
        [{"cert_type": "ASVK", "data": [1]}],  # no such CertType
        [{"cert_type": "VCEK", "data": []}],
        [{"cert_type": "VCEK", "data": [300]}],
        [{"cert_type": "VCEK", "data": "MII="}],
        [{"cert_type": "VCEK"}],
        {"cert_type": "VCEK", "data": [1]},
    ):
        refused(ErrorCode.SNP_REPORT_MALFORMED, _chain(bad))


def test_evidence_members_are_exact() -> None:
    refused(ErrorCode.SNP_REPORT_MALFORMED, {"cert_chain": None})
    refused(ErrorCode.SNP_REPORT_MALFORMED, {**VERSION_2, "report": "…"})
    refused(ErrorCode.SNP_REPORT_MALFORMED, {"attestation_report": [1, 2]})
