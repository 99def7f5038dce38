"""Every single-bit mutation of what is signed in a TDX quote is refused (issue 33).

The public v4 sample, at a time inside its collateral's window: each bit of the header and TD
report (signed by the attestation key), of the quote signature and the attestation key, of the
QE report (signed by the PCK key), its signature and the QE authentication data (committed to by
the QE report) is flipped in turn, and every one of those quotes must be refused. A forged v5
quote (TDREPORT 1.5) gets the same for its header, body-type fields and body.

The broker's own collateral-free authentication refuses almost all of them (a signature fails);
``dcap-qvl`` alone is then shown to refuse every bit of MRTD, the RTMRs and the report data too.
Measured on the shared 2-core machine: the 15,552 mutants of the first two tests in 7.5-10 s,
the 2,432 of the dcap-only test in 2-4 s (an unmutated quote verifies in ~1.9 ms: the broker's
authentication 0.6 ms, dcap-qvl 0.7 ms).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

from broker.attestation.raw.tdx import TdxTrust, verify_tdx_quote
from broker.attestation.raw.tdx_collateral import TdxCollateral, parse_collateral_json
from broker.attestation.raw.tdx_dcap import dcap_verify
from broker.attestation.raw.tdx_quote import HEADER_BYTES, TD10_FIELDS, parse_quote
from broker.core.errors import AttestationError, ErrorCode
from tests.support.tdx_forge import INSIDE, QuoteSpec, forge_collateral, forge_pki, forge_quote
from tests.support.tdx_samples import INTEL_TRUST, V4_INSIDE, sample

REFUSALS = {
    ErrorCode.TDX_QUOTE_MALFORMED,  # header fields, sizes
    ErrorCode.TDX_QUOTE_INVALID,  # a signature or the QE commitment
    ErrorCode.CERT_CHAIN_INVALID,  # none expected: the chain is not in these regions
}


def flips(raw: bytes, start: int, end: int) -> Iterator[bytes]:
    for bit in range(start * 8, end * 8):
        mutant = bytearray(raw)
        mutant[bit // 8] ^= 1 << (bit % 8)
        yield bytes(mutant)


def refusals(
    raw: bytes,
    regions: list[tuple[int, int]],
    collateral: TdxCollateral,
    trust: TdxTrust,
    now: object,
) -> Counter[ErrorCode]:
    seen: Counter[ErrorCode] = Counter()
    accepted = []
    for start, end in regions:
        for mutant in flips(raw, start, end):
            try:
                verify_tdx_quote(mutant, collateral, trust=trust, now=now)  # type: ignore[arg-type]
            except AttestationError as exc:
                seen[exc.code] += 1
            else:
                accepted.append(mutant)
    assert accepted == [], f"{len(accepted)} mutants verified"
    return seen


def test_every_bit_of_the_signed_regions_of_the_v4_sample() -> None:
    raw, collateral = sample("tdx_quote")
    verify_tdx_quote(raw, collateral, trust=INTEL_TRUST, now=V4_INSIDE)  # the original passes
    quote = parse_quote(raw)
    signed = len(quote.signed)  # 632: header 48 + TDREPORT 1.0 584
    signature_data = signed + 4
    qe = quote.qe_report_offset
    regions = [
        (0, signed),
        (signature_data, signature_data + 128),  # quote signature, attestation key
        (qe, qe + 384 + 64 + 2 + 32),  # QE report, its signature, auth data size and bytes
    ]
    seen = refusals(raw, regions, collateral, INTEL_TRUST, V4_INSIDE)
    assert sum(seen.values()) == 8 * sum(end - start for start, end in regions) == 8 * 1242
    assert set(seen) <= REFUSALS, seen
    assert seen[ErrorCode.TDX_QUOTE_INVALID] > 9000  # the signatures, not the parser, refuse


def test_every_bit_of_a_v5_header_and_body() -> None:
    pki = forge_pki()
    raw = forge_quote(pki, QuoteSpec(version=5, body_type=3))
    document = json.dumps(forge_collateral(pki))
    collateral, trust = parse_collateral_json(document), TdxTrust(pki.root)
    verify_tdx_quote(raw, collateral, trust=trust, now=INSIDE)
    signed = len(parse_quote(raw).signed)  # 48 + 6 + 648
    seen = refusals(raw, [(0, signed)], collateral, trust, INSIDE)
    assert sum(seen.values()) == 8 * 702
    assert set(seen) <= REFUSALS, seen


def test_dcap_qvl_alone_refuses_every_bit_of_the_measurements_and_report_data() -> None:
    raw, collateral = sample("tdx_quote")
    offsets, at = {}, HEADER_BYTES
    for name, size in TD10_FIELDS:
        offsets[name] = (at, at + size)
        at += size
    names = ("mrtd", "rtmr0", "rtmr1", "rtmr2", "rtmr3", "report_data")
    seen: Counter[ErrorCode] = Counter()
    for name in names:
        for mutant in flips(raw, *offsets[name]):
            try:
                dcap_verify(mutant, collateral, INTEL_TRUST.root_der, V4_INSIDE)
            except AttestationError as exc:
                seen[exc.code] += 1
    assert seen == {ErrorCode.TDX_QUOTE_INVALID: 8 * (48 * 5 + 64)}
