"""``broker verify tdx QUOTE --collateral FILE [--at TIME] [--root PEM]``: one TDX quote checked
offline by the service's own verifier (``attestation/raw/tdx.py``) against collateral from a
file (``dcap-qvl``'s collateral JSON, as ``[tdx] collateral_dir`` holds it).

QUOTE is the raw quote, the quote in hex, or a guest's evidence object (``{"quote": base64,
"cc_eventlog": …}``, the KBS ``primary_evidence`` for ``tdx``). The report data binding (the
KBS facade's hash of the guest's key and nonce) is not checked here: it is listed under
``skipped`` and the report data is printed for comparison.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path
from typing import Any

from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded

DEFAULT_ROOT = Path(__file__).resolve().parents[1] / "shipped" / "certs" / "intel_sgx_root_ca.pem"
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--collateral",
        type=Path,
        help="tdx: DCAP collateral, dcap-qvl's JSON form (root and PCK CRLs, TCB info, QE "
        "identity and their issuer chains)",
    )


def run(args: argparse.Namespace, at: datetime) -> dict[str, Any]:
    """Verify ``args.files[0]`` against ``args.collateral`` at ``at``.

    Raises:
        AttestationError: the quote does not verify (its code).
        ConfigError: a file is missing or unusable.
    """
    # dcap-qvl loads only on this path (the other kinds start without it)
    from broker.attestation.raw.tdx import verify_tdx_quote  # noqa: PLC0415
    from broker.attestation.raw.tdx_collateral import parse_collateral_json  # noqa: PLC0415
    from broker.attestation.raw.tdx_sources import load_tdx_trust  # noqa: PLC0415

    if args.collateral is None:
        raise ConfigError("--collateral", "tdx verification needs the DCAP collateral")
    quote = _quote(_read(Path(args.files[0]), "QUOTE"))
    collateral = parse_collateral_json(_read(args.collateral, "--collateral"))
    trust = load_tdx_trust(args.root or DEFAULT_ROOT)
    verified = verify_tdx_quote(quote, collateral, trust=trust, now=at)
    return {
        "kind": "tdx",
        "verified_at": at.isoformat(),
        "tee": dict(verified.tee),
        "report_data": verified.report_data.hex(),
        "claims": dict(verified.claims),
        "skipped": ["report data binding"],
    }


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(what, f"cannot read {path}") from exc


def _quote(data: bytes) -> bytes:
    text = data.strip()
    if text.startswith(b"{"):
        try:
            document = loads_bounded(text)
        except ValueError as exc:
            raise ConfigError("QUOTE", "starts like JSON but is not JSON") from exc
        from broker.attestation.raw.tdx_guest import parse_tdx_evidence  # noqa: PLC0415

        return parse_tdx_evidence(document).quote
    if text and set(text) <= HEX_DIGITS and len(text) % 2 == 0:
        return bytes.fromhex(text.decode("ascii"))
    return data
