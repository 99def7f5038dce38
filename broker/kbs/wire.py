"""The KBS protocol 0.4.0 as stock Confidential Containers guests speak it (issue 33): the
constants they send and match, the report data their evidence binds, the error bodies they parse.

Read from the code, not the docs (paths in confidential-containers/guest-components, in
confidential-containers/trustee, and in kbs-types 0.18):

* version: the guest sends exactly ``0.4.0`` (``kbs_protocol/src/client/mod.rs``); Trustee
  parses it as semver and requires ``=0.4.0`` (``kbs/src/attestation/backend.rs``), answering a
  mismatch with the detail below.
* report data: ``rcar_client.rs get_composite_evidence`` hashes the JCS (RFC 8785,
  ``serde_json_canonicalizer``) of ``{"tee-pubkey", "nonce", "additional-evidence"}`` with the
  challenge's ``selected-hash-algorithm`` (lower-cased; SHA-384 when absent), and the TDX and
  SNP attesters pad it with zero bytes to 64 (``attester/src/{tdx,snp}/mod.rs``); Trustee
  rebuilds the same object (``backend.rs``) and pads or truncates to 64
  (``deps/verifier/src/lib.rs regularize_data``).
* errors: ``kbs/src/error.rs``: ``{"type": ".../errors/<variant>", "detail": <Display>}``
  (``kbs_types::ErrorInformation``), 404 for ``InvalidRequestPath`` and ``PluginNotFound``, 401
  for everything else. The guest re-handshakes on 401 (at most 3 tries for a resource), reports
  404 as not found and anything else as fatal (``rcar_client.rs get_resource``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes

from broker.crypto.kbs_jwe import parse_tee_pubkey

PROTOCOL_VERSION = "0.4.0"
VERSION_REQUIREMENT = "=0.4.0"  # how Trustee prints its semver::VersionReq in the detail
KBS_PREFIX = "/kbs/v0"
SESSION_COOKIE = "kbs-session-id"
NONCE_BYTES = 32  # Trustee: 32 random bytes, standard base64 with padding
SUPPORTED_HASH_ALGORITHMS = "supported-hash-algorithms"  # the guest's Request extra-params
SELECTED_HASH_ALGORITHM = "selected-hash-algorithm"  # the server's Challenge extra-params
# kbs_types::HashAlgorithm: every name the guest lists, the default it uses without a selection.
HASH_ALGORITHMS: Mapping[str, type[hashes.HashAlgorithm]] = {
    "sha256": hashes.SHA256,
    "sha384": hashes.SHA384,
    "sha512": hashes.SHA512,
    "sm3": hashes.SM3,
}
DEFAULT_HASH_ALGORITHM = "sha384"
REPORT_DATA_BYTES = 64
# kbs_types::Tee as serde names it (no "sev"); "nvidiadpu" is read as "nvidia-dpu".
TEE_NAMES = frozenset(
    {"az-snp-vtpm", "az-tdx-vtpm", "nvidia", "sgx", "snp", "tdx", "cca", "csv", "se"}
    | {"hygondcu", "nvidia-dpu", "tpm", "sample", "sampledevice"}
)
TEE_ALIASES = {"nvidiadpu": "nvidia-dpu"}
# What a guest with no TEE falls back to, unsigned: refused unless a development switch is on.
SAMPLE_TEES = frozenset({"sample", "sampledevice"})
ERROR_TYPE_PREFIX = "https://github.com/confidential-containers/kbs/errors/"
# Every variant of Trustee's kbs/src/error.rs Error, with the status Trustee answers it with.
ERROR_STATUS: Mapping[str, int] = {
    "AdminAuthInitialization": 401,
    "AdminAuthAccess": 401,
    "AttestationError": 401,  # /auth and /attest, the version mismatch among them
    "HTTPFailed": 401,
    "HTTPSFailed": 401,
    "InvalidRequestPath": 404,
    "JweError": 401,
    "PluginManagerInitialization": 401,
    "PluginNotFound": 404,
    "PluginInternalError": 401,  # a resource the backend does not have, too
    "PolicyDeny": 401,
    "ParsePolicyError": 401,
    "PolicyEngineError": 401,
    "RvpsError": 401,
    "SerdeError": 401,
    "StorageBackendInitialization": 401,
    "TokenNotFound": 401,
    "TokenVerifierError": 401,
    "PrometheusError": 401,
}
# semver 2.0.0 (semver.org's regular expression), as Rust's semver crate parses a version.
_PRE = r"(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_SEMVER = re.compile(
    rf"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-({_PRE}(?:\.{_PRE})*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?",
    re.ASCII,
)
_AUTH_FAILED = "Attestation error: RCAR handshake Auth failed: "


def version_refusal(requested: str) -> str | None:
    """None when Trustee's ``=0.4.0`` requirement admits ``requested`` (build metadata aside),
    else the ``AttestationError`` detail Trustee answers (401); guests match its text
    ``KBS Client Protocol Version Mismatch``."""
    parsed = _SEMVER.fullmatch(requested)
    if parsed is None:
        return _AUTH_FAILED + "failed to parse KBS version"
    if parsed.group(1, 2, 3) == ("0", "4", "0") and parsed.group(4) is None:
        return None
    return (
        _AUTH_FAILED + "KBS Client Protocol Version Mismatch: "
        f"expect {VERSION_REQUIREMENT} while the request is {requested}"
    )


def canonical_tee(name: str) -> str | None:
    """The ``kbs_types::Tee`` a request's ``tee`` names, or None for a name it does not know."""
    name = TEE_ALIASES.get(name, name)
    return name if name in TEE_NAMES else None


def error_status(name: str) -> int:
    """The HTTP status Trustee answers error ``name`` with (KeyError for a name it lacks)."""
    return ERROR_STATUS[name]


def error_body(name: str, detail: str) -> bytes:
    """The body of a non-200 answer, byte for byte as Trustee writes it
    (``serde_json::to_string`` of ``ErrorInformation``: ``type``, then ``detail``).

    Raises:
        ValueError: ``name`` is not one of Trustee's error variants (``ERROR_STATUS``).
    """
    if name not in ERROR_STATUS:
        raise ValueError(f"{name!r} is not an error Trustee answers")
    body = {"type": ERROR_TYPE_PREFIX + name, "detail": detail}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def expected_report_data(
    tee_pubkey: Mapping[str, Any],
    nonce: str,
    additional_evidence: str,
    hash_alg: str = DEFAULT_HASH_ALGORITHM,
) -> bytes:
    """The 64 bytes a guest's TDX or SNP evidence must carry as report data.

    ``hash_alg`` is the name the challenge selected (any case, as the guest lower-cases it).
    ``tee_pubkey`` counts only through the members ``kbs_types::TeePubKey`` keeps.

    Raises:
        InputError: ``tee_pubkey_unsupported`` or ``tee_pubkey_invalid`` (``parse_tee_pubkey``).
        ValueError: a hash the guest does not know, or a string JSON cannot carry.
    """
    algorithm = HASH_ALGORITHMS.get(hash_alg.lower())
    if algorithm is None:
        raise ValueError(f"{hash_alg!r} is not a hash algorithm guests know")
    runtime_data = {
        "tee-pubkey": dict(parse_tee_pubkey(tee_pubkey).members),
        "nonce": nonce,
        "additional-evidence": additional_evidence,
    }
    digest = hashes.Hash(algorithm())
    digest.update(jcs(runtime_data))
    return digest.finalize().ljust(REPORT_DATA_BYTES, b"\0")[:REPORT_DATA_BYTES]


def jcs(value: Any) -> bytes:
    """RFC 8785 (JSON Canonicalization Scheme) for JSON without fractions: objects with their
    members sorted by UTF-16 code units, strings escaped as ECMAScript's ``JSON.stringify`` does
    (which ``json.dumps`` with ``ensure_ascii=False`` matches), integers up to 2**53.

    Raises:
        ValueError: a float, an integer beyond 2**53, a lone surrogate, a key not a string.
        TypeError: a value that is not JSON (a set, bytes…).
    """
    return _jcs(value).encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate


def _jcs(value: Any) -> str:
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise ValueError("JSON object keys are strings")
        keys = sorted(value, key=lambda key: key.encode("utf-16-be"))
        return "{" + ",".join(f"{_jcs(key)}:{_jcs(value[key])}" for key in keys) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_jcs(item) for item in value) + "]"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        raise ValueError("an integer beyond 2**53 has no exact JSON number")
    if isinstance(value, float):
        # a JSON value all the same: refused as a ValueError, like the others
        raise ValueError("fractions: RFC 8785 number formatting not implemented")  # noqa: TRY004
    return json.dumps(value, ensure_ascii=False)
