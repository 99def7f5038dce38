"""The pure evidence pipeline, on simulated NVIDIA evidence in NVIDIA's formats (real artifacts
are exercised in test_real_nvidia.py and, through ``broker verify``, in test_cli.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509 import ocsp

from broker.attestation import gpu_pipeline, pipeline
from broker.attestation.issuers import IssuerSettings
from broker.attestation.nvidia.ocsp import CertKey, cert_key, ocsp_pairs
from broker.attestation.pipeline import Binding, IssuerTrust, Material, Trust
from broker.core.errors import AttestationError
from broker.crypto.jwks import parse_jwks
from tests.vectors.gpu import DRIVER, RIM_IDS, OcspResponder, RimAuthority, SimulatedGpu

NOW = datetime.now(UTC)
NONCE = bytes(range(32))


@pytest.fixture(scope="module")
def world() -> tuple[SimulatedGpu, RimAuthority]:
    return SimulatedGpu(NOW), RimAuthority(NOW)


# A second device with the same firmware, under a root the pipeline also trusts.
SECOND_GPU = SimulatedGpu(NOW)


def trust_for(gpu: SimulatedGpu, authority: RimAuthority) -> Trust:
    return Trust(
        issuers={},
        audience=None,
        device_roots=[gpu.root, SECOND_GPU.root],
        rim_roots=[authority.root],
        local_gpu=True,
    )


def rims(
    gpu: SimulatedGpu, authority: RimAuthority, *, driver_version: str = DRIVER
) -> dict[str, bytes]:
    driver = {i - 1: v for i, v in gpu.measurements.items() if i <= 4}
    vbios = {i - 1: v for i, v in gpu.measurements.items() if i > 4}
    return {
        RIM_IDS[0]: authority.rim(driver_version, driver),
        RIM_IDS[1]: authority.rim("96.00.9F.00.01", vbios),
    }


def verify(world: tuple[SimulatedGpu, RimAuthority], evidence: Any, **material: Any) -> Any:
    gpu, authority = world
    return pipeline.verify_evidence(
        {"nvidia": evidence},
        trust_for(gpu, authority),
        Material(**{"rims": rims(gpu, authority), **material}),
        bound_to=Binding(gpu_nonce=NONCE),
        now=NOW,
        require_cpu=False,
    )


@pytest.mark.parametrize(
    ("flags", "modes"),
    [
        ((0, 0), ["spt", "spt"]),
        ((1,), ["mpt"]),
        ((2, 2), ["ppcie", "ppcie"]),
        ((None,), ["unknown"]),
    ],
)
def test_gpu_mode_comes_from_the_feature_flag(
    world: tuple[SimulatedGpu, RimAuthority], flags: tuple[int | None, ...], modes: list[str]
) -> None:
    evidence = world[0].evidence(NONCE, feature_flags=flags[:1])
    if len(flags) > 1:
        evidence["evidence_list"] += SECOND_GPU.evidence(NONCE, feature_flags=flags[1:])[
            "evidence_list"
        ]
    verified = verify(world, evidence)
    assert [g["mode"] for g in verified.gpus] == modes
    assert all(g["measurements"] == "match" for g in verified.gpus)


@pytest.mark.parametrize("declared", [None, "HOPPER"])
def test_arch_inferred_or_confirmed(
    world: tuple[SimulatedGpu, RimAuthority], declared: str | None
) -> None:
    verified = verify(world, world[0].evidence(NONCE, declared_arch=declared))
    assert verified.gpus[0]["arch"] == "HOPPER"


def test_blackwell_evidence_verified_without_arch() -> None:
    gpu, authority = SimulatedGpu(NOW, arch="BLACKWELL"), RimAuthority(NOW)
    trust = trust_for(gpu, authority)
    evidence = {"nvidia": gpu.evidence(NONCE, declared_arch=None)}
    needs = pipeline.requirements(evidence, trust, require_cpu=False)
    assert any(rim_id.startswith("NV_GPU_CC_DRIVER_GB100_") for rim_id in needs.rim_ids)
    verified = pipeline.verify_evidence(
        evidence, trust, Material(), bound_to=Binding(gpu_nonce=NONCE), now=NOW, require_cpu=False
    )
    assert verified.gpus[0]["arch"] == "BLACKWELL"  # not a misleading fwid_mismatch
    assert verified.gpus[0]["measurements"] == "unverified"  # no RIMs given here


def test_contradicting_arch_is_a_clear_error(world: tuple[SimulatedGpu, RimAuthority]) -> None:
    with pytest.raises(AttestationError) as caught:
        verify(world, world[0].evidence(NONCE, declared_arch="BLACKWELL"))
    assert caught.value.code.value == "gpu_arch_mismatch"
    assert "BLACKWELL" in caught.value.message
    assert "HOPPER" in caught.value.message


def test_rim_version_differing_from_the_report_fails_the_measurements(
    world: tuple[SimulatedGpu, RimAuthority],
) -> None:
    gpu, authority = world
    other = rims(gpu, authority, driver_version="550.90.08")  # same golden values
    verified = verify(world, gpu.evidence(NONCE), rims=other)
    assert verified.gpus[0]["measurements"] == "mismatch"
    assert any("driver RIM version 550.90.08" in p for p in verified.gpus[0]["problems"])


def test_missing_rim_reads_unverified_naming_it(world: tuple[SimulatedGpu, RimAuthority]) -> None:
    verified = verify(
        world, world[0].evidence(NONCE), rims={}, rim_problems={RIM_IDS[0]: "HTTP 404"}
    )
    assert verified.gpus[0]["measurements"] == "unverified"
    assert verified.gpus[0]["problems"] == [f"RIM {RIM_IDS[0]}: HTTP 404"]


def ocsp_answers(
    responder: OcspResponder, chains: list[tuple[tuple[x509.Certificate, ...], bool]]
) -> dict[CertKey, bytes]:
    """Real DER responses for every certificate OCSP is asked about in ``chains``."""
    answers = {}
    for chain, include_leaf in chains:
        for cert, issuer in ocsp_pairs(chain, include_leaf=include_leaf):
            request = ocsp.OCSPRequestBuilder().add_certificate(cert, issuer, hashes.SHA384())
            der = request.build().public_bytes(serialization.Encoding.DER)
            answers[cert_key(cert, issuer)] = responder.answer(der)
    return answers


def test_ocsp_bytes_are_judged_in_the_pipeline(world: tuple[SimulatedGpu, RimAuthority]) -> None:
    gpu, authority = world
    evidence = gpu.evidence(NONCE)
    trust = trust_for(gpu, authority)
    needs = pipeline.requirements({"nvidia": evidence}, trust, require_cpu=False)
    device = list(needs.ocsp_chains)
    rim_chains = gpu_pipeline.rim_ocsp_chains(Material(rims=rims(gpu, authority)), trust, NOW)
    assert len(device) == 1
    assert len(rim_chains) == 2
    every = device + [(chain, True) for chain in rim_chains]
    responder = OcspResponder(gpu, extra_chains=[(authority.chain, authority.keys)])
    responder.at = NOW
    assert verify(world, evidence, ocsp=ocsp_answers(responder, every)).gpus[0]["ocsp"] == "good"
    device_only = ocsp_answers(responder, device)
    assert verify(world, evidence, ocsp=device_only).gpus[0]["ocsp"] == "unknown"
    responder.revoked = frozenset({authority.chain[1].serial_number})
    revoked = ocsp_answers(responder, every)
    assert verify(world, evidence, ocsp=revoked).gpus[0]["ocsp"] == "revoked"
    # Bytes the adapter passed on are not taken on trust: a forged answer reads unknown, and so
    # does a real answer filed under another certificate's key.
    responder.revoked = frozenset()
    responder.sign_with_wrong_key = True
    forged = ocsp_answers(responder, every)
    assert verify(world, evidence, ocsp=forged).gpus[0]["ocsp"] == "unknown"
    responder.sign_with_wrong_key = False
    good = ocsp_answers(responder, every)
    keys = list(good)
    swapped = {**good, keys[0]: good[keys[1]], keys[1]: good[keys[0]]}
    assert verify(world, evidence, ocsp=swapped).gpus[0]["ocsp"] == "unknown"


def test_token_lifetime_over_the_issuer_maximum_rejected() -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: PLC0415

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    keys = parse_jwks(json.dumps({"keys": [{**jwk, "kid": "k1", "alg": "RS256"}]}).encode())
    settings = IssuerSettings(kind="gca", issuer="https://iss.test", max_token_lifetime_seconds=600)
    trust = Trust(issuers={"https://iss.test": IssuerTrust(settings)}, audience="aud")
    iat = int(NOW.timestamp())
    for lifetime, ok in ((600, True), (601, False)):
        claims = {"iss": "https://iss.test", "aud": "aud", "iat": iat, "exp": iat + lifetime}
        token = jwt.encode(claims, key, algorithm="RS256", headers={"kid": "k1"})

        def run(t: str = token) -> pipeline.VerifiedEvidence:
            return pipeline.verify_evidence(
                {"gca": t},
                trust,
                Material(key_sets={"https://iss.test": keys}),
                bound_to=Binding(),
                now=NOW + timedelta(seconds=1),
            )

        if ok:
            assert list(run().skipped) == ["nonce"]
        else:
            with pytest.raises(AttestationError) as caught:
                run()
            assert caught.value.code.value == "token_claim_invalid"


def test_one_gpu_listed_twice_is_refused(world: tuple[SimulatedGpu, RimAuthority]) -> None:
    """Two fresh reports of one device (same leaf certificate) must not count as two GPUs."""
    evidence = world[0].evidence(NONCE, feature_flags=(0, 0))
    with pytest.raises(AttestationError) as caught:
        verify(world, evidence)
    assert caught.value.code.value == "gpu_evidence_duplicate"


def test_same_report_replayed_twice_is_refused(world: tuple[SimulatedGpu, RimAuthority]) -> None:
    evidence = world[0].evidence(NONCE)
    evidence["evidence_list"] *= 2
    with pytest.raises(AttestationError) as caught:
        verify(world, evidence)
    assert caught.value.code.value == "gpu_evidence_duplicate"


@pytest.mark.parametrize(
    "ueids",
    [["7", "7"], ["7", ""], ["7", None]],
    ids=["same-ueid", "empty-ueid", "no-ueid"],
)
def test_gpus_that_cannot_be_told_apart_are_refused(ueids: list[Any]) -> None:
    with pytest.raises(AttestationError) as caught:
        pipeline.require_distinct_devices([{"ueid": u} for u in ueids])
    assert caught.value.code.value == "gpu_evidence_duplicate"
    pipeline.require_distinct_devices([{"ueid": "7"}, {"ueid": "8"}])
    pipeline.require_distinct_devices([{}])  # one GPU: nothing to tell apart
