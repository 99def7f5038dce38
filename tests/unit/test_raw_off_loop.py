"""Raw evidence is verified off the event loop (CONVENTIONS: CPU work in an executor): a TDX
quote's chains, signatures and dcap-qvl (~5 ms) and an SNP report's RSA-PSS chain and ECDSA
signature (~1 ms) run in the loop's default executor, as ``asyncio.to_thread`` hands them over,
so one guest's evidence does not stall every other request. Observed on a real executor that
records what it is given, with the real verifiers."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from broker.attestation.raw.snp_certs import build_snp_verifier
from broker.attestation.raw.tdx import TdxTrust
from broker.attestation.raw.tdx_sources import FileCollateralSource, TdxRawVerifier
from tests.support.raw_evidence import TDX_PKI, snp_evidence, tdx_evidence
from tests.support.snp import AT, fake_amd
from tests.support.tdx_forge import INSIDE, forge_collateral


class RecordingExecutor(ThreadPoolExecutor):
    """A thread pool that notes the name of each function it runs."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.ran: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        # asyncio.to_thread submits functools.partial(Context.run, func, *args)
        inner = fn.args[0] if isinstance(fn, functools.partial) and fn.args else fn
        self.ran.append(getattr(inner, "__name__", repr(inner)))
        return super().submit(fn, *args, **kwargs)


async def _ran_off_loop(verify: Callable[[], Any]) -> list[str]:
    executor = RecordingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    await verify()
    return executor.ran


async def test_tdx_quote_is_verified_off_the_event_loop(tmp_path: Path) -> None:
    (tmp_path / "collateral.json").write_text(json.dumps(forge_collateral(TDX_PKI)))
    verifier = TdxRawVerifier(TdxTrust(TDX_PKI.root), [FileCollateralSource(tmp_path)])
    evidence = tdx_evidence(bytes(64))
    ran = await _ran_off_loop(lambda: verifier.verify(evidence, now=INSIDE))
    assert {"authenticate_quote", "verify_tdx_quote"} <= set(ran), ran


async def test_snp_report_is_verified_off_the_event_loop(tmp_path: Path) -> None:
    roots = tmp_path / "roots.pem"
    roots.write_bytes(fake_amd("Milan").ark.public_bytes(serialization.Encoding.PEM))
    verifier = await build_snp_verifier(roots=roots, certs_dir=None, kds_url=None, session=None)
    evidence = snp_evidence(bytes(64))
    ran = await _ran_off_loop(lambda: verifier.verify(evidence, now=AT))
    assert "verify_snp_report" in ran, ran
