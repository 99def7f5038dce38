"""``broker verify``: verify one piece of evidence offline, for security teams and auditors.

Uses the same pure verifiers as the service, with trust material from files (defaults from
``certs/``) and the time from ``--at`` (default: now). Checks whose inputs are not given
(audience, nonce, issuer) are skipped and listed under ``"skipped"`` in the output.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import x509

from broker.attestation import binding, claims, gca, ita
from broker.attestation.jwks import JwksError, TrustedKeySet, parse_jwks
from broker.attestation.nvidia import local, nras, rim
from broker.errors import AttestationError, ConfigError, ErrorCode

CERTS = Path(__file__).resolve().parent.parent / "certs"
DEFAULT_ROOTS = {
    "gca": CERTS / "google_confidential_space_root.crt",
    "ita": CERTS / "intel_trust_authority_root_ca.pem",
    "nras": CERTS / "nvidia_nras_gpu_intermediate_004.pem",
    "nvidia": CERTS / "nvidia_device_identity_root.pem",
}
DEFAULT_RIM_ROOT = CERTS / "nvidia_corim_signing_root.pem"
DEFAULT_ISSUERS = {
    "gca": "https://confidentialcomputing.googleapis.com",
    "nras": "https://nras.attestation.nvidia.com",
}


@dataclass
class Report:
    kind: str
    at: datetime
    fragment: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def render(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "verified_at": self.at.isoformat(),
            **self.fragment,
            "skipped": self.skipped,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["gca", "ita", "nras", "nvidia"])
    parser.add_argument(
        "files",
        nargs="+",
        type=Path,
        help="gca/ita: token; nras: NRAS result JSON; nvidia: report (hex) or evidence JSON",
    )
    parser.add_argument("--at", help="verification time, RFC 3339 (default: now)")
    parser.add_argument("--jwks", type=Path, help="key set (gca OIDC, ita, nras)")
    parser.add_argument("--root", type=Path, help="trust anchor PEM (default: certs/)")
    parser.add_argument("--chain", type=Path, help="nvidia: the GPU certificate chain (PEM)")
    parser.add_argument(
        "--rim", type=Path, nargs="*", default=[], help="nvidia: driver and VBIOS RIMs"
    )
    parser.add_argument("--rim-root", type=Path, default=DEFAULT_RIM_ROOT)
    parser.add_argument("--arch", default="HOPPER", choices=sorted(local.ARCHES))
    parser.add_argument(
        "--nonce",
        help="gca/ita: a value eat_nonce must contain; "
        "ita held data / nras / nvidia: the nonce in hex",
    )
    parser.add_argument("--audience", help="the audience the token must carry")
    parser.add_argument("--issuer", help="the issuer the token must name (default per kind)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Verify and return the printable report.

    Raises:
        AttestationError: the evidence does not verify.
        ConfigError: a trust file is missing or unusable, or ``--at`` is not RFC 3339.
    """
    at = _time(args.at)
    report = Report(kind=args.kind, at=at)
    verifier = {"gca": _gca, "ita": _ita, "nras": _nras, "nvidia": _nvidia}[args.kind]
    verifier(args, report)
    return report.render()


def _time(text: str | None) -> datetime:
    if text is None:
        return datetime.now(UTC)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ConfigError("--at", "not an RFC 3339 time") from exc
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(what, f"cannot read {path}") from exc


def _roots(args: argparse.Namespace) -> list[x509.Certificate]:
    path = args.root or DEFAULT_ROOTS[args.kind]
    try:
        return x509.load_pem_x509_certificates(_read(path, "--root"))
    except ValueError as exc:
        raise ConfigError("--root", f"{path} is not PEM") from exc


def _keys(args: argparse.Namespace) -> TrustedKeySet:
    if args.jwks is None:
        raise ConfigError("--jwks", f"{args.kind} verification needs the issuer's key set")
    try:
        return parse_jwks(_read(args.jwks, "--jwks"))
    except JwksError as exc:
        raise ConfigError("--jwks", str(exc)) from exc


def _token(args: argparse.Namespace) -> str:
    return _read(args.files[0], "FILE").decode("ascii", "replace").strip()


def _issuer(args: argparse.Namespace, token: str, report: Report) -> str:
    if args.issuer or args.kind in DEFAULT_ISSUERS:
        return str(args.issuer or DEFAULT_ISSUERS[args.kind])
    report.skipped.append("issuer")
    return gca.unverified_issuer(token) or ""


def _eat_nonce(args: argparse.Namespace, token_claims: dict[str, Any], report: Report) -> None:
    if args.nonce is None:
        report.skipped.append("nonce")
        return
    values = binding.eat_nonce_values(token_claims.get("eat_nonce"))
    if args.nonce not in values:
        raise AttestationError("eat_nonce does not contain --nonce", code=ErrorCode.NONCE_MISMATCH)


def _gca(args: argparse.Namespace, report: Report) -> None:
    token = _token(args)
    trust = gca.GcaTrust(
        issuer=_issuer(args, token, report),
        algorithms=("RS256",),
        keys=_keys(args) if args.jwks else None,
        roots=_roots(args),
    )
    verified = gca.verify_gca_token(token, trust=trust, audience=args.audience, now=report.at)
    if args.audience is None:
        report.skipped.append("audience")
    _eat_nonce(args, dict(verified.claims), report)
    report.fragment = {
        "token_type": verified.token_type,
        "tee": claims.gca_tee(verified),
        "claims": {"gca": dict(verified.claims)},
    }


def _ita(args: argparse.Namespace, report: Report) -> None:
    token = _token(args)
    trust = ita.ItaTrust(
        issuer=_issuer(args, token, report),
        algorithms=ita.ITA_ALGORITHMS,
        keys=_keys(args),
        roots=_roots(args),
    )
    verified = ita.verify_ita_token(token, trust=trust, audience=args.audience, now=report.at)
    token_claims = dict(verified.claims)
    if "aud" in token_claims and args.audience is None:
        report.skipped.append("audience")
    if "eat_nonce" in token_claims:
        _eat_nonce(args, token_claims, report)
    else:
        held = ita.held_data(token_claims)
        ita.check_report_data(token_claims, held)
        if args.nonce is None:
            report.skipped.append("nonce (held data)")
        elif held != bytes.fromhex(args.nonce):
            raise AttestationError("held data differs from --nonce", code=ErrorCode.NONCE_MISMATCH)
    report.fragment = {"tee": claims.ita_tee(verified), "claims": {"ita": token_claims}}


def _nras(args: argparse.Namespace, report: Report) -> None:
    unverified = json.loads(_read(args.files[0], "FILE"))
    trust = nras.NrasTrust(
        issuer=_issuer(args, "", report),
        algorithms=nras.NRAS_ALGORITHMS,
        keys=_keys(args),
        anchors=_roots(args),
    )
    nonce = _hex_nonce(args, report)
    result = nras.verify_nras(unverified, trust=trust, expected_nonce=nonce, now=report.at)
    report.fragment = {
        "gpus": claims.nras_gpu_entries(result, cc_mode="unknown"),
        "claims": {
            "nras": {
                "overall": dict(result.overall),
                "gpus": {k: dict(v) for k, v in result.gpus.items()},
            }
        },
    }


def _nvidia(args: argparse.Namespace, report: Report) -> None:
    arch, items = _local_items(args)
    nonce = _hex_nonce(args, report)
    entries = []
    for index, item in enumerate(items):
        verified = local.verify_gpu_report(
            item, arch=arch, device_roots=_roots(args), expected_nonce=nonce, now=report.at
        )
        measurements, problems = _compare(args, verified, report)
        entries.append(
            claims.local_gpu_entry(
                index,
                verified,
                measurements=measurements,
                problems=problems,
                ocsp="unknown",
                cc_mode="unknown",
            )
        )
    report.skipped.append("ocsp")
    report.fragment = {"gpus": entries}


def _local_items(args: argparse.Namespace) -> tuple[str, Sequence[local.GpuEvidence]]:
    data = _read(args.files[0], "FILE")
    if data.lstrip().startswith(b"{"):
        return local.parse_local_evidence(json.loads(data))
    if args.chain is None:
        raise ConfigError("--chain", "a raw report needs its certificate chain")
    try:
        report = bytes.fromhex(data.decode("ascii").strip())
    except ValueError as exc:
        raise ConfigError("FILE", "a raw report must be hex text") from exc
    return args.arch, [local.GpuEvidence(report=report, chain_pem=_read(args.chain, "--chain"))]


def _compare(
    args: argparse.Namespace, verified: local.VerifiedGpuReport, report: Report
) -> tuple[str, list[str]]:
    if not args.rim:
        report.skipped.append("measurements (no --rim)")
        return "unverified", ["no RIMs given"]
    roots = x509.load_pem_x509_certificates(_read(args.rim_root, "--rim-root"))
    rims = [rim.verify_rim(_read(p, "--rim"), roots=roots, now=report.at) for p in args.rim]
    if len(rims) != 2:
        raise ConfigError("--rim", "give the driver RIM and the VBIOS RIM")
    driver, vbios = sorted(rims, key=lambda r: r.version != verified.report.driver_version)
    comparison = local.compare_measurements(verified.report, driver, vbios)
    return comparison.result, list(comparison.problems)


def _hex_nonce(args: argparse.Namespace, report: Report) -> bytes | None:
    if args.nonce is None:
        report.skipped.append("nonce")
        return None
    try:
        return bytes.fromhex(args.nonce)
    except ValueError as exc:
        raise ConfigError("--nonce", "must be hex") from exc
