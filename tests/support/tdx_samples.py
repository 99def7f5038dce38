"""The public TDX samples (tests/fixtures/raw/tdx/, PROVENANCE.md there) and the pinned root."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509

from broker.attestation.raw.tdx import TdxTrust
from broker.attestation.raw.tdx_collateral import TdxCollateral, parse_collateral_json

TDX_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "raw" / "tdx"
INTEL_SGX_ROOT = Path(__file__).resolve().parents[2] / "certs" / "intel_sgx_root_ca.pem"
INTEL_TRUST = TdxTrust(root=x509.load_pem_x509_certificate(INTEL_SGX_ROOT.read_bytes()))
# times inside each sample's collateral window (PROVENANCE.md)
V4_INSIDE = datetime(2025, 7, 1, tzinfo=UTC)
V5_INSIDE = datetime(2026, 3, 1, tzinfo=UTC)


def sample(name: str) -> tuple[bytes, TdxCollateral]:
    """``tdx_quote`` or ``tdx_quote_outdated`` with its collateral."""
    quote = (TDX_FIXTURES / name).read_bytes()
    collateral = parse_collateral_json((TDX_FIXTURES / f"{name}_collateral.json").read_bytes())
    return quote, collateral
