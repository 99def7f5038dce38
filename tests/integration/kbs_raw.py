"""What the facade's hardware-evidence tests share (issue 33): a TDX guest and an SEV-SNP guest
as guest-components' attesters send their evidence, under test PKIs the broker is configured to
pin (``tests/support/tdx_forge.py``, ``tests/support/snp.py``: Intel and AMD sign no quote over
a test's report data), and a broker whose policy data knows each by its measurements.

The SNP guest reports a current Milan TCB (the shipped ``kbs_snp_min_tcb``), the TDX platform is
``UpToDate`` unless a test forges other collateral (``tdx_collateral``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from tests.integration.conftest import RunningBroker
from tests.integration.kbs import kbs_broker
from tests.support.constants import KEY
from tests.support.kbs_client import Guest
from tests.support.raw_evidence import MRTD, TDX_PKI, snp_evidence, tdx_evidence
from tests.support.snp import AT, fake_amd, milan_report
from tests.support.tdx_forge import NEXT_UPDATE, CollateralSpec, forge_collateral


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


def _snp_files(workdir: Path) -> None:
    ark = fake_amd("Milan").ark.public_bytes(serialization.Encoding.PEM)
    (workdir / "snp").mkdir()
    (workdir / "snp" / "roots.pem").write_bytes(ark)


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
