"""Hand-made OPA bundles for the hostile-bundle tests: raw tar headers (any type flag, name,
magic or prefix), gzip framing, and signatures in OPA's format made by PyJWT (a signer that is
not the broker's own)."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jwt

from broker.policy import opa_bundle

BLOCK = 512
USTAR = b"ustar\x0000"
GNU = b"ustar  \x00"


@dataclass(frozen=True)
class Entry:
    """One tar entry as written: header fields and content."""

    name: bytes
    content: bytes = b""
    typeflag: bytes = b"0"
    magic: bytes = USTAR
    prefix: bytes = b""
    linkname: bytes = b""
    checksum_delta: int = 0  # != 0: a header whose checksum is wrong

    def encode(self) -> bytes:
        header = bytearray(BLOCK)
        header[0 : len(self.name)] = self.name
        header[100:108] = b"%07o\0" % 0o644
        header[108:116] = b"%07o\0" % 0
        header[116:124] = b"%07o\0" % 0
        header[124:136] = b"%011o\0" % len(self.content)
        header[136:148] = b"%011o\0" % 0
        header[148:156] = b" " * 8
        header[156:157] = self.typeflag
        header[157 : 157 + len(self.linkname)] = self.linkname
        header[257 : 257 + len(self.magic)] = self.magic
        header[345 : 345 + len(self.prefix)] = self.prefix
        header[148:156] = b"%06o\0 " % (sum(header) + self.checksum_delta)
        return bytes(header) + self.content + bytes(-len(self.content) % BLOCK)


def pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length).encode()) + len(body) != length:
        length += 1
    return str(length).encode() + body


def tar(entries: Iterable[Entry], *, end: bytes = bytes(2 * BLOCK), trailing: bytes = b"") -> bytes:
    return b"".join(entry.encode() for entry in entries) + end + trailing


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def entries_of(files: Mapping[str, bytes], **fields: Any) -> list[Entry]:
    return [Entry(name.encode(), content, **fields) for name, content in files.items()]


@dataclass
class Signer:
    """Signs ``.signatures.json`` payloads with PyJWT (RS256 or ES256)."""

    private_key: Any
    algorithm: str
    extra_payload: dict[str, Any] = field(default_factory=dict)

    def signatures(
        self,
        files: Mapping[str, bytes],
        *,
        hash_algorithm: str = "SHA-256",
        listed: Iterable[str] | None = None,
        tokens: int = 1,
        plugin: str | None = None,
    ) -> bytes:
        names = sorted(files) if listed is None else list(listed)
        payload = {
            "files": [
                {
                    "name": name,
                    "hash": file_hash(name, files.get(name, b""), hash_algorithm),
                    "algorithm": hash_algorithm,
                }
                for name in names
            ],
            "keyid": "default",
            **self.extra_payload,
        }
        token = jwt.encode(payload, self.private_key, algorithm=self.algorithm)
        document: dict[str, Any] = {"signatures": [token] * tokens}
        if plugin is not None:
            document["plugin"] = plugin
        return json.dumps(document).encode()


def file_hash(name: str, content: bytes, algorithm: str) -> str:
    hashed = opa_bundle.opa_hashed_bytes(name, content)
    if algorithm == "SHA-256":
        return hashlib.sha256(hashed).hexdigest()
    if algorithm == "MD5":
        return hashlib.md5(hashed).hexdigest()
    raise ValueError(algorithm)
