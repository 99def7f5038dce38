"""``broker verify snp REPORT --certs DIR_OR_FILES [--at TIME]``: verify an AMD SEV-SNP
attestation report offline with the service's own code (``attestation/raw/snp*.py``).

REPORT is the guest's evidence object (JSON, as a Confidential Containers guest sends it; its
``cert_chain`` is used), the report's 1184 bytes, or those bytes as hex text. ``--certs`` names
the VCEK/VLEK and any ASK/ASVK (DER or PEM files, or directories of them); the roots are the
pinned AMD ARKs (``certs/amd_sev_snp_roots.pem``, or ``--root``). Nothing is fetched. The
report data binding is the caller's to check, so it is listed under ``skipped``.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from broker.attestation.raw.snp import common_name, find_vek, verify_snp_report
from broker.attestation.raw.snp_certs import (
    load_trust,
    read_certificate_files,
    sent_certificates,
    split_certificates,
)
from broker.attestation.raw.snp_evidence import parse_evidence
from broker.attestation.raw.snp_report import REPORT_BYTES, SnpReport, parse_report
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--certs",
        action="extend",
        nargs="+",
        type=Path,
        default=[],
        metavar="DIR_OR_FILE",
        help="snp: the VCEK/VLEK and any ASK/ASVK (DER or PEM files, or directories); "
        "roots in them are ignored: only the pinned AMD roots (or --root) are trusted",
    )
    parser.add_argument(
        "--max-vmpl", type=int, default=0, help="snp: the highest VMPL a report may come from"
    )


def run(args: argparse.Namespace, at: datetime) -> dict[str, Any]:
    """Verify the report named by ``args.files[0]`` at ``at``; the printable result.

    Raises:
        AttestationError: the report does not verify.
        ConfigError: a file is missing or unusable, or no certificate fits the report.
    """
    report, sent, sent_middles = _report(Path(args.files[0]))
    try:
        veks, middles = split_certificates(read_certificate_files(args.certs))
        trust = load_trust(args.root, [*middles, *sent_middles])
    except (OSError, ValueError) as exc:
        raise ConfigError("--certs", str(exc)) from exc
    # One certificate that does not fit is still used: the refusal then says what differs.
    vek = sent[0] if sent else find_vek(report, veks) or (veks[0] if len(veks) == 1 else None)
    if vek is None:
        raise ConfigError("--certs", "no VCEK/VLEK among them is for this report's chip and TCB")
    verified = verify_snp_report(report, vek, trust, now=at, max_vmpl=args.max_vmpl)
    return {
        "kind": "snp",
        "verified_at": at.isoformat(),
        "tee": dict(verified.tee),
        "claims": dict(verified.claims),
        "endorsement_key": {
            "name": common_name(vek),
            "source": "evidence" if sent else "--certs",
            "sha256": vek.fingerprint(hashes.SHA256()).hex(),
        },
        "skipped": ["report_data binding"],
    }


def _report(path: Path) -> tuple[SnpReport, list[x509.Certificate], list[x509.Certificate]]:
    """The parsed report, and the endorsement keys and ASKs its evidence object carries."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("REPORT", f"cannot read {path}") from exc
    if data.lstrip().startswith(b"{"):
        try:
            evidence = parse_evidence(loads_bounded(data))
        except ValueError as exc:
            raise ConfigError("REPORT", "not JSON") from exc
        report = parse_report(evidence.report)
        return report, *sent_certificates(evidence, report)
    if len(data) != REPORT_BYTES:
        try:
            data = bytes.fromhex(data.decode("ascii").strip())
        except ValueError as exc:
            raise ConfigError("REPORT", f"neither JSON, {REPORT_BYTES} bytes nor hex") from exc
    return parse_report(data), [], []
