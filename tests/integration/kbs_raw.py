"""What the facade's hardware-evidence tests share (issue 33): a TDX guest and an SEV-SNP guest
as guest-components' attesters send their evidence, under test PKIs the broker is configured to
pin (``tests/support/tdx_forge.py``, ``tests/support/snp.py``: Intel and AMD sign no quote over
a test's report data), and a broker whose policy data knows each by its measurements.

The SNP guest reports a current Milan TCB (the shipped ``kbs_snp_min_tcb``), the TDX platform is
``UpToDate`` unless a test forges other collateral (``tdx_collateral``)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from broker.attestation.raw.snp_report import Tcb, encode_tcb
from tests.integration.conftest import RunningBroker
from tests.integration.kbs import kbs_broker
from tests.support.constants import KEY
from tests.support.kbs_client import Guest
from tests.support.snp import AT, fake_amd, milan_report, patched, serde_object, signed
from tests.support.tdx_forge import (
    NEXT_UPDATE,
    CollateralSpec,
    QuoteSpec,
    forge_collateral,
    forge_pki,
    forge_quote,
)

MRTD = bytes(range(48))
TDX_PKI = forge_pki()  # one test PKI: the pinned root, the collateral and the quotes agree
# A Milan TCB at the shipped minimum (policies/broker/data.json kbs_snp_min_tcb), and the one
# of virtee's report, below it
CURRENT_MILAN_TCB = Tcb(bootloader=4, tee=0, snp=22, microcode=219, fmc=None)
OLD_MILAN_TCB = Tcb(bootloader=3, tee=0, snp=8, microcode=115, fmc=None)
REPORTED_TCB, HOST_DATA, REPORT_DATA = 0x180, 0x0C0, 0x050  # SNP report offsets (ABI Table 23)


@dataclass(frozen=True)
class Hardware:
    tee: str
    toml: str
    at: datetime
    reference: dict[str, Any]
    files: Callable[[Path], None]
    evidence: Callable[..., dict[str, Any]]  # (report data, **launch fields) -> evidence


UP_TO_DATE = CollateralSpec()


def tdx_collateral(spec: CollateralSpec = UP_TO_DATE) -> Callable[[Path], None]:
    """The ``[tdx]`` files: the pinned root and collateral forged to ``spec``."""

    def files(workdir: Path) -> None:
        (workdir / "tdx").mkdir(exist_ok=True)
        (workdir / "tdx" / "root.pem").write_bytes(TDX_PKI.root_pem)
        collateral = forge_collateral(TDX_PKI, spec)
        (workdir / "tdx" / "collateral.json").write_text(json.dumps(collateral))

    return files


def tdx_evidence(data: bytes, *, mrconfigid: bytes = bytes(48), **spec: Any) -> dict[str, Any]:
    """The TDX attester's evidence: a quote over ``data``, ``mrconfigid`` set at launch."""
    quote = forge_quote(
        TDX_PKI, QuoteSpec(report_data=data, mrtd=MRTD, mrconfigid=mrconfigid, **spec)
    )
    return {"cc_eventlog": None, "quote": base64.b64encode(quote).decode()}


def _snp_files(workdir: Path) -> None:
    ark = fake_amd("Milan").ark.public_bytes(serialization.Encoding.PEM)
    (workdir / "snp").mkdir()
    (workdir / "snp" / "roots.pem").write_bytes(ark)


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


HARDWARE = {
    "tdx": Hardware(
        tee="tdx",
        toml='\n[tdx]\ncollateral_dir = "tdx"\nroot_certificate = "tdx/root.pem"\n',
        at=NEXT_UPDATE - timedelta(seconds=60),  # the collateral expires within the token's TTL
        reference={"technology": "tdx", "measurements": {"mrtd": MRTD.hex()}},
        files=tdx_collateral(),
        evidence=tdx_evidence,
    ),
    "snp": Hardware(
        tee="snp",
        toml='\n[snp]\nroots = "snp/roots.pem"\n',
        at=AT,
        reference={
            "technology": "sev-snp",
            "measurements": {"measurement": milan_report()[0x90:0xC0].hex()},
        },
        files=_snp_files,
        evidence=snp_evidence,
    ),
}


def hardware_setup(
    hardware: Hardware,
    reference: dict[str, Any] | None = None,
    files: Callable[[Path], None] | None = None,
) -> Callable[[Path], None]:
    """The workspace: ``hardware``'s files (or ``files``), and the policy's data allowing
    ``reference`` (``hardware.reference`` unless given) the test key."""

    def set_up(workdir: Path) -> None:
        (files or hardware.files)(workdir)
        data_file = workdir / "policies" / "broker" / "data.json"
        data = json.loads(data_file.read_text(encoding="utf-8"))
        data["kbs_guests"] = {KEY: [reference or hardware.reference]}
        data_file.write_text(json.dumps(data), encoding="utf-8")

    return set_up


async def hardware_broker(
    start_broker: Callable[..., Any], hardware: Hardware, **kwargs: Any
) -> RunningBroker:
    """A broker whose ``hardware.tee`` verifier pins the test PKI, at ``hardware.at`` (inside
    the PKI's collateral and certificates), the sample switch off; ``reference``/``files``
    as ``hardware_setup``'s."""
    setup = hardware_setup(hardware, kwargs.pop("reference", None), kwargs.pop("files", None))
    return await kbs_broker(
        start_broker,
        extra_toml=hardware.toml,
        workdir_setup=setup,
        clock=kwargs.pop("clock", lambda: hardware.at),
        environ={"BROKER_KBS_ALLOW_SAMPLE_EVIDENCE": "false", **kwargs.pop("environ", {})},
        **kwargs,
    )


def attestation(one: Guest, evidence: dict[str, Any], **members: Any) -> dict[str, Any]:
    """``one``'s ``Attestation`` with ``evidence`` as its primary evidence (and ``init-data``,
    ``additional_evidence`` when given)."""
    body = one.attestation()
    body["tee-evidence"]["primary_evidence"] = evidence
    if "additional" in members:
        body["tee-evidence"]["additional_evidence"] = members["additional"]
    if "init_data" in members:
        body["init-data"] = {"format": "toml", "body": members["init_data"]}
    return body
