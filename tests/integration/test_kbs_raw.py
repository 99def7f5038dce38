"""Hardware evidence through the KBS facade (issue 33): a TDX guest and an SEV-SNP guest, as
guest-components' attesters send their evidence, fetch their key from a live broker whose
verifiers pin a test PKI (``tests/integration/kbs_raw.py``) — the verifiers the facade registers
from ``[tdx]`` and ``[snp]``, the report data bound to the guest's key, nonce and additional
evidence, the init-data bound to MRCONFIGID / HOST_DATA, the policy on the measurements and TCB
in ``kbs_guests``. Evidence binding another key, nonce or additional evidence, and a debug TD,
are refused with a record."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import aiohttp
import jwt
import pytest

from broker.keys.factory import open_key_service
from tests.integration.conftest import RunningBroker
from tests.integration.kbs import RESOURCE, guest
from tests.integration.kbs_raw import HARDWARE, Hardware, attestation, hardware_broker
from tests.support.constants import KEY
from tests.support.kbs_client import Guest, open_as_guest, report_data, tee_key
from tests.support.tdx_forge import DEBUG_TD, NEXT_UPDATE

INIT_DATA = 'algorithm = "sha384"\nversion = "0.1.0"\n\n[data]\n"aa.toml" = "url = 1"\n'
LAUNCH_FIELD = {"tdx": ("mrconfigid", 48), "snp": ("host_data", 32)}


def launched_with(tee: str, init_data: str) -> dict[str, bytes]:
    """The launch field the host set for ``init_data`` (its SHA-384, fitted to the field)."""
    field, size = LAUNCH_FIELD[tee]
    digest = hashlib.sha384(init_data.encode()).digest()
    return {field: digest[:size].ljust(size, b"\0")}


async def _refused_binding(
    broker: RunningBroker,
    session: aiohttp.ClientSession,
    one: Guest,
    hardware: Hardware,
    body: dict[str, Any],
) -> None:
    status, answer = await one.attest(session, body)
    record = broker.records()[-1]
    assert (status, record["type"], record["code"]) == (
        401,
        "kbs_attest",
        "kbs_report_data_mismatch",
    )
    assert record["kbs"]["tee"] == hardware.tee, answer


@pytest.mark.parametrize("tee", sorted(HARDWARE))
async def test_a_hardware_guest_fetches_its_key(start_broker: Callable[..., Any], tee: str) -> None:
    hardware = HARDWARE[tee]
    field, _ = LAUNCH_FIELD[tee]
    reference = {**hardware.reference}
    reference["measurements"] = {
        **hardware.reference["measurements"],
        field: launched_with(tee, INIT_DATA)[field].hex(),  # the docs' advice: pin the field
    }
    broker = await hardware_broker(start_broker, hardware, reference=reference)
    async with open_key_service(broker.settings.keys) as keys:
        dek = await keys.unwrap(await keys.resolve(KEY, None))
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        status, body = await one.auth(session, tee=tee)
        assert status == 200, body
        launch = launched_with(tee, INIT_DATA)
        # what a relay of another guest's (or another session's) evidence looks like: the
        # hardware signed another key, another nonce, or other additional (device) evidence
        _, another_key = tee_key()
        for signed_over, additional in (
            (report_data(one.tee_pubkey, "another nonce"), ""),
            (report_data(another_key, one.nonce or ""), ""),
            (report_data(one.tee_pubkey, one.nonce or "", '{"nvidia":"a"}'), ""),
            (report_data(one.tee_pubkey, one.nonce or "", '{"nvidia":"a"}'), '{"nvidia":"b"}'),
        ):
            evidence = hardware.evidence(signed_over, **launch)
            body = attestation(one, evidence, additional=additional, init_data=INIT_DATA)
            await _refused_binding(broker, session, one, hardware, body)
        additional = '{"nvidia":"a"}'
        bound = hardware.evidence(
            report_data(one.tee_pubkey, one.nonce or "", additional), **launch
        )
        body = attestation(one, bound, additional=additional, init_data=INIT_DATA)
        status, body = await one.attest(session, body)
        assert status == 200, body
        status, answer, _ = await one.resource(session, RESOURCE)
    assert status == 200, answer
    assert open_as_guest(answer, one.private) == dek
    attest = next(r for r in reversed(broker.records()) if r["type"] == "kbs_attest")
    assert attest["result"] == "allow"
    assert attest["input"]["tee"]["technology"] == hardware.reference["technology"]
    assert attest["input"]["claims"]["kbs"]["tee"] == tee
    digest = hashlib.sha384(INIT_DATA.encode()).hexdigest()
    verified = {"algorithm": "sha384", "digest": digest, "field": field}
    assert (
        attest["input"]["claims"]["kbs"]["init_data"] == verified
    )  # only as the evidence bound it
    assert attest["kbs"]["init_data"] == {
        "algorithm": "sha384",
        "digest": digest,
        "bound_to": field,
    }
    expires = jwt.decode(one.token or "", options={"verify_signature": False})["exp"]
    if tee == "tdx":  # never past the collateral it was judged with (its nextUpdate)
        assert expires == int(NEXT_UPDATE.timestamp())
    else:
        assert expires == int(hardware.at.timestamp()) + 300


async def test_a_debug_td_is_refused(start_broker: Callable[..., Any]) -> None:
    hardware = HARDWARE["tdx"]
    broker = await hardware_broker(start_broker, hardware, environ={})
    one = guest(broker)
    async with aiohttp.ClientSession() as session:
        await one.auth(session, tee="tdx")
        debug = hardware.evidence(
            report_data(one.tee_pubkey, one.nonce or ""), td_attributes=DEBUG_TD
        )
        status, _ = await one.attest(session, attestation(one, debug))
    record = broker.records()[-1]
    assert (status, record["type"], record["result"]) == (401, "kbs_attest", "deny")
    assert record["code"] == "tdx_td_attributes_refused", record
