"""SPDM 1.1 GET_MEASUREMENTS attestation report as returned by NVML. Pure parsing.

Layout (docs/evidence.md, all integers little-endian): the report is the 37-byte request
followed by the response. The signature's position is computed from the structure
(``42 + L1 + L2``), never taken as "the last 96 bytes": a real report carries a trailing byte.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from broker.core.errors import AttestationError, ErrorCode

REQUEST_BYTES = 37
SIGNATURE_BYTES = 96  # ECDSA P-384 raw r || s (Hopper and Blackwell)
NONCE_BYTES = 32
MAX_TRAILING_BYTES = 16
MAX_REPORT_BYTES = 64 * 1024
SPDM_VERSION = 0x11
GET_MEASUREMENTS = 0xE0
MEASUREMENTS = 0x60
# Opaque data types used here (docs/evidence.md table)
OPAQUE_DRIVER_VERSION = 3
OPAQUE_VBIOS_VERSION = 6
OPAQUE_CHIP_SKU = 15
OPAQUE_PROJECT = 17
OPAQUE_PROJECT_SKU = 18
OPAQUE_FWID = 20
OPAQUE_CHIP_INFO = 35
OPAQUE_FEATURE_FLAG = 36


def _malformed(message: str) -> AttestationError:
    return AttestationError(f"GPU attestation report: {message}", code=ErrorCode.EVIDENCE_MALFORMED)


@dataclass(frozen=True)
class SpdmReport:
    request_nonce: bytes
    measurements: Mapping[int, bytes]  # SPDM block index (1-based) -> measurement value
    opaque: Mapping[int, bytes]
    signed_bytes: bytes
    signature: bytes  # raw r || s

    @property
    def driver_version(self) -> str:
        return (
            self.opaque.get(OPAQUE_DRIVER_VERSION, b"")
            .split(b"\0", 1)[0]
            .decode("ascii", "replace")
        )

    @property
    def vbios_version(self) -> str:
        raw = self.opaque.get(OPAQUE_VBIOS_VERSION, b"")
        if len(raw) != 8:
            return ""
        # NVIDIA's format: read as little-endian, hex; t = v[8:16] + v[6:8]; pairs joined by '.'
        value = f"{int.from_bytes(raw, 'little'):016x}"
        text = (value[8:16] + value[6:8]).upper()
        return ".".join(text[i : i + 2] for i in range(0, len(text), 2))

    def ascii_field(self, kind: int) -> str:
        return self.opaque.get(kind, b"").split(b"\0", 1)[0].decode("ascii", "replace")

    @property
    def fwid(self) -> bytes:
        return self.opaque.get(OPAQUE_FWID, b"")


def parse_report(report: bytes) -> SpdmReport:
    """Parse request and response; locate the signature from the structure.

    Raises:
        AttestationError: ``evidence_malformed`` naming the field.
    """
    if not REQUEST_BYTES + 42 + SIGNATURE_BYTES <= len(report) <= MAX_REPORT_BYTES:
        raise _malformed("wrong length")
    request, response = report[:REQUEST_BYTES], report[REQUEST_BYTES:]
    if request[0] != SPDM_VERSION or request[1] != GET_MEASUREMENTS or request[2] & 0x01 == 0:
        raise _malformed("request is not a signed SPDM 1.1 GET_MEASUREMENTS")
    if response[0] != SPDM_VERSION or response[1] != MEASUREMENTS:
        raise _malformed("response is not SPDM 1.1 MEASUREMENTS")
    blocks = response[4]
    record_length = int.from_bytes(response[5:8], "little")
    record_end = 8 + record_length
    if record_end + NONCE_BYTES + 2 > len(response):
        raise _malformed("measurement record overruns the report")
    measurements = _measurement_blocks(response[8:record_end], blocks)
    opaque_length = struct.unpack_from("<H", response, record_end + NONCE_BYTES)[0]
    opaque_start = record_end + NONCE_BYTES + 2
    signature_at = opaque_start + opaque_length
    trailing = response[signature_at + SIGNATURE_BYTES :]
    if signature_at + SIGNATURE_BYTES > len(response):
        raise _malformed("signature overruns the report")
    if len(trailing) > MAX_TRAILING_BYTES or any(trailing):
        raise _malformed("unexpected bytes after the signature")
    return SpdmReport(
        request_nonce=request[4 : 4 + NONCE_BYTES],
        measurements=measurements,
        opaque=_opaque_fields(response[opaque_start:signature_at]),
        signed_bytes=request + response[:signature_at],
        signature=response[signature_at : signature_at + SIGNATURE_BYTES],
    )


def _measurement_blocks(record: bytes, count: int) -> dict[int, bytes]:
    blocks: dict[int, bytes] = {}
    offset = 0
    for _ in range(count):
        if offset + 4 > len(record):
            raise _malformed("measurement block header overruns the record")
        index, spec, size = (
            record[offset],
            record[offset + 1],
            int.from_bytes(record[offset + 2 : offset + 4], "little"),
        )
        body = record[offset + 4 : offset + 4 + size]
        if spec != 0x01 or len(body) != size or size < 3:
            raise _malformed(f"measurement block {index} is not a DMTF measurement")
        value_size = int.from_bytes(body[1:3], "little")
        if value_size != size - 3 or index in blocks:
            raise _malformed(f"measurement block {index} has an inconsistent size")
        blocks[index] = body[3:]
        offset += 4 + size
    if offset != len(record):
        raise _malformed("measurement record length does not match its blocks")
    return blocks


def _opaque_fields(data: bytes) -> dict[int, bytes]:
    fields: dict[int, bytes] = {}
    offset = 0
    while offset < len(data):
        if offset + 4 > len(data):
            raise _malformed("opaque data field header overruns")
        kind, size = struct.unpack_from("<HH", data, offset)
        value = data[offset + 4 : offset + 4 + size]
        if len(value) != size:
            raise _malformed(f"opaque data field {kind} overruns")
        fields.setdefault(kind, value)
        offset += 4 + size
    return fields


def verify_signature(report: SpdmReport, key: ec.EllipticCurvePublicKey) -> None:
    """ECDSA P-384 / SHA-384 over request || response-before-signature.

    Raises:
        AttestationError: ``evidence_signature_invalid``.
    """
    if key.curve.name != "secp384r1":
        raise AttestationError(
            "GPU attestation key is not P-384", code=ErrorCode.EVIDENCE_SIGNATURE_INVALID
        )
    r = int.from_bytes(report.signature[:48], "big")
    s = int.from_bytes(report.signature[48:], "big")
    try:
        key.verify(encode_dss_signature(r, s), report.signed_bytes, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature as exc:
        raise AttestationError(
            "GPU attestation report signature does not verify",
            code=ErrorCode.EVIDENCE_SIGNATURE_INVALID,
        ) from exc
