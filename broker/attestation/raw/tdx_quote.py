"""Intel TDX quotes (DCAP, versions 4 and 5) parsed from their structure. Pure; nothing verified.

Layout (Intel TDX DCAP Quote Generation Library and Quote Verification Library, "Quote Format"
appendix; the same as ``dcap-qvl``'s ``quote.rs``), all integers little-endian:

* header, 48 bytes: version u16, attestation key type u16, TEE type u32, QE SVN u16, PCE SVN u16,
  QE vendor id (16), user data (20);
* v4: the TD report body (TDREPORT 1.0, 584 bytes); v5: body type u16, body size u32, then the
  body (type 2: TDREPORT 1.0, 584 bytes; type 3: TDREPORT 1.5, 648 bytes);
* signature data length u32, then: the quote's ECDSA P-256 signature (r‖s, 64), the attestation
  public key (x‖y, 64) and certification data of type 6 (QE report certification data): the QE
  report (384), its signature by the PCK key (64), QE authentication data (u16 size + bytes)
  and inner certification data (type u16, size u32, bytes; type 5 = the PCK chain in PEM).

The attestation key signs the header and the body as they stand in the quote (``signed``);
the PCK key signs the QE report, whose report data commits to the attestation key and the QE
authentication data. Every size is checked against what is left; after the signature data
only zero bytes may follow (quotes come padded to their buffer: dcap-qvl's v4 sample has 70).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from broker.core.errors import AttestationError, ErrorCode

MAX_QUOTE_BYTES = 32 * 1024  # a real quote is about 5 KiB, most of it the PEM chain
HEADER_BYTES = 48
TEE_TYPE_TDX = 0x81
ATTESTATION_KEY_ECDSA_P256 = 2
INTEL_QE_VENDOR_ID = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
BODY_TD10, BODY_TD15 = 2, 3  # v5 body types (1 is an SGX enclave report)
BODY_SIZES = {BODY_TD10: 584, BODY_TD15: 648}
CERT_DATA_QE_REPORT = 6
CERT_DATA_PCK_CHAIN = 5
QE_REPORT_BYTES = 384
QE_AUTH_DATA_BYTES = 32  # dcap-qvl and Intel's QVL require exactly this
# TDREPORT 1.0 fields in order: (name, size)
TD10_FIELDS = (
    ("tee_tcb_svn", 16),
    ("mrseam", 48),
    ("mrsignerseam", 48),
    ("seam_attributes", 8),
    ("td_attributes", 8),
    ("xfam", 8),
    ("mrtd", 48),
    ("mrconfigid", 48),
    ("mrowner", 48),
    ("mrownerconfig", 48),
    ("rtmr0", 48),
    ("rtmr1", 48),
    ("rtmr2", 48),
    ("rtmr3", 48),
    ("report_data", 64),
)
TD15_FIELDS = (("tee_tcb_svn2", 16), ("mrservicetd", 48))


@dataclass(frozen=True)
class TdxQuote:
    """A TDX quote as it parsed; ``body`` maps each TD report field to its bytes.

    ``signed`` is the region the attestation key signed (header and body); the offsets of the
    QE report and its signature are kept for tests that mutate them.
    """

    raw: bytes
    version: int
    body_type: int  # BODY_TD10 or BODY_TD15 (v4 quotes carry TDREPORT 1.0)
    qe_svn: int
    pce_svn: int
    user_data: bytes
    body: dict[str, bytes]
    signed: bytes
    signature: bytes
    attestation_key: bytes
    qe_report: bytes
    qe_report_signature: bytes
    qe_auth_data: bytes
    pck_chain_pem: bytes
    qe_report_offset: int

    @property
    def report_data(self) -> bytes:
        return self.body["report_data"]

    @property
    def rtmrs(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (self.body["rtmr0"], self.body["rtmr1"], self.body["rtmr2"], self.body["rtmr3"])

    @property
    def debug(self) -> bool:
        """TUD.DEBUG: bit 0 of TD attributes (Intel TDX Module ABI, TDREPORT ATTRIBUTES)."""
        return bool(self.body["td_attributes"][0] & 0x01)


def _malformed(problem: str) -> AttestationError:
    return AttestationError(f"TDX quote: {problem}", code=ErrorCode.TDX_QUOTE_MALFORMED)


class _Reader:
    """Reads fields in order; running past the end is a malformed quote, never an IndexError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int, what: str) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise _malformed(f"{what} runs past the end of the quote")
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk

    def u16(self, what: str) -> int:
        value: int = struct.unpack("<H", self.take(2, what))[0]
        return value

    def u32(self, what: str) -> int:
        value: int = struct.unpack("<I", self.take(4, what))[0]
        return value


def parse_quote(raw: bytes) -> TdxQuote:
    """Parse a TDX ECDSA quote (v4 or v5) with the PCK chain embedded.

    Raises:
        AttestationError: ``tdx_quote_malformed`` for anything that is not such a quote.
    """
    if len(raw) > MAX_QUOTE_BYTES:
        raise _malformed(f"larger than {MAX_QUOTE_BYTES} bytes")
    reader = _Reader(raw)
    version = reader.u16("version")
    key_type = reader.u16("attestation key type")
    tee_type = reader.u32("TEE type")
    qe_svn = reader.u16("QE SVN")
    pce_svn = reader.u16("PCE SVN")
    vendor = reader.take(16, "QE vendor id")
    user_data = reader.take(20, "user data")
    if version not in (4, 5):
        raise _malformed(f"version {version} is not 4 or 5 (TDX)")
    if tee_type != TEE_TYPE_TDX:
        raise _malformed(f"TEE type {tee_type:#x} is not TDX (0x81)")
    if key_type != ATTESTATION_KEY_ECDSA_P256:
        raise _malformed(f"attestation key type {key_type} is not ECDSA P-256 (2)")
    if vendor != INTEL_QE_VENDOR_ID:
        raise _malformed("QE vendor id is not Intel's")
    body_type = BODY_TD10
    if version == 5:
        body_type = reader.u16("body type")
        size = reader.u32("body size")
        if body_type not in BODY_SIZES:
            raise _malformed(f"v5 body type {body_type} is not a TD report (2 or 3)")
        if size != BODY_SIZES[body_type]:
            raise _malformed(f"v5 body size {size} is not {BODY_SIZES[body_type]}")
    fields = TD10_FIELDS + (TD15_FIELDS if body_type == BODY_TD15 else ())
    body = {name: reader.take(size, name) for name, size in fields}
    signed_length = reader.at
    signature_data = reader.take(reader.u32("signature data length"), "signature data")
    if raw[reader.at :].strip(b"\x00"):  # real quotes come zero-padded (dcap-qvl's sample)
        raise _malformed("non-zero bytes follow the signature data")
    return _with_signature_data(
        raw,
        signature_data,
        offset=signed_length + 4,
        header=(version, body_type, qe_svn, pce_svn, user_data),
        body=body,
        signed=raw[:signed_length],
    )


def _with_signature_data(
    raw: bytes,
    data: bytes,
    *,
    offset: int,
    header: tuple[int, int, int, int, bytes],
    body: dict[str, bytes],
    signed: bytes,
) -> TdxQuote:
    reader = _Reader(data)
    signature = reader.take(64, "quote signature")
    attestation_key = reader.take(64, "attestation key")
    if reader.u16("certification data type") != CERT_DATA_QE_REPORT:
        raise _malformed("certification data is not QE report certification data (type 6)")
    outer = _Reader(reader.take(reader.u32("certification data size"), "certification data"))
    if reader.at != len(data):
        raise _malformed("bytes follow the certification data")
    qe_report_offset = offset + 64 + 64 + 2 + 4  # signature, key, type, size
    qe_report = outer.take(QE_REPORT_BYTES, "QE report")
    qe_report_signature = outer.take(64, "QE report signature")
    qe_auth_data = outer.take(outer.u16("QE authentication data size"), "QE authentication data")
    if len(qe_auth_data) != QE_AUTH_DATA_BYTES:
        raise _malformed(f"QE authentication data is not {QE_AUTH_DATA_BYTES} bytes")
    if outer.u16("inner certification data type") != CERT_DATA_PCK_CHAIN:
        raise _malformed("the PCK chain is not embedded (certification data type 5)")
    chain = outer.take(outer.u32("PCK chain size"), "PCK chain")
    if outer.at != len(outer.data):
        raise _malformed("bytes follow the PCK chain")
    version, body_type, qe_svn, pce_svn, user_data = header
    return TdxQuote(
        raw=raw,
        version=version,
        body_type=body_type,
        qe_svn=qe_svn,
        pce_svn=pce_svn,
        user_data=user_data,
        body=body,
        signed=signed,
        signature=signature,
        attestation_key=attestation_key,
        qe_report=qe_report,
        qe_report_signature=qe_report_signature,
        qe_auth_data=qe_auth_data,
        pck_chain_pem=chain.rstrip(b"\x00"),  # quotes from the QGS end the PEM with a NUL
        qe_report_offset=qe_report_offset,
    )
