"""What the workload-certificate tests share (issue 32): a broker with ``[attest]`` and
``[identity]`` on (a development root and intermediate from ``broker/dev/identity_ca.py``, the
allowed image mapped to ``SPIFFE_PATH`` in the shipped identity policy's data), CSRs made with
``cryptography``, and the request made by hand (raw HTTP, PyJWT proofs from ``Runner``) so that
hostile tests can change one thing."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from broker.dev.identity_ca import make_dev_identity_ca, make_dev_identity_chain
from tests.integration.attested import Runner, attest_broker
from tests.integration.conftest import RunningBroker
from tests.support.constants import ALLOWED

TRUST_DOMAIN = "runners.it.invalid"
SPIFFE_PATH = "shards/llama"
SPIFFE_ID = f"spiffe://{TRUST_DOMAIN}/{SPIFFE_PATH}"
IDENTITY_TOML = (
    f'\n[identity]\nenabled = true\ntrust_domain = "{TRUST_DOMAIN}"\n'
    'ca_certificates = "identity/ca-chain.pem"\nca_key = "identity/ca.key"\n'
    "max_lifetime_seconds = 3600\n"
)


def with_identity(workdir: Path, ca_key: ec.EllipticCurvePublicKey | None = None) -> None:
    """The development CA (its key a PEM file, ``identity/ca.key``; or ``ca_key``, whose
    private half lives in Cloud KMS or on a token), and the allowed image given
    ``SPIFFE_PATH`` by the policy's data."""
    if ca_key is None:
        make_dev_identity_ca(workdir / "identity", TRUST_DOMAIN, now=datetime.now(UTC))
    else:
        make_dev_identity_chain(workdir / "identity", TRUST_DOMAIN, ca_key, now=datetime.now(UTC))
    data_file = workdir / "policies" / "broker" / "data.json"
    data = json.loads(data_file.read_text(encoding="utf-8"))
    data["identities"] = {ALLOWED: SPIFFE_PATH}
    data_file.write_text(json.dumps(data), encoding="utf-8")


async def identity_broker(start_broker: Callable[..., Any], **kwargs: Any) -> RunningBroker:
    """``attest_broker`` with workload certificates on (plus ``extra_toml`` and a further
    ``workdir_setup``, when given)."""
    extra_toml = IDENTITY_TOML + kwargs.pop("extra_toml", "")
    setup = kwargs.pop("workdir_setup", None)

    def set_up(workdir: Path) -> None:
        with_identity(workdir)
        if setup is not None:
            setup(workdir)

    return await attest_broker(start_broker, extra_toml=extra_toml, workdir_setup=set_up, **kwargs)


def make_csr(
    key: ec.EllipticCurvePrivateKey | None = None, *, uris: tuple[str, ...] = ()
) -> tuple[ec.EllipticCurvePrivateKey, str]:
    """A P-256 key (new unless given) and its CSR (PEM), asking for ``uris`` as SANs."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            critical=False,
        )
    csr = builder.sign(key, hashes.SHA256())
    return key, csr.public_bytes(serialization.Encoding.PEM).decode()


def identity_url(broker: RunningBroker) -> str:
    return broker.url + "/v1/identity"


async def ask_identity(
    runner: Runner,
    session: aiohttp.ClientSession,
    csr: str,
    *,
    proof: str | None = "make",
    authorization: str | None = None,
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``POST /v1/identity`` with the runner's EAR and (unless ``proof`` is None or given) a
    fresh proof for this route."""
    headers = {"Authorization": authorization or f"DPoP {runner.token}"}
    if proof == "make":
        proof = runner.proof(htu=identity_url(runner.broker))
    if proof is not None:
        headers["DPoP"] = proof
    async with session.post(
        identity_url(runner.broker),
        json={"csr": csr},
        headers=headers,
        ssl=runner.broker.client_tls,
    ) as response:
        return response.status, await response.json(), dict(response.headers)


async def bundle(broker: RunningBroker, session: aiohttp.ClientSession, form: str = "") -> Any:
    query = f"?format={form}" if form else ""
    async with session.get(
        broker.url + "/v1/identity/bundle" + query, ssl=broker.client_tls
    ) as response:
        assert response.status == 200, await response.text()
        return await response.text() if form == "pem" else await response.json()
