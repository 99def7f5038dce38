"""Hardware evidence through the KBS facade (issue 33): a TDX guest and an SEV-SNP guest, as
guest-components' attesters send their evidence, fetch their key from a live broker whose
verifiers pin a test PKI (``tests/support/tdx_forge.py``, ``tests/support/snp.py``: Intel and AMD
sign no quote over a test's report data) — the verifiers the facade registers from ``[tdx]`` and
``[snp]``, the report data bound to the guest's key and nonce, the policy on the measurements in
``kbs_guests``. Evidence over another nonce, and a debug TD, are refused with a record."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from broker.attestation.raw.snp_report import Tcb
from broker.keys.factory import open_key_service
from tests.integration.kbs import RESOURCE, guest, kbs_broker
from tests.support.constants import KEY
from tests.support.kbs_client import Guest, open_as_guest, report_data
from tests.support.snp import AT, fake_amd, milan_report, patched, serde_object, signed
from tests.support.tdx_forge import (
    DEBUG_TD,
    NEXT_UPDATE,
    QuoteSpec,
    forge_collateral,
    forge_pki,
    forge_quote,
)

MRTD = bytes(range(48))
TDX_PKI = forge_pki()  # one test PKI: the pinned root, the collateral and the quotes agree
MILAN_TCB = Tcb(bootloader=3, tee=0, snp=8, microcode=115, fmc=None)  # virtee's report


@dataclass(frozen=True)
class Hardware:
    tee: str
    toml: str
    at: datetime
    reference: dict[str, Any]
    files: Callable[[Path], None]
    evidence: Callable[[bytes], dict[str, Any]]


def _tdx_files(workdir: Path) -> None:
    pki = TDX_PKI
    (workdir / "tdx").mkdir()
    (workdir / "tdx" / "root.pem").write_bytes(pki.root_pem)
    (workdir / "tdx" / "collateral.json").write_text(json.dumps(forge_collateral(pki)))


def _tdx_evidence(data: bytes, **spec: Any) -> dict[str, Any]:
    quote = forge_quote(TDX_PKI, QuoteSpec(report_data=data, mrtd=MRTD, **spec))
    return {"cc_eventlog": None, "quote": base64.b64encode(quote).decode()}


def _snp_files(workdir: Path) -> None:
    ark = fake_amd("Milan").ark.public_bytes(serialization.Encoding.PEM)
    (workdir / "snp").mkdir()
    (workdir / "snp" / "roots.pem").write_bytes(ark)


def _snp_evidence(data: bytes) -> dict[str, Any]:
    amd = fake_amd("Milan")
    raw = milan_report()
    vcek, key = amd.vcek(MILAN_TCB, raw[0x1A0:0x1E0])
    report = signed(patched(raw, 0x50, data), key)
    der = serialization.Encoding.DER
    return {
        "attestation_report": serde_object(report, "Milan"),
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
        files=_tdx_files,
        evidence=_tdx_evidence,
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
        evidence=_snp_evidence,
    ),
}


def _set_up(hardware: Hardware) -> Callable[[Path], None]:
    def set_up(workdir: Path) -> None:
        hardware.files(workdir)
        data_file = workdir / "policies" / "broker" / "data.json"
        data = json.loads(data_file.read_text(encoding="utf-8"))
        data["kbs_guests"] = {KEY: [hardware.reference]}
        data_file.write_text(json.dumps(data), encoding="utf-8")

    return set_up


def _attestation(one: Guest, evidence: dict[str, Any]) -> dict[str, Any]:
    body = one.attestation()
    body["tee-evidence"]["primary_evidence"] = evidence
    return body


@pytest.mark.parametrize("tee", sorted(HARDWARE))
async def test_a_hardware_guest_fetches_its_key(start_broker: Callable[..., Any], tee: str) -> None:
    hardware = HARDWARE[tee]
    broker = await kbs_broker(
        start_broker,
        extra_toml=hardware.toml,
        workdir_setup=_set_up(hardware),
        clock=lambda: hardware.at,  # inside the test PKI's collateral and certificates
        environ={"BROKER_KBS_ALLOW_SAMPLE_EVIDENCE": "false"},
    )
    async with open_key_service(broker.settings.keys) as keys:
        dek = await keys.unwrap(await keys.resolve(KEY, None))
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        status, body = await one.auth(session, tee=tee)
        assert status == 200, body
        other_nonce = hardware.evidence(report_data(one.tee_pubkey, "another nonce"))
        status, body = await one.attest(session, _attestation(one, other_nonce))
        assert (status, broker.records()[-1]["code"]) == (401, "kbs_report_data_mismatch")
        bound = hardware.evidence(report_data(one.tee_pubkey, one.nonce or ""))
        status, body = await one.attest(session, _attestation(one, bound))
        assert status == 200, body
        status, answer, _ = await one.resource(session, RESOURCE)
    assert status == 200, answer
    assert open_as_guest(answer, one.private) == dek
    attest = next(r for r in reversed(broker.records()) if r["type"] == "kbs_attest")
    assert attest["result"] == "allow"
    assert attest["input"]["tee"]["technology"] == hardware.reference["technology"]
    assert attest["input"]["claims"]["kbs"]["tee"] == tee
    expires = jwt.decode(one.token or "", options={"verify_signature": False})["exp"]
    if tee == "tdx":  # never past the collateral it was judged with (its nextUpdate)
        assert expires == int(NEXT_UPDATE.timestamp())
    else:
        assert expires == int(hardware.at.timestamp()) + 300


async def test_a_debug_td_is_refused(start_broker: Callable[..., Any]) -> None:
    hardware = HARDWARE["tdx"]
    broker = await kbs_broker(
        start_broker,
        extra_toml=hardware.toml,
        workdir_setup=_set_up(hardware),
        clock=lambda: hardware.at,
    )
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.auth(session, tee="tdx")
        debug = _tdx_evidence(report_data(one.tee_pubkey, one.nonce or ""), td_attributes=DEBUG_TD)
        status, _ = await one.attest(session, _attestation(one, debug))
    record = broker.records()[-1]
    assert (status, record["type"], record["result"]) == (401, "kbs_attest", "deny")
    assert record["code"] == "tdx_td_attributes_refused", record
