"""``broker verify snp`` over the real SEV-SNP vectors (tests/fixtures/raw/snp/), in process."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.cli import run
from tests.support.snp import FIXTURES

AT = ["--at", "2025-06-01T00:00:00Z"]


def verify(*args: str) -> tuple[int, dict[str, object]]:
    ran = run("verify", "snp", *args)
    return ran.returncode, json.loads(ran.stdout) if ran.stdout.strip() else {}


def test_hex_report_with_its_vcek_and_chain_files() -> None:
    code, out = verify(
        str(FIXTURES / "virtee_report_milan.hex"),
        "--certs",
        str(FIXTURES / "virtee_vcek_milan.der"),
        str(FIXTURES / "virtee_cert_chain_milan"),
        *AT,
    )
    assert code == 0, out
    assert out["tee"]["product"] == "Milan"  # type: ignore[index]
    assert out["endorsement_key"]["source"] == "--certs"  # type: ignore[index]
    assert out["skipped"] == ["report_data binding"]


def test_guest_evidence_object_carries_its_own_vcek() -> None:
    code, out = verify(str(FIXTURES / "trustee_evidence.json"), *AT)
    assert code == 0, out
    assert out["tee"]["product"] == "Genoa"  # type: ignore[index]
    assert out["endorsement_key"]["source"] == "evidence"  # type: ignore[index]


def test_binary_report_with_a_directory_of_certificates(tmp_path: Path) -> None:
    (tmp_path / "a.der").write_bytes((FIXTURES / "trustee_test-vcek.der").read_bytes())
    (tmp_path / "b.der").write_bytes((FIXTURES / "virtee_vcek_milan.der").read_bytes())
    code, out = verify(str(FIXTURES / "trustee_test-report.bin"), "--certs", str(tmp_path), *AT)
    assert code == 0, out


def test_refusals_exit_1_with_the_code() -> None:
    vlek = [
        str(FIXTURES / "trustee_test-vlek-report.bin"),
        "--certs",
        str(FIXTURES / "trustee_test-vlek.der"),
    ]
    assert verify(*vlek, *AT, "--max-vmpl", "1")[0] == 0
    code, out = verify(*vlek, *AT)
    assert (code, out["error"]["code"]) == (1, "snp_vmpl_refused")  # type: ignore[index]
    code, out = verify(*vlek, "--at", "2026-01-01T00:00:00Z", "--max-vmpl", "1")
    assert (code, out["error"]["code"]) == (1, "snp_cert_chain_invalid")  # type: ignore[index]
    milan = [str(FIXTURES / "virtee_report_milan.hex"), "--certs"]
    code, out = verify(*milan, str(FIXTURES / "omne_kds_vcek.der"), "--at", "2026-09-01T00:00:00Z")
    assert (code, out["error"]["code"]) == (1, "snp_tcb_mismatch")  # type: ignore[index]


def test_unusable_inputs_exit_2() -> None:
    assert verify(str(FIXTURES / "virtee_report_milan.hex"), *AT)[0] == 2  # no VCEK anywhere
    assert verify(str(FIXTURES / "nope.bin"), *AT)[0] == 2
    assert verify(str(FIXTURES / "PROVENANCE.md"), *AT)[0] == 2  # neither JSON, bytes nor hex
    code, _ = verify(
        str(FIXTURES / "virtee_report_milan.hex"), "--certs", str(FIXTURES / "PROVENANCE.md")
    )
    assert code == 2
