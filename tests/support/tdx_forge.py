"""A test PKI shaped like Intel's SGX PKI, and TDX quotes and DCAP collateral signed under it.

Intel signs no debug TD, no Revoked platform and no quote for a test's report data, so those
paths are tested on evidence forged here: fixed keys (derived from small integers) and fixed
times, the certificate profiles and structures of the real samples (tests/fixtures/raw/tdx/):
root → PCK Processor CA → PCK leaf carrying the Intel SGX extension (FMSPC, CPU SVN, PCE SVN);
root → TCB signer for the TCB info and QE identity; a CRL from the root and from the PCK CA.
The names copy Intel's, so a forged chain differs from the real one only by its keys — which is
what "a quote from another root" means. ``dcap-qvl`` verifies these with the forged root passed
as its anchor; the broker verifies them only when a test pins that root.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

ISSUED = datetime(2025, 1, 1, tzinfo=UTC)
NEXT_UPDATE = datetime(2025, 2, 1, tzinfo=UTC)
INSIDE = datetime(2025, 1, 15, tzinfo=UTC)  # a time inside the forged collateral's window
SGX_OID = "1.2.840.113741.1.13.1"
QE_MRSIGNER = bytes.fromhex("dc9e2a7c6f948f17474e34a7fc43ed030f7c1563f1babddf6340c82e0e54a8c5")
INTEL_QE_VENDOR_ID = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
SEPT_VE_DISABLE = bytes.fromhex("0000001000000000")  # TD attributes bit 28, as real TDs run
DEBUG_TD = bytes.fromhex("0100001000000000")
FMSPC = "00906EA10000"
CPU_SVN = bytes([3, 3, 2, 2, 4, 1, 0, 5] + [0] * 8)
TEE_TCB_SVN = bytes([6, 1, 3] + [0] * 13)  # TDX module ISVSVN 6, module version 1


def _key(seed: int) -> ec.EllipticCurvePrivateKey:
    return ec.derive_private_key(0x5EED0000 + seed, ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Intel Corporation"),
            x509.NameAttribute(NameOID.LOCALITY_NAME, "Santa Clara"),
            x509.NameAttribute(NameOID.STATE_OR_PROVINCE_NAME, "CA"),
            x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
        ]
    )


@dataclass(frozen=True)
class ForgedPki:
    root_key: ec.EllipticCurvePrivateKey
    root: x509.Certificate
    pck_ca_key: ec.EllipticCurvePrivateKey
    pck_ca: x509.Certificate
    pck_key: ec.EllipticCurvePrivateKey
    pck: x509.Certificate
    tcb_key: ec.EllipticCurvePrivateKey
    tcb_signer: x509.Certificate

    @property
    def root_pem(self) -> bytes:
        return self.root.public_bytes(serialization.Encoding.PEM)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    serial: int,
    extra: x509.ExtensionType | None = None,
) -> x509.Certificate:
    usage = dict.fromkeys(
        (
            "content_commitment",
            "key_encipherment",
            "data_encipherment",
            "key_agreement",
            "encipher_only",
            "decipher_only",
        ),
        False,
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer.subject if issuer else _name(subject))
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(datetime(2018, 5, 21, tzinfo=UTC))
        .not_valid_after(datetime(2040, 5, 21, tzinfo=UTC))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
        .add_extension(
            x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca, crl_sign=ca, **usage), True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    if extra is not None:
        builder = builder.add_extension(extra, False)
    return builder.sign(issuer_key, hashes.SHA256())


def forge_pki(seed: int = 1, *, fmspc: str = FMSPC, cpu_svn: bytes = CPU_SVN) -> ForgedPki:
    """Root, PCK Processor CA, PCK leaf (with the SGX extension) and TCB signer."""
    root_key, ca_key, pck_key, tcb_key = (_key(seed * 10 + i) for i in range(4))
    root = _cert("Intel SGX Root CA", root_key, None, root_key, ca=True, serial=1)
    pck_ca = _cert("Intel SGX PCK Processor CA", ca_key, root, root_key, ca=True, serial=2)
    sgx = x509.UnrecognizedExtension(
        x509.ObjectIdentifier(SGX_OID), _sgx_extension(bytes.fromhex(fmspc), cpu_svn, 13)
    )
    pck = _cert("Intel SGX PCK Certificate", pck_key, pck_ca, ca_key, ca=False, serial=3, extra=sgx)
    tcb = _cert("Intel SGX TCB Signing", tcb_key, root, root_key, ca=False, serial=4)
    return ForgedPki(root_key, root, ca_key, pck_ca, pck_key, pck, tcb_key, tcb)


# DER, by hand: the SGX extension is a SEQUENCE of (OID, value) pairs (Intel PCK Certificate
# and CRL Profile, 1.3.5).
def _tlv(tag: int, content: bytes) -> bytes:
    size = len(content)
    if size < 0x80:
        return bytes([tag, size]) + content
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + content


def _oid(dotted: str) -> bytes:
    first, second, *rest = (int(part) for part in dotted.split("."))
    body = bytearray([40 * first + second])
    for arc in rest:
        value, chunk = arc, [arc & 0x7F]
        while value > 0x7F:
            value >>= 7
            chunk.append(0x80 | (value & 0x7F))
        body += bytes(reversed(chunk))
    return _tlv(0x06, bytes(body))


def _pair(oid: str, value: bytes) -> bytes:
    return _tlv(0x30, _oid(oid) + value)


def _integer(value: int) -> bytes:
    return _tlv(0x02, value.to_bytes(value.bit_length() // 8 + 1, "big"))


def _sgx_extension(fmspc: bytes, cpu_svn: bytes, pce_svn: int) -> bytes:
    components = b"".join(_pair(f"{SGX_OID}.2.{i + 1}", _integer(cpu_svn[i])) for i in range(16))
    tcb = components + _pair(f"{SGX_OID}.2.17", _integer(pce_svn))
    tcb += _pair(f"{SGX_OID}.2.18", _tlv(0x04, cpu_svn))
    return _tlv(
        0x30,
        _pair(f"{SGX_OID}.1", _tlv(0x04, bytes(range(16))))  # PPID
        + _pair(f"{SGX_OID}.2", _tlv(0x30, tcb))
        + _pair(f"{SGX_OID}.3", _tlv(0x04, b"\x00\x00"))  # PCE-ID
        + _pair(f"{SGX_OID}.4", _tlv(0x04, fmspc))
        + _pair(f"{SGX_OID}.5", _tlv(0x0A, b"\x00")),  # SGX type: standard
    )


def _raw_signature(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def _raw_public(key: ec.EllipticCurvePrivateKey) -> bytes:
    point = key.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    return point[1:]


@dataclass(frozen=True)
class QuoteSpec:
    version: int = 4
    body_type: int = 2  # v5: 2 TDREPORT 1.0, 3 TDREPORT 1.5
    td_attributes: bytes = SEPT_VE_DISABLE
    report_data: bytes = bytes(64)
    mrtd: bytes = bytes(range(48))
    tee_tcb_svn: bytes = TEE_TCB_SVN
    mrconfigid: bytes = bytes(48)  # CoCo: the init-data digest, zero-padded


def forge_quote(pki: ForgedPki, spec: QuoteSpec = QuoteSpec()) -> bytes:
    """A TDX quote signed by a fresh attestation key, its QE report signed by the PCK key."""
    header = struct.pack("<HHIHH", spec.version, 2, 0x81, 0, 0) + INTEL_QE_VENDOR_ID
    header += bytes(20)
    body = spec.tee_tcb_svn + bytes(48 * 2 + 8) + spec.td_attributes
    body += bytes.fromhex("e702060000000000") + spec.mrtd + spec.mrconfigid + bytes(48 * 2)
    body += b"".join(bytes([0x40 + i]) * 48 for i in range(4)) + spec.report_data
    if spec.body_type == 3:
        body += spec.tee_tcb_svn + bytes(48)
    if spec.version == 5:
        header += struct.pack("<HI", spec.body_type, len(body))
    attestation_key = _key(99)
    auth_data = bytes(range(32))
    qe_report = _qe_report(hashlib.sha256(_raw_public(attestation_key) + auth_data).digest())
    chain = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in _pck_chain(pki))
    inner = struct.pack("<HI", 5, len(chain)) + chain
    qe_data = qe_report + _raw_signature(pki.pck_key, qe_report)
    qe_data += struct.pack("<H", len(auth_data)) + auth_data + inner
    signed = header + body
    signature_data = _raw_signature(attestation_key, signed) + _raw_public(attestation_key)
    signature_data += struct.pack("<HI", 6, len(qe_data)) + qe_data
    return signed + struct.pack("<I", len(signature_data)) + signature_data


def _pck_chain(pki: ForgedPki) -> tuple[x509.Certificate, ...]:
    return (pki.pck, pki.pck_ca, pki.root)


def _qe_report(report_data_prefix: bytes) -> bytes:
    report = bytes.fromhex("0303191b04ff00060000000000000000") + bytes(4) + bytes(28)
    report += bytes.fromhex("11000000000000000000000000000000") + bytes(32) + bytes(32)
    report += QE_MRSIGNER + bytes(96) + struct.pack("<HH", 2, 4) + bytes(60)
    return report + report_data_prefix + bytes(32)


@dataclass(frozen=True)
class CollateralSpec:
    fmspc: str = FMSPC
    tcb_status: str = "UpToDate"
    advisory_ids: tuple[str, ...] = ()
    issued: datetime = ISSUED
    next_update: datetime = NEXT_UPDATE
    crl_next_update: datetime = NEXT_UPDATE
    revoked_serials: tuple[int, ...] = ()  # PCK CA's CRL entries
    extra: dict[str, Any] = field(default_factory=dict)


def forge_collateral(pki: ForgedPki, spec: CollateralSpec = CollateralSpec()) -> dict[str, str]:
    """Collateral in ``dcap-qvl``'s JSON form (CRLs and signatures in hex)."""
    level: dict[str, Any] = {
        "tcb": {
            "sgxtcbcomponents": [{"svn": svn} for svn in CPU_SVN],
            "pcesvn": 13,
            "tdxtcbcomponents": [{"svn": svn} for svn in TEE_TCB_SVN[:3]] + [{"svn": 0}] * 13,
        },
        "tcbDate": "2024-11-13T00:00:00Z",
        "tcbStatus": spec.tcb_status,
    }
    if spec.advisory_ids:
        level["advisoryIDs"] = list(spec.advisory_ids)
    tcb_info = {
        "id": "TDX",
        "version": 3,
        "issueDate": _time(spec.issued),
        "nextUpdate": _time(spec.next_update),
        "fmspc": spec.fmspc,
        "pceId": "0000",
        "tcbType": 0,
        "tcbEvaluationDataNumber": 17,
        "tdxModule": {"mrsigner": "00" * 48, "attributes": "00" * 8, "attributesMask": "FF" * 8},
        "tdxModuleIdentities": [
            {
                "id": "TDX_01",
                "mrsigner": "00" * 48,
                "attributes": "00" * 8,
                "attributesMask": "FF" * 8,
                "tcbLevels": [
                    {
                        "tcb": {"isvsvn": 4},
                        "tcbDate": "2024-03-13T00:00:00Z",
                        "tcbStatus": "UpToDate",
                    }
                ],
            }
        ],
        "tcbLevels": [level],
        **spec.extra,
    }
    qe_identity = {
        "id": "TD_QE",
        "version": 2,
        "issueDate": _time(spec.issued),
        "nextUpdate": _time(spec.next_update),
        "tcbEvaluationDataNumber": 17,
        "miscselect": "00000000",
        "miscselectMask": "FFFFFFFF",
        "attributes": "11000000000000000000000000000000",
        "attributesMask": "FBFFFFFFFFFFFFFF0000000000000000",
        "mrsigner": QE_MRSIGNER.hex().upper(),
        "isvprodid": 2,
        "tcbLevels": [
            {"tcb": {"isvsvn": 4}, "tcbDate": "2024-03-13T00:00:00Z", "tcbStatus": "UpToDate"}
        ],
    }
    tcb_text = json.dumps(tcb_info, separators=(",", ":"))
    qe_text = json.dumps(qe_identity, separators=(",", ":"))
    tcb_chain = _pem(pki.tcb_signer, pki.root)
    return {
        "pck_crl_issuer_chain": _pem(pki.pck_ca, pki.root),
        "root_ca_crl": _crl(pki.root, pki.root_key, spec, ()).hex(),
        "pck_crl": _crl(pki.pck_ca, pki.pck_ca_key, spec, spec.revoked_serials).hex(),
        "tcb_info_issuer_chain": tcb_chain,
        "tcb_info": tcb_text,
        "tcb_info_signature": _raw_signature(pki.tcb_key, tcb_text.encode()).hex(),
        "qe_identity_issuer_chain": tcb_chain,
        "qe_identity": qe_text,
        "qe_identity_signature": _raw_signature(pki.tcb_key, qe_text.encode()).hex(),
    }


def _time(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _pem(*certs: x509.Certificate) -> str:
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode() for c in certs)


def _crl(
    issuer: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    spec: CollateralSpec,
    revoked: tuple[int, ...],
) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.subject)
        .last_update(spec.issued - timedelta(days=1))
        .next_update(spec.crl_next_update)
        .add_extension(x509.CRLNumber(1), False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), False)
    )
    for serial in revoked:
        entry = x509.RevokedCertificateBuilder().serial_number(serial)
        builder = builder.add_revoked_certificate(entry.revocation_date(spec.issued).build())
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)
