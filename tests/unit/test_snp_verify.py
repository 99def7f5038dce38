"""AMD SEV-SNP reports verified offline (``attestation/raw/snp.py``): the real vectors of
tests/fixtures/raw/snp/ against the shipped AMD roots, and the attacks each check stops."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from broker.attestation.claims import ita_tee
from broker.attestation.ita import VerifiedItaToken
from broker.attestation.raw import REPORT_DATA_BYTES, VerifiedRawEvidence
from broker.attestation.raw.snp import SnpTrust, load_certificate, verify_snp_report
from broker.attestation.raw.snp_certs import load_trust
from broker.attestation.raw.snp_report import SIGNED_BYTES, Tcb, parse_report
from broker.core.errors import AttestationError, ErrorCode
from broker.policy.input_lint import lint_input_paths
from tests.support.snp import (
    AT,
    AT_OMNE,
    fake_amd,
    fixture,
    milan_report,
    patched,
    signed,
)

TRUST = load_trust()
MILAN_TCB = Tcb(bootloader=3, tee=0, snp=8, microcode=115, fmc=None)  # virtee's report


def verify(
    raw: bytes, vek: str | Any, *, at: datetime = AT, trust: SnpTrust = TRUST, **kw: Any
) -> VerifiedRawEvidence:
    cert = load_certificate(fixture(vek)) if isinstance(vek, str) else vek
    return verify_snp_report(parse_report(raw), cert, trust, now=at, **kw)


def refused(code: ErrorCode, call: Callable[[], object]) -> AttestationError:
    with pytest.raises(AttestationError) as caught:
        call()
    assert caught.value.code == code, caught.value.message
    return caught.value


def test_virtee_milan_report_verifies_into_the_policy_input_shape() -> None:
    raw = milan_report()
    verified = verify(raw, "virtee_vcek_milan.der")
    tee = verified.tee
    assert verified.technology == tee["technology"] == "sev-snp"
    assert (tee["verifier"], tee["issuer"], tee["product"]) == ("local", "ARK-Milan", "Milan")
    assert tee["debug"] is False
    assert tee["secure_boot"] is False
    assert tee["tcb"] == MILAN_TCB.as_json()
    assert tee["measurements"]["measurement"] == raw[0x90:0xC0].hex()
    assert verified.report_data == raw[0x50:0x90]
    assert len(verified.report_data) == REPORT_DATA_BYTES
    assert verified.verified_at == AT
    assert tee["tcb_status"] == ""
    assert tee["advisory_ids"] == []
    # one policy reads every kind: the token verifiers' tee keys are all here, nested ones too
    token = ita_tee(VerifiedItaToken(issuer="i", kid="k", claims={}))
    assert set(token) <= set(tee)
    for section in ("software", "workload", "platform"):
        assert set(token[section]) == set(tee[section])
    assert verified.claims["policy"]["smt_allowed"] is True
    assert verified.claims["version"] == 2


def test_trustee_vcek_report_verifies() -> None:
    tee = verify(fixture("trustee_test-report.bin"), "trustee_test-vcek.der").tee
    assert (tee["product"], tee["signing_key"], tee["vmpl"]) == ("Milan", "vcek", 0)


def test_vlek_report_verifies_through_the_asvk() -> None:
    verified = verify(fixture("trustee_test-vlek-report.bin"), "trustee_test-vlek.der", max_vmpl=1)
    assert (verified.tee["signing_key"], verified.tee["vmpl"]) == ("vlek", 1)
    assert verified.claims["chip_id_masked"] is True
    assert verified.claims["version"] == 3


def test_report_from_a_higher_vmpl_rejected_by_default() -> None:
    refused(
        ErrorCode.SNP_VMPL_REFUSED,
        lambda: verify(fixture("trustee_test-vlek-report.bin"), "trustee_test-vlek.der"),
    )


def test_debug_policy_bit_reads_debug_true() -> None:
    verified = verify(fixture("omne_attestation.bin"), "omne_kds_vcek.der", at=AT_OMNE)
    assert verified.tee["debug"] is True
    assert verified.claims["policy"]["debug_allowed"] is True


def test_vcek_for_another_tcb_rejected() -> None:
    # omne's VCEK: bl 2, snp 5, ucode 68; the report's REPORTED_TCB: bl 3, snp 8, ucode 115
    error = refused(
        ErrorCode.SNP_TCB_MISMATCH,
        lambda: verify(milan_report(), "omne_kds_vcek.der", at=AT_OMNE),
    )
    assert "bootloader SPL 2" in error.message


def test_vcek_of_another_chip_rejected() -> None:
    # Trustee's VCEK: the same TCB as the report, another chip
    refused(ErrorCode.SNP_CHIP_ID_MISMATCH, lambda: verify(milan_report(), "trustee_test-vcek.der"))


def test_report_chained_to_an_unpinned_root_rejected() -> None:
    raw = milan_report()
    forged = fake_amd("Milan")
    vcek, key = forged.vcek(MILAN_TCB, raw[0x1A0:0x1E0])
    report = signed(raw, key)
    assert verify(report, vcek, trust=forged.trust()).tee["product"] == "Milan"  # the control
    refused(ErrorCode.SNP_CERT_CHAIN_INVALID, lambda: verify(report, vcek))


EC_PUBLIC_KEY_OID = bytes.fromhex("06072a8648ce3d0201")  # id-ecPublicKey, DER
RSASSA_PSS_OID = bytes.fromhex("06092a864886f70d01010a")


@pytest.mark.parametrize(
    ("oid", "unknown"),
    [
        (EC_PUBLIC_KEY_OID, bytes.fromhex("06072a8648ce3d0209")),  # a key algorithm no one knows
        (RSASSA_PSS_OID, bytes.fromhex("06092a864886f70d01017f")),  # a signature algorithm
    ],
)
def test_guest_sent_vcek_with_an_unknown_algorithm_is_a_chain_error(
    oid: bytes, unknown: bytes
) -> None:
    """The guest sends its VCEK: one whose key (or signature) algorithm ``cryptography`` does not
    know raises ``UnsupportedAlgorithm`` (not a ValueError) when read; that is an invalid chain,
    not a 500."""
    raw, amd = milan_report(), fake_amd("Milan")
    vcek, key = amd.vcek(MILAN_TCB, raw[0x1A0:0x1E0])
    report = signed(raw, key)
    assert verify(report, vcek, trust=amd.trust()).technology == "sev-snp"  # the control
    der = vcek.public_bytes(Encoding.DER)
    assert oid in der
    strange = load_certificate(der.replace(oid, unknown))
    refused(ErrorCode.SNP_CERT_CHAIN_INVALID, lambda: verify(report, strange, trust=amd.trust()))


def test_vcek_under_another_products_root_rejected() -> None:
    trust = replace(TRUST, roots={k: v for k, v in TRUST.roots.items() if k != "Milan"})
    refused(
        ErrorCode.SNP_CERT_CHAIN_INVALID,
        lambda: verify(milan_report(), "virtee_vcek_milan.der", trust=trust),
    )


@pytest.mark.parametrize("at", [datetime(2023, 4, 2, tzinfo=UTC), datetime(2030, 4, 4, tzinfo=UTC)])
def test_vcek_outside_its_validity_rejected(at: datetime) -> None:
    refused(
        ErrorCode.SNP_CERT_CHAIN_INVALID,
        lambda: verify(milan_report(), "virtee_vcek_milan.der", at=at),
    )


def test_vlek_certificate_for_a_vcek_signed_report_rejected() -> None:
    refused(
        ErrorCode.SNP_CERT_CHAIN_INVALID,
        lambda: verify(milan_report(), "trustee_test-vlek.der", at=AT),
    )


def test_v3_cpuid_naming_another_product_than_the_chain_rejected() -> None:
    raw = patched(patched(milan_report(), 0, b"\x03"), 0x188, bytes([0x19, 0xA0, 0x01]))  # Genoa
    forged = fake_amd("Milan")
    vcek, key = forged.vcek(MILAN_TCB, raw[0x1A0:0x1E0])
    error = refused(
        ErrorCode.SNP_CERT_CHAIN_INVALID,
        lambda: verify(signed(raw, key), vcek, trust=forged.trust()),
    )
    assert "Genoa" in error.message


def turin_report() -> bytes:
    """A version 3 Turin report of our own: Turin's TCB layout, an 8-byte chip id."""
    raw = patched(milan_report(), 0, b"\x03")
    raw = patched(raw, 0x188, bytes([0x1A, 0x02, 0x01]))
    for at in (0x38, 0x180, 0x1E0, 0x1F0):
        raw = patched(raw, at, bytes([1, 2, 3, 4, 0, 0, 0, 5]))  # fmc bl tee snp … ucode
    return patched(raw, 0x1A0, bytes(range(1, 9)) + bytes(56))


@pytest.mark.parametrize("der_hwid", [False, True])
def test_turin_layout_fmc_and_short_hardware_id(der_hwid: bool) -> None:
    raw = turin_report()
    forged = fake_amd("Turin")
    tcb = Tcb(bootloader=2, tee=3, snp=4, microcode=5, fmc=1)
    vcek, key = forged.vcek(tcb, raw[0x1A0:0x1E0], der_hwid=der_hwid)
    tee = verify(signed(raw, key), vcek, trust=forged.trust()).tee
    assert (tee["product"], tee["tcb"]) == ("Turin", tcb.as_json())
    stale, key = forged.vcek(replace(tcb, fmc=0), raw[0x1A0:0x1E0])
    refused(
        ErrorCode.SNP_TCB_MISMATCH, lambda: verify(signed(raw, key), stale, trust=forged.trust())
    )


@pytest.mark.parametrize(
    ("offset", "value"),
    [(0x34, b"\x02"), (0x48, b"\x02"), (0x48, b"\x1c")],  # SIGNATURE_ALGO 2; MASK_CHIP_KEY; NONE
)
def test_report_not_signed_by_a_vcek_or_vlek_rejected(offset: int, value: bytes) -> None:
    raw = patched(milan_report(), offset, value)
    refused(ErrorCode.SNP_SIGNING_KEY_UNSUPPORTED, lambda: verify(raw, "virtee_vcek_milan.der"))


def test_other_versions_and_lengths_rejected() -> None:
    raw = milan_report()
    refused(
        ErrorCode.SNP_REPORT_VERSION_UNSUPPORTED, lambda: parse_report(patched(raw, 0, b"\x05"))
    )
    refused(
        ErrorCode.SNP_REPORT_VERSION_UNSUPPORTED, lambda: parse_report(patched(raw, 0, b"\x01"))
    )
    refused(ErrorCode.SNP_REPORT_MALFORMED, lambda: parse_report(raw[:-1]))


def test_every_single_bit_flip_of_the_signed_region_and_the_signature_rejected() -> None:
    raw = milan_report()
    vcek = load_certificate(fixture("virtee_vcek_milan.der"))
    started = time.perf_counter()
    accepted = []
    positions = [*range(SIGNED_BYTES * 8), *range(SIGNED_BYTES * 8, (SIGNED_BYTES + 144) * 8)]
    for bit in positions:
        mutated = bytearray(raw)
        mutated[bit // 8] ^= 1 << (bit % 8)
        try:
            verify_snp_report(parse_report(bytes(mutated)), vcek, TRUST, now=AT)
        except AttestationError:
            continue
        accepted.append(bit)
    elapsed = time.perf_counter() - started
    assert accepted == []
    assert len(positions) == (0x2A0 + 144) * 8
    print(f"{len(positions)} single-bit mutations refused in {elapsed:.2f} s")


def test_every_tee_field_is_known_to_the_policy_lint(tmp_path: Path) -> None:
    tee = verify(milan_report(), "virtee_vcek_milan.der").tee
    refs = [f"input.tee.{name}" for name in tee]
    refs += [f"input.tee.{k}.{n}" for k, v in tee.items() if isinstance(v, dict) for n in v]
    refs.append("input.tee.tcb.bogus")
    rules = "\n".join(f"r{i} := {ref}" for i, ref in enumerate(refs))
    (tmp_path / "p.rego").write_text(f"package x\n{rules}\n")
    warnings = list(lint_input_paths(tmp_path))
    assert len(warnings) == 1
    assert "input.tee.tcb.bogus" in warnings[0]
