"""The AMD SEV-SNP attestation report: its byte layout, parsed from the 1184 bytes the firmware
wrote. Pure: bytes in, a frozen :class:`SnpReport` out, or ``AttestationError``.

Layout: *SEV Secure Nested Paging Firmware ABI Specification* (AMD 56860), Table 23
"ATTESTATION_REPORT Structure" (report versions 2 and 3; version 3 adds the CPUID family,
model and stepping at 0x188). All integers are little-endian. The signature covers bytes
0x000-0x29F; at 0x2A0 it is ECDSA P-384 R then S, each a 72-byte little-endian field.

A TCB_VERSION (8 bytes) reads differently by product (ABI Table 3): Milan and Genoa
``[bootloader, tee, 0, 0, 0, 0, snp, microcode]``, Turin ``[fmc, bootloader, tee, snp, 0, 0,
0, microcode]``. A version 3 report names its product (CPUID); a version 2 report does not, so
its TCBs are decoded once the certificate chain has said which product signed it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from broker.core.errors import AttestationError, ErrorCode
from broker.core.protocol import SNP_PRODUCTS

REPORT_BYTES = 1184  # 0x4A0
SIGNED_BYTES = 0x2A0  # the signature covers [0, 0x2A0)
SIGNATURE_OFFSET = 0x2A0
SIGNATURE_FIELD_BYTES = 72  # R, then S: little-endian, zero-padded past P-384's 48 bytes
SUPPORTED_VERSIONS = (2, 3)
SIG_ALGO_ECDSA_P384_SHA384 = 1
PRODUCTS = SNP_PRODUCTS
TURIN = "Turin"

# Field offsets (ABI Table 23)
_VERSION, _GUEST_SVN, _POLICY, _FAMILY_ID, _IMAGE_ID = 0x000, 0x004, 0x008, 0x010, 0x020
_VMPL, _SIG_ALGO, _CURRENT_TCB, _PLATFORM_INFO, _KEY_INFO = 0x030, 0x034, 0x038, 0x040, 0x048
_REPORT_DATA, _MEASUREMENT, _HOST_DATA, _ID_KEY_DIGEST = 0x050, 0x090, 0x0C0, 0x0E0
_AUTHOR_KEY_DIGEST, _REPORT_ID, _REPORT_ID_MA, _REPORTED_TCB = 0x110, 0x140, 0x160, 0x180
_CPUID_FAM, _CPUID_MOD, _CPUID_STEP, _CHIP_ID = 0x188, 0x189, 0x18A, 0x1A0
_COMMITTED_TCB, _CURRENT_VERSION, _COMMITTED_VERSION, _LAUNCH_TCB = 0x1E0, 0x1E8, 0x1EC, 0x1F0

# GUEST_POLICY bits (ABI Table 9); bit 17 is reserved and must be one.
POLICY_BITS = {
    "smt_allowed": 16,
    "migrate_ma_allowed": 18,
    "debug_allowed": 19,
    "single_socket_required": 20,
    "cxl_allowed": 21,
    "mem_aes_256_xts": 22,
    "rapl_disabled": 23,
    "ciphertext_hiding": 24,
    "page_swap_disabled": 25,
}
POLICY_DEBUG_BIT = POLICY_BITS["debug_allowed"]
# PLATFORM_INFO bits (ABI Table 23, 0x040)
PLATFORM_BITS = {
    "smt_enabled": 0,
    "tsme_enabled": 1,
    "ecc_enabled": 2,
    "rapl_disabled": 3,
    "ciphertext_hiding_enabled": 4,
    "alias_check_complete": 5,
    "tio_enabled": 7,
}
# KEY_INFO.SIGNING_KEY (bits 4:2): which key signed the report
SIGNING_KEYS = {0: "vcek", 1: "vlek"}


@dataclass(frozen=True)
class Tcb:
    """One TCB_VERSION, decoded for its product; ``fmc`` only on Turin."""

    bootloader: int
    tee: int
    snp: int
    microcode: int
    fmc: int | None

    def as_json(self) -> dict[str, Any]:
        return {
            "bootloader": self.bootloader,
            "tee": self.tee,
            "snp": self.snp,
            "microcode": self.microcode,
            "fmc": self.fmc,
        }


def decode_tcb(raw: bytes, product: str) -> Tcb:
    """An 8-byte TCB_VERSION in its product's layout (module docstring)."""
    if product == TURIN:
        return Tcb(bootloader=raw[1], tee=raw[2], snp=raw[3], microcode=raw[7], fmc=raw[0])
    return Tcb(bootloader=raw[0], tee=raw[1], snp=raw[6], microcode=raw[7], fmc=None)


def encode_tcb(tcb: Tcb, product: str) -> bytes:
    """The inverse of :func:`decode_tcb` (reserved bytes zero)."""
    if product == TURIN:
        return bytes([tcb.fmc or 0, tcb.bootloader, tcb.tee, tcb.snp, 0, 0, 0, tcb.microcode])
    return bytes([tcb.bootloader, tcb.tee, 0, 0, 0, 0, tcb.snp, tcb.microcode])


def product_from_cpuid(family: int, model: int) -> str | None:
    """The EPYC product a version 3 report's CPUID names (as the ``sev`` crate's
    ``Generation::identify_cpu``), or ``None`` for one the broker does not know."""
    if family == 0x19 and model <= 0x0F:
        return "Milan"
    if family == 0x19 and (0x10 <= model <= 0x1F or 0xA0 <= model <= 0xAF):
        return "Genoa"
    if family == 0x1A and model <= 0x11:
        return TURIN
    return None


@dataclass(frozen=True)
class SnpReport:
    """An unverified report's fields; ``raw`` is the 1184 bytes, ``raw[:0x2A0]`` signed."""

    raw: bytes
    version: int
    guest_svn: int
    policy: int
    vmpl: int
    sig_algo: int
    platform_info: int
    key_info: int
    cpuid: tuple[int, int, int] | None  # family, model, stepping (version 3)

    def field(self, offset: int, length: int) -> bytes:
        return self.raw[offset : offset + length]

    @property
    def signed_bytes(self) -> bytes:
        return self.raw[:SIGNED_BYTES]

    @property
    def signature_rs(self) -> tuple[int, int]:
        """R and S as integers (little-endian fields)."""
        r = self.field(SIGNATURE_OFFSET, SIGNATURE_FIELD_BYTES)
        s = self.field(SIGNATURE_OFFSET + SIGNATURE_FIELD_BYTES, SIGNATURE_FIELD_BYTES)
        return int.from_bytes(r, "little"), int.from_bytes(s, "little")

    @property
    def report_data(self) -> bytes:
        return self.field(_REPORT_DATA, 64)

    @property
    def host_data(self) -> bytes:
        """HOST_DATA: 32 bytes the host chose at launch (CoCo: the init-data digest)."""
        return self.field(_HOST_DATA, 32)

    @property
    def chip_id(self) -> bytes:
        return self.field(_CHIP_ID, 64)

    @property
    def chip_id_masked(self) -> bool:
        """MASK_CHIP_ID: the firmware wrote zeros in place of the chip's id."""
        return self.chip_id == bytes(64)

    @property
    def mask_chip_key(self) -> bool:
        """MASK_CHIP_KEY: the firmware wrote zeros in place of a signature."""
        return bool(self.key_info >> 1 & 1)

    @property
    def signing_key(self) -> str | None:
        """``vcek``, ``vlek``, or ``None`` for any other SIGNING_KEY value."""
        return SIGNING_KEYS.get(self.key_info >> 2 & 0b111)

    @property
    def debug(self) -> bool:
        return bool(self.policy >> POLICY_DEBUG_BIT & 1)

    @property
    def product_hint(self) -> str | None:
        """The product a version 3 report's CPUID names (``None``: version 2, or unknown)."""
        return product_from_cpuid(self.cpuid[0], self.cpuid[1]) if self.cpuid else None

    def tcbs(self, product: str) -> dict[str, Tcb]:
        """The four TCB_VERSIONs, decoded for ``product``."""
        offsets = {
            "current_tcb": _CURRENT_TCB,
            "reported_tcb": _REPORTED_TCB,
            "committed_tcb": _COMMITTED_TCB,
            "launch_tcb": _LAUNCH_TCB,
        }
        return {name: decode_tcb(self.field(at, 8), product) for name, at in offsets.items()}

    def digests(self) -> dict[str, str]:
        """The measured and launch-supplied values, lower-case hex (the policy's
        ``measurements``)."""
        spans = {
            "measurement": (_MEASUREMENT, 48),
            "host_data": (_HOST_DATA, 32),
            "id_key_digest": (_ID_KEY_DIGEST, 48),
            "author_key_digest": (_AUTHOR_KEY_DIGEST, 48),
            "family_id": (_FAMILY_ID, 16),
            "image_id": (_IMAGE_ID, 16),
            "report_data": (_REPORT_DATA, 64),
        }
        return {name: self.field(at, size).hex() for name, (at, size) in spans.items()}

    def identity(self) -> dict[str, Any]:
        """Report ids, chip id and firmware versions (for ``claims``)."""
        current = self.field(_CURRENT_VERSION, 3)  # build, minor, major
        committed = self.field(_COMMITTED_VERSION, 3)
        return {
            "report_id": self.field(_REPORT_ID, 32).hex(),
            "report_id_ma": self.field(_REPORT_ID_MA, 32).hex(),
            "chip_id": self.chip_id.hex(),
            "chip_id_masked": self.chip_id_masked,
            "current_version": f"{current[2]}.{current[1]}.{current[0]}",
            "committed_version": f"{committed[2]}.{committed[1]}.{committed[0]}",
        }


def parse_report(raw: bytes) -> SnpReport:
    """Parse an attestation report (unverified).

    Raises:
        AttestationError: ``snp_report_malformed`` (not 1184 bytes),
            ``snp_report_version_unsupported`` (a version other than 2 or 3).
    """
    if len(raw) != REPORT_BYTES:
        raise AttestationError(
            f"an SEV-SNP attestation report is {REPORT_BYTES} bytes, not {len(raw)}",
            code=ErrorCode.SNP_REPORT_MALFORMED,
        )
    version, guest_svn, policy = struct.unpack_from("<IIQ", raw, _VERSION)
    if version not in SUPPORTED_VERSIONS:
        raise AttestationError(
            f"SEV-SNP report version {version} is not supported (versions 2 and 3 are)",
            code=ErrorCode.SNP_REPORT_VERSION_UNSUPPORTED,
        )
    vmpl, sig_algo = struct.unpack_from("<II", raw, _VMPL)
    (platform_info,) = struct.unpack_from("<Q", raw, _PLATFORM_INFO)
    (key_info,) = struct.unpack_from("<I", raw, _KEY_INFO)
    cpuid = (raw[_CPUID_FAM], raw[_CPUID_MOD], raw[_CPUID_STEP]) if version >= 3 else None
    return SnpReport(
        raw=bytes(raw),
        version=version,
        guest_svn=guest_svn,
        policy=policy,
        vmpl=vmpl,
        sig_algo=sig_algo,
        platform_info=platform_info,
        key_info=key_info,
        cpuid=cpuid,
    )


def bits(value: int, names: dict[str, int]) -> dict[str, bool]:
    """Named single bits of ``value``."""
    return {name: bool(value >> bit & 1) for name, bit in names.items()}
