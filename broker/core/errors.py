"""The one error tree of the broker.

Every error the broker can show a client has a stable code (``ErrorCode``, spelled once, here) and
an HTTP status. The tree is split by who is at fault:

* ``InputError`` (4xx): bad or hostile input from the caller, including failed attestation.
* ``PolicyDenied`` (403): the evidence verified, the policy said no.
* ``UpstreamError`` (502/503): a dependency (JWKS source, KEK, key store, nonce store, policy
  engine, decision log) could not answer. Nothing is released.
* ``ConfigError``: bad configuration; raised at start-up. It is deliberately *not* a
  ``BrokerError``: the error middleware cannot render it, so a configuration problem reached at
  request time is a logged ``internal_error`` without details, never its text.

Messages are written for the client and must never contain secrets; exception chains and
tracebacks go to the server log only.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    """Stable error codes. Clients and auditors match on these; never rename one."""

    # request shape
    BAD_REQUEST = "bad_request"
    BAD_INPUT = "bad_input"  # CLI: an argument or input file is unusable
    REQUEST_TIMEOUT = "request_timeout"
    MALFORMED_JSON = "malformed_json"
    BODY_TOO_LARGE = "body_too_large"
    NOT_FOUND = "not_found"
    RATE_LIMITED = "rate_limited"  # too many requests from one address (Retry-After)
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    RUNNER_KEY_INVALID = "runner_key_invalid"
    EVIDENCE_UNSUPPORTED = "evidence_unsupported"
    # attestation token
    TOKEN_MALFORMED = "token_malformed"
    TOKEN_TOO_LARGE = "token_too_large"
    TOKEN_ALGORITHM_FORBIDDEN = "token_algorithm_forbidden"
    TOKEN_HEADER_FORBIDDEN = "token_header_forbidden"
    TOKEN_KEY_UNKNOWN = "token_key_unknown"
    TOKEN_SIGNATURE_INVALID = "token_signature_invalid"
    TOKEN_CLAIM_MISSING = "token_claim_missing"
    TOKEN_CLAIM_INVALID = "token_claim_invalid"
    TOKEN_EXPIRED = "token_expired"
    TOKEN_NOT_YET_VALID = "token_not_yet_valid"
    TOKEN_ISSUED_IN_FUTURE = "token_issued_in_future"
    ISSUER_UNKNOWN = "issuer_unknown"
    CERT_CHAIN_INVALID = "cert_chain_invalid"
    KID_MISMATCH = "kid_mismatch"
    # raw evidence (NVIDIA GPUs and tokens' evidence members)
    EVIDENCE_MALFORMED = "evidence_malformed"
    EVIDENCE_SIGNATURE_INVALID = "evidence_signature_invalid"
    SUBMOD_DIGEST_MISMATCH = "submod_digest_mismatch"
    FWID_MISMATCH = "fwid_mismatch"
    GPU_ARCH_MISMATCH = "gpu_arch_mismatch"
    GPU_EVIDENCE_DUPLICATE = "gpu_evidence_duplicate"  # one device's evidence listed twice
    RIM_INVALID = "rim_invalid"
    AUDIENCE_MISMATCH = "audience_mismatch"
    # binding of evidence to this request
    NONCE_UNKNOWN = "nonce_unknown"
    NONCE_REUSED = "nonce_reused"
    NONCE_MISSING = "nonce_missing"
    NONCE_MISMATCH = "nonce_mismatch"
    KEY_BINDING_MISMATCH = "key_binding_mismatch"
    # proof of possession (DPoP, RFC 9449) of the key an attestation result is bound to
    DPOP_PROOF_INVALID = "dpop_proof_invalid"
    DPOP_NONCE_REQUIRED = "use_dpop_nonce"  # RFC 9449 §8's name: retry with DPoP-Nonce
    DPOP_PROOF_REUSED = "dpop_proof_reused"  # a proof's jti was already spent
    ATTESTATION_UNKNOWN = "attestation_unknown"  # not in the store: never issued, or expired
    ATTESTATION_REVOKED = "attestation_revoked"
    # the shared store's entry is not what the signed result says (tampered or corrupted): 503
    ATTESTATION_STORE_MISMATCH = "attestation_store_mismatch"
    # admin authentication
    UNAUTHORIZED = "unauthorized"
    ORIGIN_REFUSED = "origin_refused"  # a console form posted from another origin (CSRF): 403
    CONSOLE_BUSY = "console_busy"  # every console read slot of a worker stayed taken: 503
    # keys
    KEY_UNKNOWN = "key_unknown"
    KEY_VERSION_UNAVAILABLE = "key_version_unavailable"
    KEY_EXISTS = "key_exists"
    CONFLICT = "conflict"  # a concurrent change won; retry with fresh state
    # policy
    POLICY_DENIED = "policy_denied"
    POLICY_INVALID = "policy_invalid"  # a reload refused: the last good policy keeps serving
    # a reload that not every worker confirmed in time, or after which workers disagree
    POLICY_RELOAD_INCOMPLETE = "policy_reload_incomplete"
    # upstreams (nothing released)
    NONCE_STORE_FULL = "nonce_store_full"
    NONCE_STORE_UNAVAILABLE = "nonce_store_unavailable"
    JWKS_UNAVAILABLE = "jwks_unavailable"
    POLICY_UNAVAILABLE = "policy_unavailable"
    KEK_UNAVAILABLE = "kek_unavailable"
    KEY_STORE_UNAVAILABLE = "key_store_unavailable"
    KEY_RECORD_INVALID = "key_record_invalid"  # a stored record its wrapped key contradicts
    AUDIT_LOG_UNAVAILABLE = "audit_log_unavailable"
    RIM_SOURCE_UNAVAILABLE = "rim_source_unavailable"  # the RIM directory cannot be read
    NOT_READY = "not_ready"
    # the one code for our own bugs; the message never carries details
    INTERNAL = "internal_error"
    # DPoP proofs bound to this broker (issue 27): the proof's key is not the result's cnf key,
    # its htu is none of [server] public_urls, its iat is not a sane integer NumericDate
    DPOP_KEY_MISMATCH = "dpop_key_mismatch"
    DPOP_HTU_MISMATCH = "dpop_htu_mismatch"
    DPOP_IAT_INVALID = "dpop_iat_invalid"
    HOST_INVALID = "host_invalid"  # a Host header that is not a host[:port] (RFC 9112 §3.2): 400
    # another replica's log (asked for by its origin) could not be read from that replica: 503
    LOG_PEER_UNAVAILABLE = "log_peer_unavailable"
    # an admin policy downgrade that does not name its target version (to_version): 400
    DOWNGRADE_TARGET_REQUIRED = "downgrade_target_required"
    # an owner's key import (POST /v1/admin/keys/import): the DEK is not 32 bytes of canonical
    # unpadded base64url (400); key material over plain HTTP off a loopback dev broker (400)
    KEY_MATERIAL_INVALID = "key_material_invalid"
    TLS_REQUIRED = "tls_required"
    # workload certificates (POST /v1/identity, issue 32): the CSR is not a PKCS#10 request, its
    # signature does not verify, its key is not P-256, its key is the result's PoP key (400);
    # it names a SPIFFE ID the identity policy did not give (403); the identity policy gives
    # none (403); the CA's key did not sign (503)
    CSR_INVALID = "csr_invalid"
    CSR_SIGNATURE_INVALID = "csr_signature_invalid"
    CSR_KEY_INVALID = "csr_key_invalid"
    CSR_KEY_IS_POP_KEY = "csr_key_is_pop_key"
    IDENTITY_NOT_ALLOWED = "identity_not_allowed"
    IDENTITY_DENIED = "identity_denied"
    IDENTITY_CA_UNAVAILABLE = "identity_ca_unavailable"
    # the KBS facade's answers (issue 33): a guest's tee-pubkey whose kty/crv/alg stock guests do
    # not use (400), or whose members make no key of the allowed size (400); a member the
    # answer's protected header would carry that is not an ASCII string or an integer (400)
    TEE_PUBKEY_UNSUPPORTED = "tee_pubkey_unsupported"
    TEE_PUBKEY_INVALID = "tee_pubkey_invalid"
    KBS_HEADER_MEMBER_INVALID = "kbs_header_member_invalid"
    # raw Intel TDX quotes (issue 33, attestation/raw/tdx.py): the quote does not parse or is
    # not a TDX ECDSA quote (401); its signatures, QE or PCK chain do not verify (401); the TCB
    # is Revoked or below every level Intel lists (401); the TD's attributes are refused (debug,
    # reserved bits, migration: 401); the collateral is malformed, does not verify or is not
    # for this platform (401) or is past its nextUpdate (401); none could be had (503)
    TDX_QUOTE_MALFORMED = "tdx_quote_malformed"
    TDX_QUOTE_INVALID = "tdx_quote_invalid"
    TDX_TCB_REVOKED = "tdx_tcb_revoked"
    TDX_TCB_UNSUPPORTED = "tdx_tcb_unsupported"
    TDX_TD_ATTRIBUTES_REFUSED = "tdx_td_attributes_refused"
    TDX_COLLATERAL_INVALID = "tdx_collateral_invalid"
    TDX_COLLATERAL_EXPIRED = "tdx_collateral_expired"
    TDX_COLLATERAL_UNAVAILABLE = "tdx_collateral_unavailable"
    # AMD SEV-SNP attestation reports verified by the broker (issue 33, attestation/raw/snp*.py):
    # the report or the guest's evidence object does not parse, or is of a version not read (401);
    # its CPU is no product known (401); it is signed by no VCEK/VLEK ECDSA P-384 key (401); the
    # VCEK/VLEK does not chain to a pinned AMD root at that time (401); the signature does not
    # verify (401); the certificate's TCB or hardware id is not the report's (401); the report
    # was asked for from a VMPL above [snp] max_vmpl (401); no VCEK/VLEK to be had (401); AMD's
    # key distribution service could not be reached (503)
    SNP_REPORT_MALFORMED = "snp_report_malformed"
    SNP_REPORT_VERSION_UNSUPPORTED = "snp_report_version_unsupported"
    SNP_PRODUCT_UNKNOWN = "snp_product_unknown"
    SNP_SIGNING_KEY_UNSUPPORTED = "snp_signing_key_unsupported"
    SNP_CERT_CHAIN_INVALID = "snp_cert_chain_invalid"
    SNP_SIGNATURE_INVALID = "snp_signature_invalid"
    SNP_TCB_MISMATCH = "snp_tcb_mismatch"
    SNP_CHIP_ID_MISMATCH = "snp_chip_id_mismatch"
    SNP_VMPL_REFUSED = "snp_vmpl_refused"
    SNP_VEK_MISSING = "snp_vek_missing"
    SNP_KDS_UNAVAILABLE = "snp_kds_unavailable"
    # the KBS protocol facade (issue 33, docs/kbs.md): answered as Trustee's ErrorInformation.
    # A handshake in another protocol version; a guest TEE with no verifier here; the unsigned
    # sample evidence while [kbs] allow_sample_evidence is off; a session cookie that is absent,
    # forged, expired or another session's; a session not (or no longer) attested; evidence
    # whose report data binds another key, nonce or additional evidence; init-data whose digest
    # is not the evidence's MRCONFIGID / HOST_DATA; a resource request with neither cookie nor
    # Bearer token, or a token that is not this broker's KBS token; a resource path outside
    # [kbs.resources] (404)
    KBS_VERSION_MISMATCH = "kbs_version_mismatch"
    KBS_TEE_UNSUPPORTED = "kbs_tee_unsupported"
    KBS_SAMPLE_REFUSED = "kbs_sample_refused"
    KBS_SESSION_INVALID = "kbs_session_invalid"
    KBS_SESSION_EXPIRED = "kbs_session_expired"
    KBS_SESSION_NOT_ATTESTED = "kbs_session_not_attested"
    KBS_REPORT_DATA_MISMATCH = "kbs_report_data_mismatch"
    KBS_INIT_DATA_MISMATCH = "kbs_init_data_mismatch"
    KBS_TOKEN_MISSING = "kbs_token_missing"
    KBS_TOKEN_INVALID = "kbs_token_invalid"
    KBS_RESOURCE_NOT_FOUND = "kbs_resource_not_found"


class BrokerError(Exception):
    """Root of every error the broker raises on purpose.

    Attributes:
        code: the stable error code.
        status: the HTTP status used when this error reaches a client.
        message: a client-safe sentence (no secrets, no exception text of dependencies).
        details: extra client-safe fields rendered next to ``code`` and ``message``.
        headers: response headers the error needs (``WWW-Authenticate``, ``DPoP-Nonce``).
    """

    status: int = 500
    default_code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: ErrorCode | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.details: dict[str, Any] = details
        self.headers: dict[str, str] = {}


class InternalFailure(BrokerError):
    """An exception that is not a ``BrokerError`` reached a decision (release, attestation): a
    bug. Logged with its traceback server-side; the client and the record see only
    ``internal_error``."""

    status = 500
    default_code = ErrorCode.INTERNAL


class InputError(BrokerError):
    """The caller sent something we refuse (400 unless a subclass says otherwise)."""

    status = 400
    default_code = ErrorCode.BAD_REQUEST


class BodyTooLarge(InputError):
    status = 413
    default_code = ErrorCode.BODY_TOO_LARGE


class UnsupportedMediaType(InputError):
    status = 415
    default_code = ErrorCode.UNSUPPORTED_MEDIA_TYPE


class RequestTimeout(InputError):
    """The client did not send its body within the configured time (408)."""

    status = 408
    default_code = ErrorCode.REQUEST_TIMEOUT


class Unauthorized(InputError):
    """Missing or wrong admin credentials (401)."""

    status = 401
    default_code = ErrorCode.UNAUTHORIZED


class Forbidden(InputError):
    """A request this caller may not make from where it comes (403)."""

    status = 403
    default_code = ErrorCode.ORIGIN_REFUSED


class NotFound(InputError):
    status = 404
    default_code = ErrorCode.NOT_FOUND


class Conflict(InputError):
    status = 409
    default_code = ErrorCode.KEY_EXISTS


class AttestationError(InputError):
    """Evidence did not verify or is not bound to this request (401)."""

    status = 401
    default_code = ErrorCode.TOKEN_MALFORMED


class KeyUnavailable(InputError):
    """The key exists but the requested version cannot be released (409)."""

    status = 409
    default_code = ErrorCode.KEY_VERSION_UNAVAILABLE


class PolicyDenied(BrokerError):
    """The policy evaluated and did not allow the release (403)."""

    status = 403
    default_code = ErrorCode.POLICY_DENIED

    def __init__(self, reasons: Sequence[str], decision_id: str) -> None:
        super().__init__(
            "the release policy denied this request",
            reasons=sorted(reasons),
            decision_id=decision_id,
        )


class UpstreamError(BrokerError):
    """A dependency could not answer; fail closed (503)."""

    status = 503
    default_code = ErrorCode.NOT_READY


class ConfigError(Exception):
    """Invalid configuration or CLI input; raised at start-up and reported naming the key.

    Not a ``BrokerError`` on purpose (see the module docstring).
    """

    code = ErrorCode.BAD_INPUT

    def __init__(self, key: str, problem: str) -> None:
        # A configuration key reads "config server.listen: …"; a command-line argument
        # ("--key", "BUNDLE") is named as argparse names it: "argument --key: …".
        where = "argument" if key.startswith("-") or key.isupper() else "config"
        super().__init__(f"{where} {key}: {problem}")
        self.key = key
        self.message = f"{where} {key}: {problem}"


class FileFormatError(ConfigError):
    """A file named on the command line or in the config is missing or is not what the command
    reads (a log, a backup, a weights file, a policy directory, a TOML config): one line naming
    the path, what is wrong and what to do; the CLI prints it and exits 2, without a traceback.
    """

    def __init__(self, path: object, problem: str, fix: str = "") -> None:
        super().__init__(str(path), problem)
        self.message = f"{path}: {problem}" + (f"; {fix}" if fix else "")
        self.args = (self.message,)
