"""OPA bundles as the broker reads and writes them: one read, one verification, one load.

A bundle arrives as bytes (read once by the caller). This module unpacks those bytes with the
broker's own strict tar reader (``tarball.py``), verifies OPA's signature format on the unpacked
files, and hands back exactly the files it verified; the engine loads ``policy.wasm`` and
``data.json`` from them. Nothing is read a second time, and no other reader (Python's
``tarfile``, OPA) sees different bytes.

Checklist of ``read_bundle`` (OPA's bundle format, docs/policy.md "Bundles"):

1. Size: at most ``MAX_BUNDLE_BYTES`` compressed and ``MAX_UNPACKED_BYTES`` unpacked; every
   gzip member complete with a good CRC; nothing after the last member.
2. Tar (POSIX ustar/GNU header blocks, checked by checksum): regular-file entries (type ``0``,
   or the legacy NUL) and directory entries (type ``5``, name ending in ``/``, size 0: OPA skips
   them, and so does the broker; ``tar czf b.tar.gz .`` writes them); every other type — links,
   devices, FIFOs, "contiguous" files (``7``), sparse files, PAX and GNU extension headers, a
   directory with content — refuses the whole bundle (OPA skips such entries where Python's
   ``tarfile`` reads some of them as files: type ``7`` named ``policy.wasm`` was a way to load an
   unsigned policy). The end is two zero blocks.
3. Names, after one leading ``/`` (``opa build`` writes it; OPA's verifier takes it off) or
   ``./`` (``tar czf b.tar.gz .`` after ``opa sign``, which lists the names without it) is
   taken off: relative, normalised (no empty, ``.`` or ``..`` component, no backslash),
   printable UTF-8, unique. The ustar prefix field must be empty.
4. Only files the broker loads: ``.manifest``, ``.signatures.json``, ``policy.wasm``,
   ``data.json`` at the root, and ``*.rego`` (the sources the Wasm was built from).
5. Signature (when a verification key is configured; a signed bundle without one is refused, as
   OPA refuses it): ``.signatures.json`` holds exactly one compact JWS, no ``plugin`` but
   OPA's built-in ``_default`` (which ``opa build --signing-key`` names); it
   verifies with the configured key and algorithm; its payload's ``scope`` equals the configured
   scope; it lists every other file exactly once with a SHA-256 hash (OPA's hash: the bytes, or
   for ``data.json`` and ``.manifest`` the parsed JSON walked in sorted-key order), and every
   file it lists is present.
6. ``policy.wasm`` present; ``data.json`` a JSON object; ``.manifest`` a JSON object naming
   the broker's entrypoint, and only Wasm modules the bundle holds.

OPA's own ``opa build -b BUNDLE --verification-key`` is the test oracle
(``tests/integration/test_bundle_differential.py``): whenever OPA refuses a bundle the broker
refuses it, whenever the broker accepts one OPA accepts it (for a ``./`` tar: the same files
without the ``./``, since OPA 1.22's verifier compares ``./data.json`` with the ``data.json``
that ``opa sign`` listed) and loads the same ``policy.wasm`` and data, and the bundles OPA accepts
but the broker refuses are exactly the stricter classes of steps 1-4. Where OPA compares raw
names (its verifier, a manifest's Wasm module path) the broker compares them with the one ``/``
or ``./`` taken off: that is the whole of what it accepts beyond OPA.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, utils

from broker.core.encoding import b64url_decode, b64url_encode
from broker.core.errors import AttestationError
from broker.crypto import jose
from broker.policy.tarball import MAX_BUNDLE_BYTES, pack, unpack
from broker.policy.wasm import PolicyLoadError

__all__ = ["MAX_BUNDLE_BYTES", "pack", "unpack"]  # callers read and write bundles from here

SIGNATURES = ".signatures.json"
MANIFEST = ".manifest"
WASM = "policy.wasm"
DATA = "data.json"
ROOT_FILES = frozenset({SIGNATURES, MANIFEST, WASM, DATA})
STRUCTURED = frozenset({DATA, MANIFEST})  # OPA hashes these as parsed JSON
HASH_ALGORITHM = "SHA-256"
DEFAULT_VERIFIER = "_default"  # OPA's built-in signer/verifier id (``opa build --signing-key``)


@dataclass(frozen=True)
class BundleVerification:
    """What configuration says a bundle's signature must satisfy (OPA's verification config)."""

    public_key: Any  # an RSA or EC public key object
    scope: str = ""

    @property
    def algorithm(self) -> str:
        return signing_algorithm(self.public_key)


def verification_from_file(key: Path | None, scope: str) -> BundleVerification | None:
    """The verification a ``--verification-key`` file and scope ask for (``None``: no key).

    Raises:
        PolicyLoadError: the key file cannot be read or is not a public key this verifies with.
    """
    if key is None:
        return None
    try:
        pem = key.read_bytes()
    except OSError as exc:
        raise PolicyLoadError(f"cannot read the verification key {key}") from exc
    return BundleVerification(load_public_key(pem), scope)


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose structure (and, when configured, signature) verified: the very files the
    engine loads, and their digest."""

    files: Mapping[str, bytes]
    wasm: bytes
    data: Mapping[str, Any]
    manifest: Mapping[str, Any]
    digest: str
    signed: bool
    claims: Mapping[str, Any] = dataclasses.field(
        default_factory=dict
    )  # the verified signature's payload

    @property
    def revision(self) -> str:
        value = self.manifest.get("revision")
        return value if isinstance(value, str) else ""

    @property
    def source_digest(self) -> str | None:
        broker = self.manifest.get("metadata", {}).get("broker", {})
        value = broker.get("source_digest") if isinstance(broker, dict) else None
        return value if isinstance(value, str) else None


def files_digest(files: Mapping[str, bytes]) -> str:
    """``sha256:`` over every file's name and bytes, in sorted order, but ``.signatures.json`` (a
    signature is not policy) and the ``.manifest``'s ``revision`` (a label: the manifest counts
    in OPA's canonical JSON with ``revision`` empty). The same function names a policy directory
    and a bundle, so a directory, its bundle built with or without ``--revision``, and that
    bundle signed have one digest."""
    digest = hashlib.sha256()
    for name in sorted(files):
        if name == SIGNATURES:
            continue
        content = _without_revision(files[name]) if name == MANIFEST else files[name]
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    return "sha256:" + digest.hexdigest()


def _without_revision(manifest: bytes) -> bytes:
    """The manifest in OPA's canonical JSON (``opa_hashed_bytes``) with ``revision`` emptied; its
    own bytes when it is not a JSON object (``read_bundle`` refuses it)."""
    try:
        value = _json_preserving_numbers(manifest, MANIFEST)
    except PolicyLoadError:
        return manifest
    if not isinstance(value, dict):
        return manifest
    if "revision" in value:
        value["revision"] = ""
    out: list[bytes] = []
    _walk(value, out)
    return b"".join(out)


def with_revision(manifest: bytes, revision: str, *, source: str) -> bytes:
    """``manifest`` (a JSON object) in OPA's canonical JSON with ``revision`` set.

    Raises:
        PolicyLoadError: not a JSON object.
    """
    value = _json_preserving_numbers(manifest, f"{source}: {MANIFEST}")
    if not isinstance(value, dict):
        raise PolicyLoadError(f"{source}: {MANIFEST} is not a JSON object")
    value["revision"] = revision
    out: list[bytes] = []
    _walk(value, out)
    return b"".join(out)


# --- reading -----------------------------------------------------------------------------------


def read_bundle(
    raw: bytes, *, source: str, verification: BundleVerification | None
) -> VerifiedBundle:
    """Steps 1-6 on ``raw``: the files verified, ready to load.

    Raises:
        PolicyLoadError: naming the step and the offending entry.
    """
    return read_files(unpack(raw, source=source), source=source, verification=verification)


def read_files(
    files: Mapping[str, bytes], *, source: str, verification: BundleVerification | None
) -> VerifiedBundle:
    """Steps 4-6 on a bundle's files, unpacked once by the caller (``unpack``: steps 1-3).

    Raises:
        PolicyLoadError: naming the step and the offending entry.
    """
    for name in files:
        if name not in ROOT_FILES and not name.endswith(".rego"):
            raise PolicyLoadError(
                f"{source}: {name!r} is not a file the broker loads (only .manifest, "
                ".signatures.json, policy.wasm and data.json at the root, and *.rego)"
            )
    signed = SIGNATURES in files
    claims: dict[str, Any] = {}
    if verification is not None:
        claims = verify_signature(files, verification, source=source)
    elif signed:
        raise PolicyLoadError(
            f"{source}: the bundle is signed but no [policy] bundle_verification_key is "
            "configured to verify it"
        )
    if WASM not in files:
        raise PolicyLoadError(f"{source}: the bundle has no policy.wasm (build it with -t wasm)")
    data = _json_object(files.get(DATA, b"{}"), f"{source}: data.json")
    manifest = _json_object(files.get(MANIFEST, b"{}"), f"{source}: .manifest")
    _check_wasm_modules(manifest, files, source)
    return VerifiedBundle(
        files=files,
        wasm=files[WASM],
        data=data,
        manifest=manifest,
        digest=files_digest(files),
        signed=signed,
        claims=claims,
    )


def _check_wasm_modules(
    manifest: Mapping[str, Any], files: Mapping[str, bytes], source: str
) -> None:
    """Step 6: every Wasm module the manifest names is a file of the bundle (OPA's rule; its
    ``/policy.wasm`` names the entry ``/policy.wasm``, read here as ``policy.wasm``).

    Raises:
        PolicyLoadError: a module that is not a file of the bundle.
    """
    entries = manifest.get("wasm", [])
    for entry in entries if isinstance(entries, list) else [entries]:
        module = entry.get("module") if isinstance(entry, dict) else None
        if not isinstance(module, str) or module.removeprefix("/") not in files:
            raise PolicyLoadError(
                f"{source}: .manifest names Wasm module {module!r}, which the bundle lacks"
            )


# --- OPA's signature format --------------------------------------------------------------------


def verify_signature(
    files: Mapping[str, bytes], verification: BundleVerification, *, source: str
) -> dict[str, Any]:
    """Step 5, as OPA's ``bundle.VerifyBundleSignature`` and ``VerifyBundleFile`` define it.

    Returns:
        The verified payload (its ``policy_version`` and ``policy_expires`` claims are the
        bundle's freshness, ``freshness.py``).

    Raises:
        PolicyLoadError: naming what did not verify.
    """
    if SIGNATURES not in files:
        raise PolicyLoadError(
            f"{source}: bundle missing .signatures.json (a signature is required)"
        )
    config = _json_object(files[SIGNATURES], f"{source}: .signatures.json")
    tokens = config.get("signatures")
    if config.get("plugin") not in (None, "", DEFAULT_VERIFIER):
        raise PolicyLoadError(f"{source}: .signatures.json names a verifier plugin")
    if not isinstance(tokens, list) or len(tokens) != 1 or not isinstance(tokens[0], str):
        raise PolicyLoadError(f"{source}: .signatures.json must hold exactly one JWS")
    payload = _verified_payload(tokens[0], verification, source)
    if payload.get("scope", "") != verification.scope:
        raise PolicyLoadError(f"{source}: the signature's scope does not match the configured one")
    listed = _listed_files(payload, source)
    for name, content in files.items():
        if name == SIGNATURES:
            continue
        if name not in listed:
            raise PolicyLoadError(f"{source}: {name!r} is not included in the bundle signature")
        if listed.pop(name) != opa_file_hash(name, content, source=source):
            raise PolicyLoadError(f"{source}: {name!r} does not match its signed hash")
    if listed:
        raise PolicyLoadError(
            f"{source}: signed file(s) {sorted(listed)} are missing from the bundle"
        )
    return payload


def _verified_payload(token: str, verification: BundleVerification, source: str) -> dict[str, Any]:
    algorithm = verification.algorithm
    try:
        header = jose.parse_header(token, (algorithm,))
        parts = token.split(".")
        jose.check_signature(
            header.alg,
            verification.public_key,
            f"{parts[0]}.{parts[1]}".encode("ascii"),
            b64url_decode(parts[2]),
        )
        payload = jose.json_segment(parts[1], 8)
    except (AttestationError, ValueError, UnicodeEncodeError) as exc:
        problem = exc.message if isinstance(exc, AttestationError) else "not a compact JWS"
        raise PolicyLoadError(f"{source}: bundle signature does not verify: {problem}") from exc
    if not isinstance(payload, dict):
        raise PolicyLoadError(f"{source}: the signature's payload is not a JSON object")
    return dict(payload)


def _listed_files(payload: Mapping[str, Any], source: str) -> dict[str, str]:
    entries = payload.get("files")
    if not isinstance(entries, list):
        raise PolicyLoadError(f"{source}: the signature lists no files")
    listed: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise PolicyLoadError(f"{source}: a signed file entry has no name")
        if entry.get("algorithm") != HASH_ALGORITHM or not isinstance(entry.get("hash"), str):
            raise PolicyLoadError(
                f"{source}: signed file {entry['name']!r} is not hashed with {HASH_ALGORITHM}"
            )
        listed[entry["name"]] = entry["hash"].lower()
    return listed


def opa_file_hash(name: str, content: bytes, *, source: str = "bundle") -> str:
    """The hex SHA-256 OPA signs for a file (of ``opa_hashed_bytes``)."""
    return hashlib.sha256(opa_hashed_bytes(name, content, source=source)).hexdigest()


def opa_hashed_bytes(name: str, content: bytes, *, source: str = "bundle") -> bytes:
    """What OPA hashes for a file: its bytes, or for ``data.json`` and ``.manifest`` the parsed
    JSON written in sorted-key order with Go's encoder (``bundle/hash.go``: numbers as written,
    no HTML escaping).

    Raises:
        PolicyLoadError: a structured file that is not JSON.
    """
    if name.rsplit("/", 1)[-1] not in STRUCTURED:
        return content
    value = _json_preserving_numbers(content, f"{source}: {name}")
    out: list[bytes] = []
    _walk(value, out)
    return b"".join(out)


class _Number(str):
    """A JSON number kept as written (Go's ``json.Number``)."""


def _json_preserving_numbers(content: bytes, what: str) -> Any:
    text = content[3:] if content.startswith(b"\xef\xbb\xbf") else content
    try:
        return json.loads(
            text.decode("utf-8"),
            parse_int=_Number,
            parse_float=_Number,
            parse_constant=_refuse_constant,
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise PolicyLoadError(f"{what} is not JSON") from exc


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _walk(value: Any, out: list[bytes]) -> None:
    if isinstance(value, dict):
        out.append(b"{")
        for index, key in enumerate(sorted(value, key=_go_order)):
            if index:
                out.append(b",")
            out.append(_go_string(key))
            out.append(b":")
            _walk(value[key], out)
        out.append(b"}")
    elif isinstance(value, list):
        out.append(b"[")
        for index, item in enumerate(value):
            if index:
                out.append(b",")
            _walk(item, out)
        out.append(b"]")
    elif isinstance(value, _Number):
        out.append(value.encode("ascii"))
    elif isinstance(value, str):
        out.append(_go_string(value))
    else:  # True, False, None
        out.append(json.dumps(value).encode("ascii"))


def _go_order(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


GO_SHORT_ESCAPES = {0x22: b'\\"', 0x5C: b"\\\\", 0x08: b"\\b", 0x0C: b"\\f", 0x0A: b"\\n"}
GO_SHORT_ESCAPES |= {0x0D: b"\\r", 0x09: b"\\t"}


def _go_string(text: str) -> bytes:
    """A string as Go's ``json.Encoder`` writes it with HTML escaping off."""
    out = bytearray(b'"')
    for char in text:
        code = ord(char)
        if code in GO_SHORT_ESCAPES:
            out += GO_SHORT_ESCAPES[code]
        elif code < 0x20:
            out += b"\\u00%02x" % code
        elif code in (0x2028, 0x2029):
            out += b"\\u%04x" % code
        elif 0xD800 <= code <= 0xDFFF:  # a lone surrogate: Go decoded it as U+FFFD
            out += "\ufffd".encode()
        else:
            out += char.encode("utf-8")
    out += b'"'
    return bytes(out)


def _json_object(content: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PolicyLoadError(f"{what} is not JSON") from exc
    if not isinstance(value, dict):
        raise PolicyLoadError(f"{what} is not a JSON object")
    return value


# --- writing -----------------------------------------------------------------------------------


def signing_algorithm(key: Any) -> str:
    """RS256 for RSA keys, ES256 for P-256 keys (what ``--signing-alg`` OPA needs to verify).

    Raises:
        PolicyLoadError: for any other key.
    """
    if isinstance(key, rsa.RSAPublicKey | rsa.RSAPrivateKey):
        return "RS256"
    if isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey) and isinstance(
        key.curve, ec.SECP256R1
    ):
        return "ES256"
    raise PolicyLoadError("bundle keys are RSA (RS256) or EC P-256 (ES256)")


def signatures_file(
    files: Mapping[str, bytes],
    private_key: Any,
    *,
    key_id: str = "default",
    scope: str = "",
    claims: Mapping[str, Any] | None = None,
) -> bytes:
    """``.signatures.json`` for ``files`` in OPA's format, signed deterministically (RSA
    PKCS#1 v1.5, or ECDSA with RFC 6979 nonces) so that a build is byte-for-byte reproducible.

    Raises:
        PolicyLoadError: for a key that is neither RSA nor P-256.
    """
    algorithm = signing_algorithm(private_key)
    payload: dict[str, Any] = {
        "files": [
            {"name": name, "hash": opa_file_hash(name, files[name]), "algorithm": HASH_ALGORITHM}
            for name in sorted(files)
            if name != SIGNATURES
        ],
        "keyid": key_id,
    }
    if scope:
        payload["scope"] = scope
    payload.update(claims or {})  # freshness: policy_version, policy_expires (OPA ignores them)
    header = {"alg": algorithm, "kid": key_id, "typ": "JWT"}
    signing_input = (
        b64url_encode(_compact(header)) + "." + b64url_encode(_compact(payload))
    ).encode("ascii")
    if algorithm == "RS256":
        signature = private_key.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    else:
        der = private_key.sign(signing_input, ec.ECDSA(hashes.SHA256(), deterministic_signing=True))
        r, s = utils.decode_dss_signature(der)
        signature = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    token = signing_input.decode("ascii") + "." + b64url_encode(signature)
    return _compact({"signatures": [token]})


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")


def load_public_key(pem: bytes) -> Any:
    """A PEM public key (or certificate) for bundle verification.

    Raises:
        PolicyLoadError: not a PEM public key of a supported kind.
    """
    from cryptography import x509  # noqa: PLC0415

    try:
        key: Any = (
            x509.load_pem_x509_certificate(pem).public_key()
            if b"CERTIFICATE" in pem
            else serialization.load_pem_public_key(pem)
        )
    except ValueError as exc:
        raise PolicyLoadError("the bundle verification key is not a PEM public key") from exc
    signing_algorithm(key)
    return key
