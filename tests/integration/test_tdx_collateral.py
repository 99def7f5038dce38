"""TDX collateral over real HTTP (issue 33): a loopback server answers Intel's PCS v4 API with the
public sample's collateral, the broker's ``TdxRawVerifier`` fetches it with aiohttp, caches it per
platform, refreshes it, serves the last good answer while the server is down — until its
``nextUpdate``, never after — and asks nothing for a quote that does not authenticate."""

from __future__ import annotations

import base64
import json
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote as url_quote

import aiohttp
import pytest
from aiohttp import web

from broker.attestation.raw import REPORT_DATA_BYTES, RawVerifier
from broker.attestation.raw.tdx_sources import (
    FileCollateralSource,
    PcsCollateralSource,
    TdxRawVerifier,
    open_tdx_verifier,
)
from broker.config import TdxSettings
from broker.core.errors import AttestationError, ErrorCode, UpstreamError
from tests.support.tdx_forge import forge_pki, forge_quote
from tests.support.tdx_samples import INTEL_SGX_ROOT, INTEL_TRUST, TDX_FIXTURES, V4_INSIDE

QUOTE = (TDX_FIXTURES / "tdx_quote").read_bytes()
COLLATERAL = json.loads((TDX_FIXTURES / "tdx_quote_collateral.json").read_bytes())
EVIDENCE = {"quote": base64.b64encode(QUOTE).decode(), "cc_eventlog": None}
NEXT_UPDATE = V4_INSIDE.replace(month=7, day=19, hour=10, minute=0, second=35)  # the PCK CRL's
REFRESH = 3600


@dataclass
class Pcs:
    """Intel's PCS v4 API for one FMSPC, from the sample's collateral, counting requests."""

    url: str = ""
    asked: Counter[str] = field(default_factory=Counter)
    down: bool = False


@pytest.fixture
async def pcs() -> AsyncIterator[Pcs]:
    state = Pcs()

    def answer(kind: str, body: bytes, header: str = "", chain: str = "") -> web.Response:
        state.asked[kind] += 1
        if state.down:
            return web.Response(status=503)
        headers = {header: url_quote(chain)} if header else {}
        return web.Response(body=body, headers=headers)

    async def tcb(request: web.Request) -> web.Response:
        if request.query.get("fmspc") != "B0C06F000000":
            return web.Response(status=404)
        signature = COLLATERAL["tcb_info_signature"]
        body = f'{{"tcbInfo":{COLLATERAL["tcb_info"]},"signature":"{signature}"}}'
        chain = COLLATERAL["tcb_info_issuer_chain"]
        return answer("tcb", body.encode(), "TCB-Info-Issuer-Chain", chain)

    async def qe(request: web.Request) -> web.Response:
        signature = COLLATERAL["qe_identity_signature"]
        body = f'{{"enclaveIdentity":{COLLATERAL["qe_identity"]},"signature":"{signature}"}}'
        chain = COLLATERAL["qe_identity_issuer_chain"]
        return answer("qe", body.encode(), "SGX-Enclave-Identity-Issuer-Chain", chain)

    async def pckcrl(request: web.Request) -> web.Response:
        assert (request.query["ca"], request.query["encoding"]) == ("platform", "der")
        chain = COLLATERAL["pck_crl_issuer_chain"]
        return answer(
            "pckcrl", bytes.fromhex(COLLATERAL["pck_crl"]), "SGX-PCK-CRL-Issuer-Chain", chain
        )

    async def rootcacrl(request: web.Request) -> web.Response:
        return answer("rootcacrl", COLLATERAL["root_ca_crl"].encode())  # PCCS: hex text

    app = web.Application()
    app.router.add_get("/tdx/certification/v4/tcb", tcb)
    app.router.add_get("/tdx/certification/v4/qe/identity", qe)
    app.router.add_get("/sgx/certification/v4/pckcrl", pckcrl)
    app.router.add_get("/sgx/certification/v4/rootcacrl", rootcacrl)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield state
    finally:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


def pcs_verifier(pcs: Pcs, session: aiohttp.ClientSession) -> TdxRawVerifier:
    source = PcsCollateralSource(
        pcs.url, session, root_ca_crl_url=None, refresh_seconds=REFRESH, timeout_seconds=5
    )
    return TdxRawVerifier(INTEL_TRUST, [source])


async def test_quote_verifies_with_collateral_fetched_over_http(
    pcs: Pcs, session: aiohttp.ClientSession
) -> None:
    verifier: RawVerifier = pcs_verifier(pcs, session)  # the interface the KBS facade calls
    assert verifier.tee_names == ("tdx",)
    verified = await verifier.verify(EVIDENCE, now=V4_INSIDE)
    assert (verified.technology, verified.verified_at) == ("tdx", V4_INSIDE)
    assert len(verified.report_data) == REPORT_DATA_BYTES
    assert verified.tee["tcb_status"] == "UpToDate"
    assert verified.claims["cc_eventlog_replayed"] is False
    assert pcs.asked == Counter(tcb=1, qe=1, pckcrl=1, rootcacrl=1)
    await verifier.verify(EVIDENCE, now=V4_INSIDE + timedelta(seconds=REFRESH - 1))
    assert sum(pcs.asked.values()) == 4  # served from the cache
    await verifier.verify(EVIDENCE, now=V4_INSIDE + timedelta(seconds=REFRESH))
    assert sum(pcs.asked.values()) == 8  # refreshed after refresh_seconds


async def test_last_good_collateral_serves_until_its_next_update_never_after(
    pcs: Pcs, session: aiohttp.ClientSession
) -> None:
    verifier = pcs_verifier(pcs, session)
    await verifier.verify(EVIDENCE, now=V4_INSIDE)
    pcs.down = True
    later = V4_INSIDE + timedelta(days=2)
    assert (await verifier.verify(EVIDENCE, now=later)).tee["tcb_status"] == "UpToDate"
    assert pcs.asked["tcb"] == 2  # it tried, failed, and served the cached answer
    with pytest.raises(UpstreamError) as caught:
        await verifier.verify(EVIDENCE, now=NEXT_UPDATE + timedelta(seconds=1))
    assert caught.value.code == ErrorCode.TDX_COLLATERAL_UNAVAILABLE
    assert caught.value.status == 503


async def test_stale_collateral_from_the_server_is_refused_with_its_code(
    pcs: Pcs, session: aiohttp.ClientSession
) -> None:
    """A PCCS that stopped refreshing hands out collateral past its nextUpdate: a clear
    refusal naming it, not a silent pass and not an outage."""
    with pytest.raises(AttestationError) as caught:
        await pcs_verifier(pcs, session).verify(EVIDENCE, now=NEXT_UPDATE + timedelta(days=30))
    assert caught.value.code == ErrorCode.TDX_COLLATERAL_EXPIRED
    assert sum(pcs.asked.values()) == 4


async def test_a_quote_from_another_root_costs_no_request(
    pcs: Pcs, session: aiohttp.ClientSession
) -> None:
    stranger = {"quote": base64.b64encode(forge_quote(forge_pki(7))).decode()}
    with pytest.raises(AttestationError) as caught:
        await pcs_verifier(pcs, session).verify(stranger, now=V4_INSIDE)
    assert caught.value.code == ErrorCode.CERT_CHAIN_INVALID
    assert sum(pcs.asked.values()) == 0


async def test_collateral_directory_is_read_first(
    pcs: Pcs, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    shutil.copy(TDX_FIXTURES / "tdx_quote_collateral.json", tmp_path / "b0c06f.json")
    shutil.copy(TDX_FIXTURES / "tdx_quote_outdated_collateral.json", tmp_path / "other.json")
    (tmp_path / "junk.json").write_text("{}")
    settings = TdxSettings(
        pccs_url=pcs.url, collateral_dir=tmp_path, root_certificate=INTEL_SGX_ROOT
    )
    verifier = await open_tdx_verifier(settings, session)
    assert (await verifier.verify(EVIDENCE, now=V4_INSIDE)).tee["tcb_status"] == "UpToDate"
    assert sum(pcs.asked.values()) == 0
    (tmp_path / "b0c06f.json").unlink()
    assert (await verifier.verify(EVIDENCE, now=V4_INSIDE)).tee["tcb_status"] == "UpToDate"
    assert sum(pcs.asked.values()) == 4  # not in the directory any more: the PCS


async def test_no_collateral_anywhere_is_an_upstream_refusal(tmp_path: Path) -> None:
    shutil.copy(TDX_FIXTURES / "tdx_quote_outdated_collateral.json", tmp_path / "other.json")
    verifier = TdxRawVerifier(INTEL_TRUST, [FileCollateralSource(tmp_path)])
    with pytest.raises(UpstreamError) as caught:
        await verifier.verify(EVIDENCE, now=V4_INSIDE)
    assert caught.value.code == ErrorCode.TDX_COLLATERAL_UNAVAILABLE
