"""Our X.509-SVIDs and trust bundle, checked by an independent SPIFFE implementation (issue 32,
item 5): go-spiffe (``tests/interop/spiffe``, pinned in its go.mod and go.sum) parses the bundle
in its JWKS form, loads the SVID with its key (go-spiffe's own X.509-SVID profile checks) and
verifies it with ``x509svid.Verify``. The program is built here with ``go build``; without a Go
toolchain, or where the module cannot be fetched, the test is skipped saying why."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from broker.crypto.svid import bundle_jwks
from broker.dev.identity_ca import make_dev_identity_ca
from broker.dev.workspace import private_pem
from tests.integration.attested import Runner, attest_broker
from tests.integration.identity import (
    IDENTITY_TOML,
    SPIFFE_ID,
    TRUST_DOMAIN,
    ask_identity,
    bundle,
    identity_broker,
    make_csr,
    with_identity,
)
from tests.support.identity_cas import make_issuing_ca

PROGRAM = Path(__file__).resolve().parents[1] / "interop" / "spiffe"


@pytest.fixture(scope="module")
def spiffeverify(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain on PATH: go-spiffe interop not run")
    binary = tmp_path_factory.mktemp("spiffe") / "spiffeverify"
    built = subprocess.run(
        [go, "build", "-o", str(binary), "."],
        cwd=PROGRAM,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "GOFLAGS": "-mod=readonly"},
    )
    if built.returncode != 0:
        pytest.skip(f"go-spiffe could not be built here (module not fetchable?): {built.stderr}")
    return binary


def _verify(binary: Path, trust_domain: str, jwks: Path, chain: Path, key: Path) -> tuple[int, str]:
    ran = subprocess.run(
        [str(binary), trust_domain, str(jwks), str(chain), str(key)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return ran.returncode, ran.stdout.strip()


async def test_go_spiffe_verifies_our_svid_against_our_bundle(
    start_broker: Callable[..., Any], spiffeverify: Path, tmp_path: Path
) -> None:
    broker = await identity_broker(start_broker)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        key, csr = make_csr()
        status, body, _ = await ask_identity(runner, session, csr)
        assert status == 201, body
        jwks = await bundle(broker, session)
    await asyncio.to_thread(_check_with_go, spiffeverify, tmp_path, body, jwks, key)


def _check_with_go(
    spiffeverify: Path,
    tmp_path: Path,
    body: dict[str, Any],
    jwks: dict[str, Any],
    key: ec.EllipticCurvePrivateKey,
) -> None:
    files = {name: tmp_path / name for name in ("bundle.json", "chain.pem", "key.pem")}
    files["bundle.json"].write_text(json.dumps(jwks))
    files["chain.pem"].write_text(body["certificates"])
    files["key.pem"].write_bytes(private_pem(key))
    args = (files["bundle.json"], files["chain.pem"], files["key.pem"])
    code, out = _verify(spiffeverify, TRUST_DOMAIN, *args)
    assert code == 0, out
    assert json.loads(out) == {"id": SPIFFE_ID}
    # another trust domain's verifier: the same certificate is not one of its SVIDs
    code, out = _verify(spiffeverify, "other.it.invalid", *args)
    assert code == 1
    assert "trust domain" in out
    # a bundle of another CA (same trust domain name): the chain does not verify
    other = make_dev_identity_ca(tmp_path / "other", TRUST_DOMAIN, now=datetime.now(UTC))
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(_jwks_of(other.root)))
    code, out = _verify(spiffeverify, TRUST_DOMAIN, foreign, files["chain.pem"], files["key.pem"])
    assert code == 1
    assert "verify" in out
    # a key that is not the certificate's: go-spiffe refuses to load the SVID
    stranger = tmp_path / "stranger.pem"
    stranger.write_bytes(private_pem(make_csr()[0]))
    code, out = _verify(
        spiffeverify, TRUST_DOMAIN, files["bundle.json"], files["chain.pem"], stranger
    )
    assert code == 1
    assert "svid" in out


@pytest.mark.parametrize("root", ["P-384", "P-521", "RSA-3072"])
async def test_go_spiffe_accepts_the_bundle_of_a_root_of_another_key_kind(
    start_broker: Callable[..., Any], spiffeverify: Path, tmp_path: Path, root: str
) -> None:
    """The operator's root need not be P-256 (the intermediate that signs is): its JWK in the
    served bundle is what go-jose reads (was: a P-384 root published as ``crv: "secp384r1"``,
    which go-spiffe refused, and an RSA root left out, so no SVID verified)."""

    def setup(workdir: Path) -> None:
        with_identity(workdir)
        make_issuing_ca(datetime.now(UTC), root=root).write(workdir / "identity")

    broker = await attest_broker(start_broker, extra_toml=IDENTITY_TOML, workdir_setup=setup)
    async with aiohttp.ClientSession() as session:
        runner = Runner(broker)
        await runner.attest(session)
        key, csr = make_csr()
        status, body, _ = await ask_identity(runner, session, csr)
        assert status == 201, body
        jwks = await bundle(broker, session)
    (jwk,) = jwks["keys"]
    assert (jwk["kty"], jwk.get("crv")) == (
        ("RSA", None) if root.startswith("RSA") else ("EC", root)
    )
    files = {name: tmp_path / name for name in ("bundle.json", "chain.pem", "key.pem")}
    files["bundle.json"].write_text(json.dumps(jwks))
    files["chain.pem"].write_text(body["certificates"])
    files["key.pem"].write_bytes(private_pem(key))
    args = (files["bundle.json"], files["chain.pem"], files["key.pem"])
    code, out = await asyncio.to_thread(_verify, spiffeverify, TRUST_DOMAIN, *args)
    assert (code, out) == (0, json.dumps({"id": SPIFFE_ID}, separators=(",", ":")))


def _jwks_of(root: Path) -> dict[str, object]:
    return bundle_jwks([x509.load_pem_x509_certificate(root.read_bytes())], sequence=1, refresh=300)
