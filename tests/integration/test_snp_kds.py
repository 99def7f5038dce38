"""The SEV-SNP verifier the KBS facade calls (``attestation/raw/snp_certs.py``): certificates from
the guest, from a directory, and from AMD's key distribution service API served on loopback by
the test (real aiohttp client, real HTTP)."""

from __future__ import annotations

import asyncio
import copy
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.serialization import Encoding

from broker.attestation.raw import RawVerifier
from broker.attestation.raw.snp_certs import (
    KDS_FETCH_BURST,
    KDS_FETCHES_PER_SECOND,
    KDS_MISS_SECONDS,
    SnpVerifier,
    build_snp_verifier,
)
from broker.attestation.raw.snp_report import Tcb
from broker.core.errors import AttestationError, ErrorCode, UpstreamError
from tests.support.snp import AT, fake_amd, fixture, guest_evidence, milan_report, serde_object
from tests.support.snp import signed as signed_report

GENOA_VCEK = bytes(guest_evidence()["cert_chain"][0]["data"])
GENOA_HWID = bytes(guest_evidence()["attestation_report"]["chip_id"]).hex()
GENOA_QUERY = "blSPL=10&teeSPL=00&snpSPL=23&ucodeSPL=25"


@dataclass
class Kds:
    """AMD KDS's VCEK route: ``/vcek/v1/{product}/{hwid}?…SPL=…`` → DER, or the status set."""

    certs: dict[str, bytes] = field(default_factory=dict)  # "product/hwid?query" -> DER
    status: int = 200
    hits: list[str] = field(default_factory=list)
    url: str = ""

    async def vcek(self, request: web.Request) -> web.Response:
        wanted = (
            f"{request.match_info['product']}/{request.match_info['hwid']}?{request.query_string}"
        )
        self.hits.append(wanted)
        await asyncio.sleep(0.05)  # long enough for concurrent askers to meet in flight
        if self.status != 200:
            return web.Response(status=self.status)
        if wanted not in self.certs:
            return web.Response(status=404)
        return web.Response(body=self.certs[wanted], content_type="application/x-x509-ca-cert")


@pytest.fixture
async def kds() -> AsyncIterator[Kds]:
    server = Kds(certs={f"Genoa/{GENOA_HWID}?{GENOA_QUERY}": GENOA_VCEK})
    app = web.Application()
    app.router.add_get("/vcek/v1/{product}/{hwid}", server.vcek)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield server
    await runner.cleanup()


def without_chain(evidence: dict[str, Any]) -> dict[str, Any]:
    return {**copy.deepcopy(evidence), "cert_chain": None}


async def verifier(
    session: aiohttp.ClientSession | None, url: str | None, **kw: Any
) -> SnpVerifier:
    return await build_snp_verifier(
        roots=None, certs_dir=kw.pop("certs_dir", None), kds_url=url, session=session, **kw
    )


async def refused(code: ErrorCode, snp: RawVerifier, evidence: dict[str, Any]) -> None:
    with pytest.raises((AttestationError, UpstreamError)) as caught:
        await snp.verify(evidence, now=AT)
    assert caught.value.code == code, caught.value.message


async def test_vcek_fetched_from_kds_once_and_cached(kds: Kds) -> None:
    async with aiohttp.ClientSession() as session:
        snp = await verifier(session, kds.url)
        verified = await snp.verify(without_chain(guest_evidence()), now=AT)
        assert verified.tee["product"] == "Genoa"
        assert kds.hits == [f"Genoa/{GENOA_HWID}?{GENOA_QUERY}"]
        await snp.verify(without_chain(guest_evidence()), now=AT)
        assert len(kds.hits) == 1  # a VCEK never changes for a chip and TCB: cached

        fresh = await verifier(session, kds.url)
        together = [fresh.verify(without_chain(guest_evidence()), now=AT) for _ in range(5)]
        await asyncio.gather(*together)
        assert len(kds.hits) == 2  # five askers, one fetch


async def test_kds_without_the_vcek_is_a_refusal_and_an_outage_is_503(kds: Kds) -> None:
    async with aiohttp.ClientSession() as session:
        snp = await verifier(session, kds.url)
        for status in (500, 429):  # an outage is not remembered: asked again each time
            kds.status = status
            await refused(ErrorCode.SNP_KDS_UNAVAILABLE, snp, without_chain(guest_evidence()))
        assert len(kds.hits) == 2
        kds.status, kds.certs["Genoa/" + GENOA_HWID + "?" + GENOA_QUERY] = 200, b"not DER"
        await refused(ErrorCode.SNP_KDS_UNAVAILABLE, snp, without_chain(guest_evidence()))
        kds.certs.clear()
        await refused(ErrorCode.SNP_VEK_MISSING, snp, without_chain(guest_evidence()))
        closed = await verifier(session, "http://127.0.0.1:9", timeout_seconds=2.0)
        await refused(ErrorCode.SNP_KDS_UNAVAILABLE, closed, without_chain(guest_evidence()))


def unsigned_report(chip_id: bytes) -> dict[str, Any]:
    """A report naming ``chip_id`` with no valid signature: what anyone can send."""
    evidence = without_chain(guest_evidence())
    evidence["attestation_report"]["chip_id"] = list(chip_id)
    evidence["attestation_report"]["signature"]["r"] = [0] * 72
    return evidence


async def test_a_chip_the_kds_does_not_know_is_asked_for_once(kds: Kds) -> None:
    """50 identical unsigned reports naming a chip AMD does not know: one KDS request, then the
    answer is believed for KDS_MISS_SECONDS; after that it is asked again."""
    async with aiohttp.ClientSession() as session:
        snp = await verifier(session, kds.url)
        for _ in range(50):
            await refused(ErrorCode.SNP_VEK_MISSING, snp, unsigned_report(bytes([7]) * 64))
        assert len(kds.hits) == 1
        later = AT + timedelta(seconds=KDS_MISS_SECONDS)
        with pytest.raises(AttestationError):
            await snp.verify(unsigned_report(bytes([7]) * 64), now=later)
        assert len(kds.hits) == 2


async def test_random_chip_ids_cost_a_bounded_number_of_kds_requests(kds: Kds) -> None:
    """Each unsigned report names another chip: past the burst, the broker refuses without
    asking AMD (503, the guest may retry), so a stranger cannot turn it into a KDS flood."""
    async with aiohttp.ClientSession() as session:
        snp = await verifier(session, kds.url)
        codes = []
        for _ in range(100):
            with pytest.raises((AttestationError, UpstreamError)) as caught:
                await snp.verify(unsigned_report(os.urandom(64)), now=AT)
            codes.append(caught.value.code)
        assert len(kds.hits) == KDS_FETCH_BURST  # the clock stood still: no refill
        assert codes.count(ErrorCode.SNP_VEK_MISSING) == KDS_FETCH_BURST
        assert codes.count(ErrorCode.SNP_KDS_UNAVAILABLE) == 100 - KDS_FETCH_BURST
        # a guest whose VCEK is cached, or that sends its chain, is not held up by the flood
        assert (await snp.verify(guest_evidence(), now=AT)).tee["product"] == "Genoa"
        refill = AT + timedelta(seconds=10 / KDS_FETCHES_PER_SECOND)
        for _ in range(20):
            with pytest.raises((AttestationError, UpstreamError)):
                await snp.verify(unsigned_report(os.urandom(64)), now=refill)
        assert len(kds.hits) == KDS_FETCH_BURST + 10  # ten seconds' worth


async def test_guest_cert_chain_needs_no_network() -> None:
    snp: RawVerifier = await verifier(None, None)  # the interface the KBS facade calls
    assert snp.tee_names == ("snp",)
    assert (await snp.verify(guest_evidence(), now=AT)).tee["signing_key"] == "vcek"
    await refused(ErrorCode.SNP_VEK_MISSING, snp, without_chain(guest_evidence()))


async def test_the_endorsement_key_of_the_kind_the_report_names_is_taken() -> None:
    evidence = guest_evidence()
    vlek = {"cert_type": "VLEK", "data": list(fixture("trustee_test-vlek.der"))}
    evidence["cert_chain"] = [vlek, *evidence["cert_chain"]]  # a VLEK first: the report is VCEK's
    assert (await (await verifier(None, None)).verify(evidence, now=AT)).tee[
        "signing_key"
    ] == "vcek"


async def test_certificates_from_a_directory(tmp_path: Path) -> None:
    (tmp_path / "genoa-vcek.der").write_bytes(GENOA_VCEK)
    (tmp_path / "milan-vcek.der").write_bytes(fixture("virtee_vcek_milan.der"))
    (tmp_path / "milan-chain.pem").write_bytes(fixture("virtee_cert_chain_milan"))
    snp = await verifier(None, None, certs_dir=tmp_path)
    assert (await snp.verify(without_chain(guest_evidence()), now=AT)).tee["product"] == "Genoa"
    milan = {"attestation_report": serde_object(milan_report(), "Milan"), "cert_chain": None}
    assert (await snp.verify(milan, now=AT)).tee["product"] == "Milan"


async def test_guest_sent_root_and_intermediate_do_not_make_a_forged_vcek_trusted() -> None:
    raw = milan_report()
    forged = fake_amd("Milan")
    vcek, key = forged.vcek(Tcb(3, 0, 8, 115, None), raw[0x1A0:0x1E0])
    chain = [
        {"cert_type": kind, "data": list(cert.public_bytes(Encoding.DER))}
        for kind, cert in (("VCEK", vcek), ("ASK", forged.ask), ("ARK", forged.ark))
    ]
    evidence = {
        "attestation_report": serde_object(signed_report(raw, key), "Milan"),
        "cert_chain": chain,
    }
    await refused(ErrorCode.SNP_CERT_CHAIN_INVALID, await verifier(None, None), evidence)
