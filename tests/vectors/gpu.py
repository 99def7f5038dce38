"""A simulated NVIDIA world for end-to-end tests: device PKI, SPDM reports, signed RIMs, NRAS.

Real NVIDIA evidence cannot be bound to a fresh broker nonce, so the positive end-to-end paths
use this generator: the same formats as the real artifacts (checked byte for byte by the
real-artifact unit tests), signed by test authorities the test broker is configured to trust.
Keys are generated per run; times come from the caller.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from lxml import etree
from signxml.algorithms import CanonicalizationMethod, DigestAlgorithm, SignatureMethod
from signxml.signer import XMLSigner

from broker.crypto.jwk import public_jwk

SWID_NS = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd"
SHA384_NS = "http://www.w3.org/2001/04/xmlenc#sha384"
VBIOS_BYTES = bytes.fromhex("009f009601000000")  # 96.00.9F.00.01, as in the real Hopper report
DRIVER = "550.90.07"
RIM_IDS = ("NV_GPU_DRIVER_GH100_550.90.07", "NV_GPU_VBIOS_1010_0200_882_96009F0001")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def key_usage(*, sign: bool, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


# As NVIDIA's real chains: CAs may sign certificates and CRLs; leaves sign evidence.
KEY_CERT_SIGN = key_usage(sign=False, cert_sign=True)
DIGITAL_SIGNATURE = key_usage(sign=True, cert_sign=False)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    now: datetime,
    ca: bool,
    extensions: list[x509.ExtensionType] | None = None,
) -> x509.Certificate:
    issuer_name, issuer_key = issuer if issuer else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(KEY_CERT_SIGN if ca else DIGITAL_SIGNATURE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    for extension in extensions or []:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(issuer_key, hashes.SHA384())


def _chain(
    names: list[str], now: datetime, leaf_extensions: list[x509.ExtensionType] | None = None
) -> tuple[list[x509.Certificate], list[ec.EllipticCurvePrivateKey]]:
    """Root first in ``names``; returns (certificates leaf first, keys leaf first)."""
    keys = [ec.generate_private_key(ec.SECP384R1()) for _ in names]
    certs: list[x509.Certificate] = []
    for depth, (cn, key) in enumerate(zip(names, keys, strict=True)):
        issuer = None if depth == 0 else (certs[-1].subject, keys[depth - 1])
        last = depth == len(names) - 1
        certs.append(
            _cert(
                cn, key, issuer, now=now, ca=not last, extensions=leaf_extensions if last else None
            )
        )
    return certs[::-1], keys[::-1]


def pem(certs: list[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


@dataclass
class SimulatedGpu:
    """One GPU: a device chain to ``root`` and firmware ``measurements`` (SPDM block: value)."""

    now: datetime
    measurements: dict[int, bytes] = field(default_factory=dict)
    arch: str = "HOPPER"
    chain: list[x509.Certificate] = field(default_factory=list)
    leaf_key: ec.EllipticCurvePrivateKey | None = None
    keys: list[ec.EllipticCurvePrivateKey] = field(default_factory=list)  # leaf first
    fwid: bytes = b""

    def __post_init__(self) -> None:
        if not self.measurements:
            self.measurements = {
                i: hashlib.sha384(f"block-{i}".encode()).digest() for i in range(1, 9)
            }
        self.fwid = os.urandom(48)
        # Hopper: the FWID ends the TcbInfo extension; Blackwell: it sits inside TcbInfo.fwids.
        trailer = b"" if self.arch == "HOPPER" else b"\x81\x01\x00more-tcb-info"
        tcb_info = x509.UnrecognizedExtension(
            x509.ObjectIdentifier("2.23.133.5.4.1"),
            b"\x30\x35\x04\x33tcb-info-prefix" + self.fwid + trailer,
        )
        chip = "GH100" if self.arch == "HOPPER" else "GB100"
        names = [  # real names below a test root (the root's CN says so)
            "Test Device Identity CA",
            f"Test {chip} Identity",
            f"Test {chip} Provisioner ICA",
            f"{chip} A01 GSP BROM",
            f"{chip} A01 GSP FMC LF",
        ]
        self.chain, self.keys = _chain(names, self.now, [tcb_info])
        self.leaf_key = self.keys[0]

    @property
    def root(self) -> x509.Certificate:
        return self.chain[-1]

    def report(
        self,
        nonce: bytes,
        *,
        measurements: dict[int, bytes] | None = None,
        feature_flag: int | None = None,
    ) -> bytes:
        """A signed SPDM 1.1 GET_MEASUREMENTS request+response, as NVML returns it
        (``feature_flag``: opaque FEATURE_FLAG 0 SPT, 1 MPT, 2 PPCIE; None: absent)."""
        values = measurements or self.measurements
        flag = [] if feature_flag is None else [(36, struct.pack("<H", feature_flag))]
        request = bytes([0x11, 0xE0, 0x01, 0xFF]) + nonce + b"\x00"
        record = b"".join(
            bytes([index, 0x01])
            + struct.pack("<H", 3 + len(v))
            + b"\x01"
            + struct.pack("<H", len(v))
            + v
            for index, v in sorted(values.items())
        )
        opaque = b"".join(
            struct.pack("<HH", kind, len(value)) + value
            for kind, value in [
                (3, DRIVER.encode() + b"\0"),
                (6, VBIOS_BYTES),
                (15, b"882\0"),
                (17, b"1010\0"),
                (18, b"0200\0"),
                (20, self.fwid),
                (35, b"GB100\0"),
                *flag,
            ]
        )
        response = (
            bytes([0x11, 0x60, 0x00, 0x00, len(values)])
            + len(record).to_bytes(3, "little")
            + record
            + os.urandom(32)
            + struct.pack("<H", len(opaque))
            + opaque
        )
        assert self.leaf_key is not None
        der = self.leaf_key.sign(request + response, ec.ECDSA(hashes.SHA384()))
        r, s = decode_dss_signature(der)
        return request + response + r.to_bytes(48, "big") + s.to_bytes(48, "big")

    def evidence(
        self,
        nonce: bytes,
        *,
        feature_flags: tuple[int | None, ...] = (None,),
        declared_arch: str | None = "",
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``nvidia`` evidence member (NVIDIA's NRAS request shape): one entry per
        feature flag; ``declared_arch`` "" declares this GPU's own, None omits ``arch``."""
        items = [
            {
                "evidence": base64.b64encode(
                    self.report(nonce, feature_flag=flag, **kwargs)
                ).decode(),
                "certificate": base64.b64encode(pem(self.chain)).decode(),
            }
            for flag in feature_flags
        ]
        arch = self.arch if declared_arch == "" else declared_arch
        return {**({"arch": arch} if arch is not None else {}), "evidence_list": items}


@dataclass
class RimAuthority:
    """Signs RIMs like NVIDIA's CoRIM chain: signer -> L3 -> CA -> root."""

    now: datetime
    chain: list[x509.Certificate] = field(default_factory=list)
    keys: list[ec.EllipticCurvePrivateKey] = field(default_factory=list)
    signer_key: ec.EllipticCurvePrivateKey | None = None

    def __post_init__(self) -> None:
        names = [
            "Test CoRIM signing Root CA",
            "Test Reference Value CA",
            "Test Reference Value L3",
            "Test RIM L4 Signer",
        ]
        self.chain, self.keys = _chain(names, self.now)
        self.signer_key = self.keys[0]

    @property
    def root(self) -> x509.Certificate:
        return self.chain[-1]

    def rim(self, version: str, golden: dict[int, bytes]) -> bytes:
        """A signed SWID tag; ``golden`` maps RIM index (0-based) to the expected value."""
        identity = etree.Element(
            f"{{{SWID_NS}}}SoftwareIdentity",
            nsmap={None: SWID_NS, "SHA384": SHA384_NS},
            name="GH100",
            tagId=os.urandom(8).hex(),
            version=version,
        )
        etree.SubElement(identity, f"{{{SWID_NS}}}Meta", colloquialVersion=version, product="GH100")
        payload = etree.SubElement(identity, f"{{{SWID_NS}}}Payload")
        for index, value in sorted(golden.items()):
            resource = etree.SubElement(
                payload,
                f"{{{SWID_NS}}}Resource",
                type="Measurement",
                index=str(index),
                active="True",
                alternatives="1",
                size=str(len(value)),
            )
            resource.set(f"{{{SHA384_NS}}}Hash0", value.hex())
        signer = XMLSigner(
            signature_algorithm=SignatureMethod.ECDSA_SHA384,
            digest_algorithm=DigestAlgorithm.SHA384,
            c14n_algorithm=CanonicalizationMethod.CANONICAL_XML_1_1,
        )
        assert self.signer_key is not None
        signed = signer.sign(identity, key=self.signer_key, cert=pem(self.chain[:-1]).decode())
        return bytes(etree.tostring(signed))


@dataclass
class SimulatedNras:
    """Issues NRAS-shaped detached EATs (ES384) under a test intermediate."""

    now: datetime
    issuer: str = "https://nras.test.invalid"
    kid: str = "nv-eat-kid-test-1"
    chain: list[x509.Certificate] = field(default_factory=list)
    key: ec.EllipticCurvePrivateKey | None = None

    def __post_init__(self) -> None:
        self.chain, keys = _chain(["Test NRAS Intermediate", "Test NRAS Signer"], self.now)
        self.key = keys[0]

    @property
    def intermediate(self) -> x509.Certificate:
        return self.chain[-1]

    def jwks(self) -> dict[str, Any]:
        assert self.key is not None
        x5c = [
            base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode()
            for c in self.chain
        ]
        return {"keys": [{**public_jwk(self.key.public_key()), "kid": self.kid, "x5c": x5c}]}

    def result(
        self, nonce: bytes, *, gpus: int = 1, measres: str = "success", driver: str = DRIVER
    ) -> list[Any]:
        issued = int(self.now.timestamp())
        times = {"iat": issued, "nbf": issued, "exp": issued + 3600, "iss": self.issuer}
        detached = {}
        for index in range(gpus):
            detached[f"GPU-{index}"] = self._sign(
                {
                    **times,
                    "eat_nonce": nonce.hex(),
                    "hwmodel": "GH100",
                    "dbgstat": "disabled",
                    "secboot": True,
                    "measres": measres,
                    "ueid": str(1000 + index),
                    "x-nvidia-gpu-driver-version": driver,
                    "x-nvidia-gpu-vbios-version": "96.00.9F.00.01",
                    "x-nvidia-gpu-attestation-report-cert-chain-validated": True,
                }
            )
        overall = self._sign(
            {
                **times,
                "sub": "NVIDIA-PLATFORM-ATTESTATION",
                "eat_nonce": nonce.hex(),
                "x-nvidia-overall-att-result": measres == "success",
                "submods": {
                    name: ["DIGEST", ["SHA-256", hashlib.sha256(token.encode()).hexdigest()]]
                    for name, token in detached.items()
                },
            }
        )
        return [["JWT", overall], detached]

    def _sign(self, claims: dict[str, Any]) -> str:
        assert self.key is not None
        return jwt.encode(claims, self.key, algorithm="ES384", headers={"kid": self.kid})


class OcspResponder:
    """Answers OCSP requests for a simulated GPU's chain (and any further chains, e.g. a RIM
    authority's), signed by each certificate's issuer or by a delegated responder.

    Knobs for RFC 6960 tests: ``sign_with_wrong_key``; ``stale`` (thisUpdate two hours ago,
    nextUpdate one hour ago); ``delegate`` = ``"with_eku"`` | ``"without_eku"`` (a responder
    certificate the issuer signed, with or without id-kp-OCSPSigning).
    """

    def __init__(
        self,
        gpu: SimulatedGpu,
        *,
        revoked_serials: frozenset[int] = frozenset(),
        extra_chains: list[tuple[list[x509.Certificate], list[ec.EllipticCurvePrivateKey]]]
        | None = None,
    ) -> None:
        self.gpu = gpu
        self.chains = [(gpu.chain, gpu.keys), *(extra_chains or [])]
        self.revoked = revoked_serials
        self.requests = 0
        self.sign_with_wrong_key = False
        self.stale = False
        self.delegate: str | None = None
        self.at: datetime | None = None  # thisUpdate; None: the wall clock at each answer

    def answer(self, der_request: bytes) -> bytes:
        self.requests += 1
        request = ocsp.load_der_ocsp_request(der_request)
        for chain, keys in self.chains:
            for index, cert in enumerate(chain[:-1]):
                if cert.serial_number == request.serial_number:
                    return self._response(cert, chain[index + 1], keys[index + 1])
        unauthorized = ocsp.OCSPResponseBuilder.build_unsuccessful(
            ocsp.OCSPResponseStatus.UNAUTHORIZED
        )
        return unauthorized.public_bytes(serialization.Encoding.DER)

    def _response(self, cert: x509.Certificate, issuer: x509.Certificate, issuer_key: Any) -> bytes:
        revoked = cert.serial_number in self.revoked
        now = (self.at or datetime.now(UTC)) - (timedelta(hours=2) if self.stale else timedelta(0))
        builder = ocsp.OCSPResponseBuilder().add_response(
            cert=cert,
            issuer=issuer,
            algorithm=hashes.SHA384(),
            cert_status=ocsp.OCSPCertStatus.REVOKED if revoked else ocsp.OCSPCertStatus.GOOD,
            this_update=now,
            next_update=now + timedelta(hours=1),
            revocation_time=now - timedelta(hours=1) if revoked else None,
            revocation_reason=x509.ReasonFlags.key_compromise if revoked else None,
        )
        signer_cert, signer_key = issuer, issuer_key
        if self.delegate is not None:
            signer_key = ec.generate_private_key(ec.SECP384R1())
            extensions: list[x509.ExtensionType] = []
            if self.delegate == "with_eku":
                extensions.append(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.OCSP_SIGNING]))
            signer_cert = _cert(
                "Test OCSP Responder",
                signer_key,
                (issuer.subject, issuer_key),
                now=datetime.now(UTC),
                ca=False,
                extensions=extensions,
            )
            builder = builder.certificates([signer_cert])
        encoding = ocsp.OCSPResponderEncoding.HASH
        if self.sign_with_wrong_key:
            # A forgery: names the real issuer as responder, signed with another key (an
            # impostor certificate carrying the issuer's name lets the builder sign).
            signer_key = ec.generate_private_key(ec.SECP384R1())
            signer_cert = (
                x509.CertificateBuilder()
                .subject_name(issuer.subject)
                .issuer_name(issuer.subject)
                .public_key(signer_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(issuer.not_valid_before_utc)
                .not_valid_after(issuer.not_valid_after_utc)
                .sign(signer_key, hashes.SHA384())
            )
            encoding = ocsp.OCSPResponderEncoding.NAME
        builder = builder.responder_id(encoding, signer_cert)
        response = builder.sign(signer_key, hashes.SHA384())
        return response.public_bytes(serialization.Encoding.DER)


@dataclass
class SimulatedIta:
    """Issues Intel Trust Authority-shaped TDX tokens (PS384) under a test root."""

    now: datetime
    issuer: str = "https://portal.trustauthority.test.invalid"
    chain: list[x509.Certificate] = field(default_factory=list)
    key: Any = None
    kid: str = ""

    def __post_init__(self) -> None:
        keys = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(3)]
        names = ["Test ITA Root CA", "Test ITA ATS Signing CA", "Test ITA Token Signing"]
        certs: list[x509.Certificate] = []
        for depth, (cn, key) in enumerate(zip(names, keys, strict=True)):
            issuer = None if depth == 0 else (certs[-1].subject, keys[depth - 1])
            certs.append(_cert(cn, key, issuer, now=self.now, ca=depth < 2))  # type: ignore[arg-type]
        self.chain = certs[::-1]
        self.key = keys[-1]
        self.kid = hashlib.sha384(
            self.chain[0].public_bytes(serialization.Encoding.DER)
        ).hexdigest()

    @property
    def root(self) -> x509.Certificate:
        return self.chain[-1]

    def jwks(self) -> dict[str, Any]:
        x5c = [
            base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode()
            for c in self.chain
        ]
        entries = []
        for alg in ("PS384", "RS256"):  # Intel publishes every key twice
            entries.append(
                {**public_jwk(self.key.public_key()), "kid": self.kid, "alg": alg, "x5c": x5c}
            )
        return {"keys": entries}

    def token(
        self,
        held_data: bytes,
        *,
        debug: bool = False,
        mrtd: str = "ab" * 48,
        nvgpu: dict[str, Any] | None = None,
    ) -> str:
        val, iat = os.urandom(32), self.now.isoformat().encode()
        issued = int(self.now.timestamp())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "iat": issued,
            "nbf": issued,
            "exp": issued + 300,
            "attester_type": "TDX",
            "attester_tcb_status": "UpToDate",
            "dbgstat": "disabled",
            "attester_held_data": base64.b64encode(held_data).decode(),
            "verifier_nonce": {
                "val": base64.b64encode(val).decode(),
                "iat": base64.b64encode(iat).decode(),
                "signature": "c2ln",
            },
            "tdx_report_data": hashlib.sha512(val + iat + held_data).hexdigest(),
            "tdx_mrtd": mrtd,
            "tdx_td_attributes_debug": debug,
            "tdx_is_debuggable": debug,
            **{f"tdx_rtmr{i}": "00" * 48 for i in range(4)},
        }
        if nvgpu is not None:
            claims["nvgpu"] = {**nvgpu, "eat_nonce": hashlib.sha256(val + iat).hexdigest()}
        return jwt.encode(
            claims,
            self.key,
            algorithm="PS384",
            headers={"kid": self.kid, "jku": "https://portal.trustauthority.intel.com/certs"},
        )
