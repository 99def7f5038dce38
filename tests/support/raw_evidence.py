"""Raw hardware evidence as Confidential Containers guests' attesters send it, under test PKIs:
a TDX quote (``tdx_forge``'s PKI) and a Milan SEV-SNP report with its VCEK (``snp``'s fake AMD),
over chosen report data and launch fields. Intel and AMD sign nothing for a test, so a broker
verifies these only when it pins the test roots (``tests/integration/kbs_raw.py``)."""

from __future__ import annotations

import base64
from typing import Any

from cryptography.hazmat.primitives import serialization

from broker.attestation.raw.snp_report import Tcb, encode_tcb
from tests.support.snp import fake_amd, milan_report, patched, serde_object, signed
from tests.support.tdx_forge import QuoteSpec, forge_pki, forge_quote

MRTD = bytes(range(48))
TDX_PKI = forge_pki()  # one test PKI: the pinned root, the collateral and the quotes agree
# A Milan TCB at the shipped minimum (policies/broker/data.json kbs_snp_min_tcb), and the one
# of virtee's report, below it
CURRENT_MILAN_TCB = Tcb(bootloader=4, tee=0, snp=22, microcode=219, fmc=None)
OLD_MILAN_TCB = Tcb(bootloader=3, tee=0, snp=8, microcode=115, fmc=None)
REPORTED_TCB, HOST_DATA, REPORT_DATA = 0x180, 0x0C0, 0x050  # SNP report offsets (ABI Table 23)


def tdx_evidence(data: bytes, *, mrconfigid: bytes = bytes(48), **spec: Any) -> dict[str, Any]:
    """The TDX attester's evidence: a quote over ``data``, ``mrconfigid`` set at launch."""
    quote = forge_quote(
        TDX_PKI, QuoteSpec(report_data=data, mrtd=MRTD, mrconfigid=mrconfigid, **spec)
    )
    return {"cc_eventlog": None, "quote": base64.b64encode(quote).decode()}


def snp_evidence(
    data: bytes, *, host_data: bytes = bytes(32), tcb: Tcb = CURRENT_MILAN_TCB
) -> dict[str, Any]:
    """The SNP attester's evidence: a Milan report over ``data`` reporting ``tcb``, with
    ``host_data`` set at launch, and its VCEK (certified for ``tcb``) with the ASK."""
    amd = fake_amd("Milan")
    raw = patched(milan_report(), REPORTED_TCB, encode_tcb(tcb, "Milan"))
    raw = patched(patched(raw, HOST_DATA, host_data), REPORT_DATA, data)
    vcek, key = amd.vcek(tcb, raw[0x1A0:0x1E0])
    der = serialization.Encoding.DER
    return {
        "attestation_report": serde_object(signed(raw, key), "Milan"),
        "cert_chain": [
            {"cert_type": "ASK", "data": list(amd.ask.public_bytes(der))},
            {"cert_type": "VCEK", "data": list(vcek.public_bytes(der))},
        ],
    }
