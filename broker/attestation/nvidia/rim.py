"""NVIDIA reference integrity manifests (signed SWID tags). Pure.

Checklist (docs/evidence.md, §3.5):

1. Parse the XML (no entity expansion, no network: ``resolve_entities=False``, ``no_network``).
2. The embedded ``X509Data`` chain (signer, L3, CA, [root]) must validate at ``now`` to the
   pinned NVIDIA CoRIM signing root; the embedded root copy is ignored.
3. The enveloped XMLDSig signature (ECDSA-SHA384, C14N 1.1) must verify with that signer
   certificate (signxml, pinned to the signer we validated).
4. Read ``Meta/@colloquialVersion`` and the active ``Payload/Resource`` entries:
   ``index`` (0-based; SPDM block = index + 1), ``size``, ``Hash0..Hash{alternatives-1}``.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from lxml import etree
from signxml.exceptions import InvalidInput, InvalidSignature
from signxml.verifier import SignatureConfiguration, XMLVerifier

from broker.core.errors import AttestationError, ErrorCode
from broker.crypto.x509chain import load_der, verify_chain_legacy_encoding

SWID_NS = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd"
DSIG_NS = "http://www.w3.org/2000/09/xmldsig#"
SHA384_NS = "http://www.w3.org/2001/04/xmlenc#sha384"
MAX_RIM_BYTES = 1024 * 1024
MAX_ALTERNATIVES = 16

# The forms NVIDIA's RIM service names RIMs by (docs/evidence.md; nvtrust cc_admin_utils), and
# nothing else: a RIM id is read from a GPU report, so only a report whose chain and signature
# verified can name one, and even then an id of another form is never asked for. Driver:
# NV_GPU_DRIVER_GH100_<driver> (Hopper) or NV_GPU_CC_DRIVER_<CHIP_INFO>_<driver> (Blackwell),
# e.g. NV_GPU_DRIVER_GH100_550.90.07; VBIOS: NV_GPU_VBIOS_<project>_<SKU>_<chip SKU>_<VBIOS
# version without dots, 10 hex digits>, e.g. NV_GPU_VBIOS_1010_0200_882_96009F0001.
DRIVER_VERSION = r"[0-9]{3}\.[0-9]{1,3}\.[0-9]{1,3}"
KNOWN_RIM_ID = re.compile(
    rf"NV_GPU_DRIVER_GH100_{DRIVER_VERSION}"
    rf"|NV_GPU_CC_DRIVER_GB[0-9]{{3}}_{DRIVER_VERSION}"
    r"|NV_GPU_VBIOS_[0-9A-Z]{4}_[0-9A-Z]{4}_[0-9A-Z]{3}_[0-9A-F]{10}"
)


def is_known_rim_id(rim_id: str) -> bool:
    """Whether ``rim_id`` has one of the forms NVIDIA names RIMs by (``KNOWN_RIM_ID``)."""
    return KNOWN_RIM_ID.fullmatch(rim_id) is not None


@dataclass(frozen=True)
class GoldenMeasurement:
    index: int  # 0-based RIM index
    size: int
    alternatives: tuple[bytes, ...]


@dataclass(frozen=True)
class VerifiedRim:
    tag_id: str
    version: str  # colloquialVersion
    measurements: Mapping[int, GoldenMeasurement]  # active entries by RIM index
    chain: Sequence[x509.Certificate] = ()  # the validated signer chain, signer first (OCSP)


def _invalid(message: str) -> AttestationError:
    return AttestationError(f"RIM: {message}", code=ErrorCode.RIM_INVALID)


def verify_rim(data: bytes, *, roots: Sequence[x509.Certificate], now: datetime) -> VerifiedRim:
    """Steps 1-4 above.

    Raises:
        AttestationError: ``rim_invalid`` or ``cert_chain_invalid``.
    """
    if len(data) > MAX_RIM_BYTES:
        raise _invalid("too large")
    parser = etree.XMLParser(resolve_entities=False, no_network=True, huge_tree=False)
    try:
        document = etree.fromstring(data, parser=parser)
    except etree.XMLSyntaxError as exc:
        raise _invalid("not well-formed XML") from exc
    chain = [_certificate(node.text) for node in document.iter(f"{{{DSIG_NS}}}X509Certificate")]
    if not chain:
        raise _invalid("no signer certificate")
    validated = verify_chain_legacy_encoding(
        chain[0], [c for c in chain[1:] if c not in roots], roots, now=now
    )
    try:
        result = XMLVerifier().verify(
            data,
            x509_cert=chain[0],
            parser=parser,
            expect_config=SignatureConfiguration(verification_time=now),
        )
    except (InvalidSignature, InvalidInput) as exc:
        raise _invalid(f"signature does not verify ({type(exc).__name__})") from exc
    if isinstance(result, list):  # one Reference expected; several means another document
        raise _invalid("more than one signed reference")
    verified = _read(result.signed_xml)
    return VerifiedRim(verified.tag_id, verified.version, verified.measurements, validated)


def _certificate(text: str | None) -> x509.Certificate:
    try:
        return load_der(base64.b64decode("".join((text or "").split()), validate=True))
    except (binascii.Error, ValueError) as exc:
        raise _invalid("signer certificate is not base64") from exc


def _read(signed: etree._Element) -> VerifiedRim:
    meta = signed.find(f"{{{SWID_NS}}}Meta")
    payload = signed.find(f"{{{SWID_NS}}}Payload")
    if meta is None or payload is None:
        raise _invalid("no Meta or Payload in the signed content")
    golden: dict[int, GoldenMeasurement] = {}
    for resource in payload.iter(f"{{{SWID_NS}}}Resource"):
        if resource.get("type") != "Measurement" or resource.get("active", "").lower() != "true":
            continue
        try:
            index, size = int(resource.get("index", "")), int(resource.get("size", ""))
            count = int(resource.get("alternatives", "1"))
            hashes = tuple(
                bytes.fromhex(resource.get(f"{{{SHA384_NS}}}Hash{i}", "")) for i in range(count)
            )
        except ValueError as exc:
            raise _invalid("measurement entry with a bad index, size or hash") from exc
        if index in golden or not 1 <= count <= MAX_ALTERNATIVES or not all(hashes):
            raise _invalid(f"measurement entry {index} is inconsistent")
        golden[index] = GoldenMeasurement(index=index, size=size, alternatives=hashes)
    return VerifiedRim(
        tag_id=str(signed.get("tagId", "")),
        version=str(meta.get("colloquialVersion", "")),
        measurements=golden,
    )
