"""SEV-SNP test material: the real vectors of ``tests/fixtures/raw/snp/`` (PROVENANCE.md), a
certificate hierarchy of our own shaped like AMD's (to sign reports the tests make), and the
serde form the guest's attestation agent writes a report in (``sev`` 6.3.1)."""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from broker.attestation.raw.snp import HWID_BYTES, HWID_OID, TCB_OIDS, SnpTrust
from broker.attestation.raw.snp_report import SIGNED_BYTES, Tcb, decode_tcb

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "raw" / "snp"
# Inside every fixture certificate's validity (PROVENANCE.md) but omne's
AT = datetime(2025, 6, 1, tzinfo=UTC)
AT_OMNE = datetime(2026, 9, 1, tzinfo=UTC)


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def milan_report() -> bytes:
    """virtee/sev's version 2 Milan report (its file is hex text)."""
    return bytes.fromhex(fixture("virtee_report_milan.hex").decode().strip())


def guest_evidence() -> dict[str, Any]:
    """Trustee's capture of the guest's evidence object (Genoa, version 3, VCEK attached)."""
    value: dict[str, Any] = json.loads(fixture("trustee_evidence.json"))
    return value


def _pss() -> padding.PSS:
    return padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Engineering"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Not Advanced Micro Devices"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _der_int(value: int) -> bytes:
    body = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big")
    return bytes([0x02, len(body)]) + body


@dataclass(frozen=True)
class FakeAmd:
    """ARK → ASK of our own for ``product``: RSA-PSS like AMD's (2048-bit, for speed)."""

    product: str
    ark: x509.Certificate
    ask: x509.Certificate
    ask_key: rsa.RSAPrivateKey

    def trust(self) -> SnpTrust:
        return SnpTrust(roots={self.product: self.ark}, intermediates=(self.ask,))

    def vcek(
        self, tcb: Tcb, chip_id: bytes, *, name: str = "SEV-VCEK", der_hwid: bool = False
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """A VCEK certified for ``tcb`` and ``chip_id`` (its first 8 bytes on Turin), the
        hardware id raw as older VCEKs hold it or (``der_hwid``) as a DER OCTET STRING."""
        key = ec.generate_private_key(ec.SECP384R1())
        builder = _builder(_name(name), self.ask.subject, key.public_key())
        for field, oid in TCB_OIDS.items():
            value = getattr(tcb, field)
            if value is not None:
                ext = x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), _der_int(value))
                builder = builder.add_extension(ext, critical=False)
        hwid = chip_id[: HWID_BYTES[self.product]]
        hwid = bytes([0x04, len(hwid)]) + hwid if der_hwid else hwid
        builder = builder.add_extension(
            x509.UnrecognizedExtension(x509.ObjectIdentifier(HWID_OID), hwid), critical=False
        )
        cert = builder.sign(self.ask_key, hashes.SHA384(), rsa_padding=_pss())
        return cert, key


def _builder(subject: x509.Name, issuer: x509.Name, key: Any) -> x509.CertificateBuilder:
    start = datetime(2020, 1, 1, tzinfo=UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + timedelta(days=365 * 30))
    )


@functools.cache
def fake_amd(product: str) -> FakeAmd:
    ark_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ask_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ark_name = _name(f"ARK-{product}")
    ark = _builder(ark_name, ark_name, ark_key.public_key()).sign(
        ark_key, hashes.SHA384(), rsa_padding=_pss()
    )
    ask = _builder(_name(f"SEV-{product}"), ark_name, ask_key.public_key()).sign(
        ark_key, hashes.SHA384(), rsa_padding=_pss()
    )
    return FakeAmd(product=product, ark=ark, ask=ask, ask_key=ask_key)


def signed(raw: bytes, key: ec.EllipticCurvePrivateKey) -> bytes:
    """``raw`` with its signature replaced by ``key``'s over bytes 0x000-0x29F."""
    r, s = decode_dss_signature(key.sign(raw[:SIGNED_BYTES], ec.ECDSA(hashes.SHA384())))
    signature = r.to_bytes(72, "little") + s.to_bytes(72, "little")
    return raw[:SIGNED_BYTES] + signature + raw[SIGNED_BYTES + len(signature) :]


def patched(raw: bytes, offset: int, value: bytes) -> bytes:
    return raw[:offset] + value + raw[offset + len(value) :]


def serde_object(raw: bytes, product: str) -> dict[str, Any]:
    """What ``serde_json::to_value(&AttestationReport::from_bytes(raw))`` writes (sev 6.3.1)."""

    def arr(at: int, size: int) -> list[int]:
        return list(raw[at : at + size])

    def tcb(at: int) -> dict[str, Any]:
        return decode_tcb(raw[at : at + 8], product).as_json()

    def version(at: int) -> dict[str, int]:
        return {"major": raw[at + 2], "minor": raw[at + 1], "build": raw[at]}

    number, guest_svn, policy = struct.unpack_from("<IIQ", raw, 0)
    v3 = number >= 3
    return {
        "version": number,
        "guest_svn": guest_svn,
        "policy": policy,
        "family_id": arr(0x10, 16),
        "image_id": arr(0x20, 16),
        "vmpl": struct.unpack_from("<I", raw, 0x30)[0],
        "sig_algo": struct.unpack_from("<I", raw, 0x34)[0],
        "current_tcb": tcb(0x38),
        "plat_info": struct.unpack_from("<Q", raw, 0x40)[0],
        "key_info": struct.unpack_from("<I", raw, 0x48)[0],
        "report_data": arr(0x50, 64),
        "measurement": arr(0x90, 48),
        "host_data": arr(0xC0, 32),
        "id_key_digest": arr(0xE0, 48),
        "author_key_digest": arr(0x110, 48),
        "report_id": arr(0x140, 32),
        "report_id_ma": arr(0x160, 32),
        "reported_tcb": tcb(0x180),
        "cpuid_fam_id": raw[0x188] if v3 else None,
        "cpuid_mod_id": raw[0x189] if v3 else None,
        "cpuid_step": raw[0x18A] if v3 else None,
        "chip_id": arr(0x1A0, 64),
        "committed_tcb": tcb(0x1E0),
        "current": version(0x1E8),
        "committed": version(0x1EC),
        "launch_tcb": tcb(0x1F0),
        "launch_mit_vector": None,
        "current_mit_vector": None,
        "signature": {"r": arr(0x2A0, 72), "s": arr(0x2A0 + 72, 72)},
    }
