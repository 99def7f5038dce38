"""The SEV-SNP evidence object Confidential Containers guests send, parsed strictly back into
the report bytes the firmware signed. Pure.

The guest's attestation agent (guest-components ``attestation-agent/attester/src/snp``) sends
``serde_json`` of ``SnpEvidence {attestation_report: sev::AttestationReport, cert_chain:
Option<Vec<CertTableEntry>>}`` from the ``sev`` crate (6.3.1), not the report's bytes: the
report is parsed into fields and serialised as JSON (byte arrays as arrays of integers,
``GuestPolicy``/``PlatformInfo``/``KeyInfo`` as integers, TCBs as objects). The signed bytes are
rebuilt here exactly as that crate's ``AttestationReport::write_bytes`` does — reserved bytes
zero, the TCB layout chosen by product (a version 2 report: Turin when the chip id's last 56
bytes are zero, else Milan/Genoa; version 3: its CPUID) — and then verified like any raw
report. Every field is required, typed and of its exact length; an unknown member, a wrong
type or a value out of range is ``snp_report_malformed``. docs/evidence.md has the format.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.attestation.raw.snp_report import (
    REPORT_BYTES,
    SIGNATURE_FIELD_BYTES,
    SUPPORTED_VERSIONS,
    TURIN,
    Tcb,
    encode_tcb,
    product_from_cpuid,
)
from broker.core.errors import AttestationError, ErrorCode

MAX_CERT_ENTRIES = 8
MAX_CERT_BYTES = 16 * 1024
# CertType (sev::firmware::host::CertType), as serde names its unit variants
CERT_TYPES = ("ARK", "ASK", "VCEK", "VLEK", "CRL", "Empty")
_U8, _U32, _U64 = 0xFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF
_BYTE_FIELDS = {  # name -> length, in the report's order
    "family_id": 16,
    "image_id": 16,
    "report_data": 64,
    "measurement": 48,
    "host_data": 32,
    "id_key_digest": 48,
    "author_key_digest": 48,
    "report_id": 32,
    "report_id_ma": 32,
    "chip_id": 64,
}
_REPORT_KEYS = {
    "version", "guest_svn", "policy", "vmpl", "sig_algo", "plat_info", "key_info",
    "current_tcb", "reported_tcb", "committed_tcb", "launch_tcb", "current", "committed",
    "cpuid_fam_id", "cpuid_mod_id", "cpuid_step", "signature", *_BYTE_FIELDS,
}  # fmt: skip
_OPTIONAL_KEYS = {"launch_mit_vector", "current_mit_vector"}  # sev >= 6.2: null before v5


@dataclass(frozen=True)
class GuestCert:
    """One ``cert_chain`` entry: its type (``VCEK``, ``ASK``, …; ``OTHER`` for a GUID) and bytes."""

    cert_type: str
    data: bytes


@dataclass(frozen=True)
class SnpEvidence:
    """The guest's evidence: the report's 1184 bytes (rebuilt) and its certificates."""

    report: bytes
    certs: tuple[GuestCert, ...]


def parse_evidence(unverified: Mapping[str, Any]) -> SnpEvidence:
    """Parse the KBS ``tee-evidence`` object of an SNP guest (``primary_evidence``).

    Raises:
        AttestationError: ``snp_report_malformed``, ``snp_report_version_unsupported`` or
            ``snp_product_unknown`` (a version 3 report whose CPUID names no known product).
    """
    unverified = _obj(unverified, "evidence")
    _keys(unverified, {"attestation_report"}, {"cert_chain"}, "evidence")
    report = report_bytes(_obj(unverified["attestation_report"], "attestation_report"))
    chain = unverified.get("cert_chain")
    certs = () if chain is None else _cert_chain(chain)
    return SnpEvidence(report=report, certs=certs)


def report_bytes(obj: Mapping[str, Any]) -> bytes:
    """The serde form of ``sev::AttestationReport`` as the firmware's 1184 bytes."""
    _keys(obj, _REPORT_KEYS, _OPTIONAL_KEYS, "attestation_report")
    version = _int(obj["version"], _U32, "version")
    if version not in SUPPORTED_VERSIONS:
        raise AttestationError(
            f"SEV-SNP report version {version} is not supported (versions 2 and 3 are)",
            code=ErrorCode.SNP_REPORT_VERSION_UNSUPPORTED,
        )
    for name in _OPTIONAL_KEYS:
        if obj.get(name) is not None:
            raise _malformed(f"attestation_report.{name} is not in a version {version} report")
    data = {name: _bytes(obj[name], size, name) for name, size in _BYTE_FIELDS.items()}
    cpuid = _cpuid(obj, version)
    product = _layout(version, data["chip_id"], cpuid)
    tcb = {n: _tcb(obj[n], product, n) for n in ("current_tcb", "reported_tcb")}
    tcb |= {n: _tcb(obj[n], product, n) for n in ("committed_tcb", "launch_tcb")}
    out = bytearray(REPORT_BYTES)
    struct.pack_into("<II", out, 0x000, version, _int(obj["guest_svn"], _U32, "guest_svn"))
    struct.pack_into("<Q", out, 0x008, _int(obj["policy"], _U64, "policy"))
    out[0x010:0x030] = data["family_id"] + data["image_id"]
    struct.pack_into("<II", out, 0x030, _int(obj["vmpl"], _U32, "vmpl"), _sig_algo(obj))
    out[0x038:0x040] = tcb["current_tcb"]
    struct.pack_into("<Q", out, 0x040, _int(obj["plat_info"], _U64, "plat_info"))
    struct.pack_into("<I", out, 0x048, _int(obj["key_info"], _U32, "key_info"))
    at = 0x050
    for name in ("report_data", "measurement", "host_data", "id_key_digest"):
        out[at : at + len(data[name])] = data[name]
        at += len(data[name])
    out[0x110:0x180] = data["author_key_digest"] + data["report_id"] + data["report_id_ma"]
    out[0x180:0x188] = tcb["reported_tcb"]
    if cpuid is not None:
        out[0x188:0x18B] = bytes(cpuid)
    out[0x1A0:0x1E0] = data["chip_id"]
    out[0x1E0:0x1E8] = tcb["committed_tcb"]
    out[0x1E8:0x1EB] = _version(obj["current"], "current")
    out[0x1EC:0x1EF] = _version(obj["committed"], "committed")
    out[0x1F0:0x1F8] = tcb["launch_tcb"]
    out[0x2A0 : 0x2A0 + 2 * SIGNATURE_FIELD_BYTES] = _signature(obj["signature"])
    return bytes(out)


def _cpuid(obj: Mapping[str, Any], version: int) -> tuple[int, int, int] | None:
    names = ("cpuid_fam_id", "cpuid_mod_id", "cpuid_step")
    if version == 2:
        if any(obj[name] is not None for name in names):
            raise _malformed("a version 2 report has no CPUID fields (they must be null)")
        return None
    family, model, step = (_int(obj[name], _U8, name) for name in names)
    return family, model, step


def _layout(version: int, chip_id: bytes, cpuid: tuple[int, int, int] | None) -> str:
    """The product whose TCB layout the guest's ``sev`` crate used (only Turin's differs)."""
    if cpuid is None:
        if chip_id == bytes(64):  # the crate refuses to parse these (MaskedChipId)
            raise _malformed("a version 2 report with a masked chip id has no TCB layout")
        return TURIN if chip_id[8:] == bytes(56) else "Genoa"
    product = product_from_cpuid(cpuid[0], cpuid[1])
    if product is None:
        raise AttestationError(
            f"CPUID family {cpuid[0]:#x} model {cpuid[1]:#x} is no SEV-SNP product known",
            code=ErrorCode.SNP_PRODUCT_UNKNOWN,
        )
    return product


def _tcb(value: Any, product: str, name: str) -> bytes:
    obj = _obj(value, name)
    _keys(obj, {"bootloader", "tee", "snp", "microcode", "fmc"}, set(), name)
    fmc = obj["fmc"]
    if (fmc is None) == (product == TURIN):
        raise _malformed(f"{name}.fmc must be {'a number' if product == TURIN else 'null'}")
    parts = {k: _int(obj[k], _U8, f"{name}.{k}") for k in ("bootloader", "tee", "snp", "microcode")}
    tcb = Tcb(fmc=None if fmc is None else _int(fmc, _U8, f"{name}.fmc"), **parts)
    return encode_tcb(tcb, product)


def _version(value: Any, name: str) -> bytes:
    obj = _obj(value, name)
    _keys(obj, {"major", "minor", "build"}, set(), name)
    return bytes(_int(obj[k], _U8, f"{name}.{k}") for k in ("build", "minor", "major"))


def _signature(value: Any) -> bytes:
    obj = _obj(value, "signature")
    _keys(obj, {"r", "s"}, set(), "signature")
    return _bytes(obj["r"], SIGNATURE_FIELD_BYTES, "signature.r") + _bytes(
        obj["s"], SIGNATURE_FIELD_BYTES, "signature.s"
    )


def _sig_algo(obj: Mapping[str, Any]) -> int:
    return _int(obj["sig_algo"], _U32, "sig_algo")


def _cert_chain(value: Any) -> tuple[GuestCert, ...]:
    if not isinstance(value, list) or len(value) > MAX_CERT_ENTRIES:
        raise _malformed(f"cert_chain must be null or a list of at most {MAX_CERT_ENTRIES} entries")
    certs = []
    for index, item in enumerate(value):
        entry = _obj(item, f"cert_chain[{index}]")
        _keys(entry, {"cert_type", "data"}, set(), f"cert_chain[{index}]")
        certs.append(GuestCert(_cert_type(entry["cert_type"], index), _data(entry["data"], index)))
    return tuple(certs)


def _cert_type(value: Any, index: int) -> str:
    if isinstance(value, str) and value in CERT_TYPES:
        return value
    if isinstance(value, dict) and list(value) == ["OTHER"] and isinstance(value["OTHER"], str):
        return "OTHER"
    raise _malformed(f"cert_chain[{index}].cert_type is not a certificate type")


def _data(value: Any, index: int) -> bytes:
    """A certificate's bytes: serde's array of integers (``Vec<u8>``)."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CERT_BYTES:
        raise _malformed(
            f"cert_chain[{index}].data is not an array of at most {MAX_CERT_BYTES} bytes"
        )
    return _bytes(value, len(value), f"cert_chain[{index}].data")


def _keys(obj: Mapping[str, Any], required: set[str], optional: set[str], where: str) -> None:
    missing = required - obj.keys()
    unknown = obj.keys() - required - optional
    if missing or unknown:
        raise _malformed(f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)[:4]}")


def _obj(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _malformed(f"{name} must be an object")
    return value


def _int(value: Any, limit: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise _malformed(f"{name} must be an integer from 0 to {limit}")
    return value


def _bytes(value: Any, size: int, name: str) -> bytes:
    if not isinstance(value, list) or len(value) != size:
        raise _malformed(f"{name} must be an array of {size} bytes")
    return bytes(_int(item, _U8, name) for item in value)


def _malformed(message: str) -> AttestationError:
    return AttestationError(message, code=ErrorCode.SNP_REPORT_MALFORMED)


def cert_entries(certs: Sequence[GuestCert], *types: str) -> list[bytes]:
    """The data of the entries of these types, in order."""
    return [cert.data for cert in certs if cert.cert_type in types]
