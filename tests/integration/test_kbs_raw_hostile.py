"""Hardware evidence the facade must refuse, each with its status, code and record (issue 33
review): a TDX platform Intel rates OutOfDate and an SEV-SNP report below the product's minimum
TCB (policy denies, with the reason), init-data the hardware did not bind, a guest-sent VCEK
whose key algorithm ``cryptography`` does not know (a chain error, not a 500), and collateral
judged at its very ``nextUpdate`` instant (expired, not a 500)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import aiohttp

from tests.integration.kbs import RESOURCE, guest
from tests.integration.kbs_raw import HARDWARE, attestation, hardware_broker, tdx_collateral
from tests.support.kbs_client import ERROR_TYPE, report_data
from tests.support.raw_evidence import OLD_MILAN_TCB
from tests.support.tdx_forge import NEXT_UPDATE, CollateralSpec

EC_PUBLIC_KEY_OID = bytes.fromhex("06072a8648ce3d0201")
UNKNOWN_KEY_OID = bytes.fromhex("06072a8648ce3d0209")


async def test_out_of_date_tdx_platform_gets_no_key(start_broker: Callable[..., Any]) -> None:
    """Intel rates the platform OutOfDate (advisories listed): the shipped policy accepts only
    UpToDate (data.broker.kbs_tcb_statuses), so no token and no key."""
    hardware = HARDWARE["tdx"]
    stale = CollateralSpec(tcb_status="OutOfDate", advisory_ids=("INTEL-SA-01036",))
    broker = await hardware_broker(start_broker, hardware, files=tdx_collateral(stale))
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.auth(session, tee="tdx")
        evidence = hardware.evidence(report_data(one.tee_pubkey, one.nonce or ""))
        status, body = await one.attest(session, attestation(one, evidence))
        assert status == 403, body
        assert body["type"] == ERROR_TYPE + "AttestationError"
        assert "Intel rates the platform's TCB OutOfDate" in body["detail"]
        status, _, _ = await one.resource(session, RESOURCE)
        assert status == 401  # no token was ever signed
    record = next(r for r in reversed(broker.records()) if r["type"] == "kbs_attest")
    assert (record["result"], record["code"]) == ("deny", "policy_denied")
    assert record["input"]["tee"]["tcb_status"] == "OutOfDate"
    assert record["input"]["tee"]["advisory_ids"] == ["INTEL-SA-01036"]
    assert 'accepted: ["UpToDate"]' in " ".join(record["reasons"])


async def test_snp_report_below_the_minimum_tcb_gets_no_key(
    start_broker: Callable[..., Any],
) -> None:
    hardware = HARDWARE["snp"]
    broker = await hardware_broker(start_broker, hardware)
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.auth(session, tee="snp")
        evidence = hardware.evidence(
            report_data(one.tee_pubkey, one.nonce or ""), tcb=OLD_MILAN_TCB
        )
        status, body = await one.attest(session, attestation(one, evidence))
    assert status == 403, body
    record = broker.records()[-1]
    assert (record["type"], record["code"]) == ("kbs_attest", "policy_denied")
    assert record["input"]["tee"]["tcb"]["snp"] == OLD_MILAN_TCB.snp
    assert any(
        "reported TCB" in reason and "below the minimum" in reason for reason in record["reasons"]
    )


async def test_init_data_the_hardware_did_not_bind_is_refused(
    start_broker: Callable[..., Any],
) -> None:
    """The guest says it was launched with this init-data; MRCONFIGID says otherwise (here: no
    init-data at all). Refused with its own code, before the nonce is spent."""
    hardware = HARDWARE["tdx"]
    broker = await hardware_broker(start_broker, hardware)
    one = guest(broker)
    init_data = 'algorithm = "sha384"\nversion = "0.1.0"\n[data]\n"cdh.toml" = "x"\n'
    async with aiohttp.ClientSession() as session:
        await one.auth(session, tee="tdx")
        evidence = hardware.evidence(report_data(one.tee_pubkey, one.nonce or ""))
        answer = await one.call(
            session, "POST", "/attest", attestation(one, evidence, init_data=init_data)
        )
        status, body, headers = answer
        assert (status, headers["Broker-Error-Code"]) == (401, "kbs_init_data_mismatch"), body
        record = broker.records()[-1]
        assert (record["type"], record["code"]) == ("kbs_attest", "kbs_init_data_mismatch")
        assert record["kbs"]["init_data"]["bound_to"] is None
        status, body = await one.attest(session, attestation(one, evidence))  # nonce unspent
        assert status == 200, body
    allowed = broker.records()[-1]
    assert allowed["input"]["claims"]["kbs"]["init_data"] is None  # none sent, none shown


async def test_guest_sent_vcek_with_an_unknown_key_algorithm_is_a_chain_error(
    start_broker: Callable[..., Any],
) -> None:
    hardware = HARDWARE["snp"]
    broker = await hardware_broker(start_broker, hardware)
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.auth(session, tee="snp")
        evidence = hardware.evidence(report_data(one.tee_pubkey, one.nonce or ""))
        der = bytes(evidence["cert_chain"][1]["data"])
        assert EC_PUBLIC_KEY_OID in der
        evidence["cert_chain"][1]["data"] = list(der.replace(EC_PUBLIC_KEY_OID, UNKNOWN_KEY_OID))
        status, body, headers = await one.call(
            session, "POST", "/attest", attestation(one, evidence)
        )
    assert (status, headers["Broker-Error-Code"]) == (401, "snp_cert_chain_invalid"), body
    record = broker.records()[-1]
    assert (record["type"], record["result"], record["code"]) == (
        "kbs_attest",
        "deny",
        "snp_cert_chain_invalid",
    )


async def test_tdx_collateral_at_its_next_update_instant_is_expired(
    start_broker: Callable[..., Any],
) -> None:
    hardware = HARDWARE["tdx"]
    for at, expected in ((NEXT_UPDATE - timedelta(seconds=1), 200), (NEXT_UPDATE, 401)):
        broker = await hardware_broker(start_broker, hardware, clock=lambda at=at: at)
        one = guest(broker)
        async with aiohttp.ClientSession() as session:
            await one.auth(session, tee="tdx")
            evidence = hardware.evidence(report_data(one.tee_pubkey, one.nonce or ""))
            status, body, headers = await one.call(
                session, "POST", "/attest", attestation(one, evidence)
            )
        assert status == expected, body
        if expected == 401:
            assert headers["Broker-Error-Code"] == "tdx_collateral_expired"
            assert broker.records()[-1]["code"] == "tdx_collateral_expired"
