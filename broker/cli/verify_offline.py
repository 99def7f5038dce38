"""``broker verify``: verify one piece of evidence offline, for security teams and auditors.

It runs the service's own pipeline (``attestation.pipeline.verify_evidence``) with trust
material from files (defaults from ``certs/``) instead of the network, and the time from
``--at`` (default: now). Checks whose inputs are not given (audience, nonce, runner-key
binding, OCSP) are skipped and listed under ``"skipped"`` in the output.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import x509

from broker.attestation import pipeline
from broker.attestation.issuers import DEFAULT_ALGORITHMS, IssuerSettings
from broker.attestation.nvidia import local
from broker.attestation.pipeline import Binding, IssuerTrust, Material, Trust
from broker.cli import verify_snp, verify_tdx
from broker.core.errors import AttestationError, ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.crypto import jose
from broker.crypto.jwks import JwksError, TrustedKeySet, parse_jwks

# certs/ of the repository, installed with the package (pyproject: package-data)
CERTS = Path(__file__).resolve().parents[1] / "shipped" / "certs"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["gca", "ita", "nras", "nvidia", "broker", "tdx", "snp"])
    parser.add_argument(
        "files",
        nargs="+",
        help="gca/ita: token; nras: NRAS result JSON; nvidia: report (hex) or evidence JSON; "
        "broker: the broker's https:// URL (its self-attestation is checked over the network); "
        "tdx: a quote (raw, hex, or a guest's evidence JSON)",
    )
    verify_tdx.add_arguments(parser)
    parser.add_argument("--at", help="verification time, RFC 3339 (default: now)")
    parser.add_argument("--jwks", type=Path, help="key set (gca OIDC, ita, nras)")
    parser.add_argument("--root", type=Path, help="trust anchor PEM (default: certs/)")
    parser.add_argument("--chain", type=Path, help="nvidia: the GPU certificate chain (PEM)")
    parser.add_argument(
        "--rim",
        action="extend",
        nargs="+",
        default=[],
        metavar="[ID=]FILE",
        help="nvidia: RIM files, repeatable (--rim A --rim B or --rim A B); a RIM serves the "
        "id named before '=', else its file name without .swidtag (as in [nvidia] rim_dir)",
    )
    parser.add_argument("--rim-dir", type=Path, help="nvidia: a directory of <RIM id>.swidtag")
    parser.add_argument("--rim-root", type=Path, default=DEFAULT_RIM_ROOT)
    parser.add_argument(
        "--arch",
        choices=sorted(local.ARCHES),
        help="nvidia raw report: the declared architecture (default: inferred from the chain)",
    )
    parser.add_argument(
        "--nonce",
        help="the broker nonce; with --thumbprint every binding check of a release is made. "
        "Alone: gca/ita: a value eat_nonce must contain (ita held data: hex); "
        "nras/nvidia: the GPU nonce in hex",
    )
    parser.add_argument("--thumbprint", help="the runner key's RFC 7638 thumbprint")
    parser.add_argument("--audience", help="the audience the token must carry")
    parser.add_argument("--issuer", help="the issuer the token must name (default per kind)")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="sha256:DIGEST",
        help="broker: an allowed broker image digest, repeatable",
    )
    parser.add_argument("--ca", type=Path, help="broker: CA certificates (PEM) for its TLS")
    parser.add_argument(
        "--tls-trust",
        dest="tls_trust",
        choices=("ca", "attestation"),
        default="ca",
        help="broker: trust its TLS certificate through a CA (default) or only through the "
        "attestation that binds its key (a sealed broker's own, self-signed certificate)",
    )
    verify_snp.add_arguments(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Verify with the service's pipeline and return the printable report.

    Raises:
        AttestationError: the evidence does not verify.
        InputError: the evidence has the wrong shape.
        ConfigError: a trust file is missing or unusable, or an argument is malformed.
    """
    at = _time(args.at)
    if args.kind == "tdx":
        return verify_tdx.run(args, at)
    if args.kind == "snp":
        return verify_snp.run(args, at)
    evidence = {args.kind: _evidence(args)}
    issuer = _issuer_trust(args, evidence)
    trust = Trust(
        issuers={issuer.settings.issuer: issuer} if issuer else {},
        audience=args.audience,
        device_roots=_pem(args.root or DEFAULT_ROOTS["nvidia"], "--root")
        if args.kind == "nvidia"
        else (),
        rim_roots=_pem(args.rim_root, "--rim-root") if args.kind == "nvidia" else (),
        local_gpu=args.kind == "nvidia",
    )
    verified = pipeline.verify_evidence(
        evidence,
        trust,
        _material(args, issuer, evidence, trust),
        bound_to=_binding(args),
        now=at,
        require_cpu=False,
    )
    skipped = list(verified.skipped)
    if args.kind == "nvidia":
        skipped.append("ocsp")
    fragment: dict[str, Any] = {"kind": args.kind, "verified_at": at.isoformat()}
    if verified.tee:
        fragment["tee"] = verified.tee
        if args.kind == "gca":
            fragment["token_type"] = "pki" if _is_pki(evidence["gca"]) else "oidc"
    if verified.gpus:
        fragment["gpus"] = list(verified.gpus)
    fragment["claims"] = dict(verified.raw_claims)
    fragment["skipped"] = _unique(skipped)
    return fragment


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


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


def _pem(path: Path, what: str) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(_read(path, what))
    except ValueError as exc:
        raise ConfigError(what, f"{path} is not PEM") from exc


def _json(data: bytes, what: str) -> Any:
    try:
        return loads_bounded(data)
    except ValueError as exc:
        raise ConfigError(what, "not JSON") from exc


def _evidence(args: argparse.Namespace) -> Any:
    data = _read(Path(args.files[0]), "FILE")
    if args.kind in ("gca", "ita"):
        return data.decode("ascii", "replace").strip()
    if args.kind == "nras":
        return _json(data, "FILE")
    if data.lstrip().startswith(b"{"):
        return _json(data, "FILE")
    if args.chain is None:
        raise ConfigError("--chain", "a raw report needs its certificate chain")
    try:
        report = bytes.fromhex(data.decode("ascii").strip())
    except ValueError as exc:
        raise ConfigError("FILE", "a raw report must be hex text") from exc
    import base64  # noqa: PLC0415 - only this branch re-encodes

    item = {
        "evidence": base64.b64encode(report).decode(),
        "certificate": base64.b64encode(_read(args.chain, "--chain")).decode(),
    }
    return {"evidence_list": [item], **({"arch": args.arch} if args.arch else {})}


def _issuer_trust(args: argparse.Namespace, evidence: dict[str, Any]) -> IssuerTrust | None:
    """The issuer entry the service would have for this token, from the arguments."""
    kind = args.kind
    if kind == "nvidia":
        return None
    token = evidence[kind] if kind != "nras" else ""
    name = args.issuer or DEFAULT_ISSUERS.get(kind) or jose.unverified_claim(token, "iss") or ""
    pki = kind == "gca" and _is_pki(token)
    settings = IssuerSettings(
        kind=kind,
        issuer=name,
        algorithms=DEFAULT_ALGORITHMS[kind],
        token_types=(("pki",) if pki else ("oidc",)),
        tolerated_jku=("https://portal.trustauthority.intel.com/certs",) if kind == "ita" else (),
    )
    roots = _pem(args.root or DEFAULT_ROOTS[kind], "--root") if kind != "gca" or pki else []
    return IssuerTrust(settings=settings, roots=roots)


def _is_pki(token: Any) -> bool:
    try:
        return "x5c" in jose.parse_header(str(token), DEFAULT_ALGORITHMS["gca"]).fields
    except AttestationError:  # the pipeline reports the header's problem itself
        return False


def _material(
    args: argparse.Namespace,
    issuer: IssuerTrust | None,
    evidence: dict[str, Any],
    trust: Trust,
) -> Material:
    key_sets: dict[str, TrustedKeySet] = {}
    if issuer is not None and issuer.settings.uses_jwks:
        key_sets[issuer.settings.issuer] = _keys(args)
    if args.kind != "nvidia":
        return Material(key_sets=key_sets)
    needs = pipeline.requirements(evidence, trust, require_cpu=False)
    rims: dict[str, bytes] = {}
    problems: dict[str, str] = {}
    offered = _offered_rims(args)
    for rim_id in needs.rim_ids:
        if rim_id in offered:
            rims[rim_id] = _read(offered[rim_id], "--rim")
        else:
            problems[rim_id] = "not given (--rim or --rim-dir)"
    return Material(key_sets=key_sets, rims=rims, rim_problems=problems)


def _offered_rims(args: argparse.Namespace) -> dict[str, Path]:
    offered: dict[str, Path] = {}
    if args.rim_dir is not None:
        offered.update({p.stem: p for p in sorted(args.rim_dir.glob("*.swidtag"))})
    for text in args.rim:
        rim_id, equals, path = str(text).partition("=")
        file = Path(path if equals else rim_id)
        offered[rim_id if equals else file.name.removesuffix(".swidtag")] = file
    return offered


def _keys(args: argparse.Namespace) -> TrustedKeySet:
    if args.jwks is None:
        raise ConfigError("--jwks", f"{args.kind} verification needs the issuer's key set")
    try:
        return parse_jwks(_read(args.jwks, "--jwks"))
    except JwksError as exc:
        raise ConfigError("--jwks", str(exc)) from exc


def _binding(args: argparse.Namespace) -> Binding:
    if args.kind in ("nras", "nvidia") and args.thumbprint is None and args.nonce is not None:
        try:
            return Binding(gpu_nonce=bytes.fromhex(args.nonce))
        except ValueError as exc:
            raise ConfigError("--nonce", "must be hex") from exc
    return replace(Binding(), nonce=args.nonce, thumbprint=args.thumbprint)
