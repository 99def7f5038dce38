"""Workload Identity Federation for the Cloud KMS clients (``[keys] kms_credentials``).

A sealed broker must not reach Cloud KMS as the VM's service account: whoever administers the
project can act as that account from anywhere. It presents its own attestation instead. The
Confidential Space launcher writes the workload's token (audience ``https://sts.googleapis.com``,
renewed before it expires) to ``/run/container_launcher/attestation_verifier_claims_token``;
google-auth's identity-pool credentials read that file, exchange the token at the Security Token
Service (RFC 8693) for a federated access token, and the KMS clients present that token. The
provider's attribute condition lets only the attested image (digest, production Confidential
Space, ``STABLE`` support, not debug) through the STS, and the key's IAM policy grants the key
only to that image's principal set (``deploy/confidential-space/broker/wif.sh``).

The credential configuration is checked before google-auth sees it (Google's advice for a
configuration from outside: cloud.google.com/docs/authentication/external/
externally-sourced-credentials), because it says where the attestation token is sent: an
operator who pointed ``token_url`` at their own server would receive a bearer token that the real
STS honours. Accepted: ``type: external_account``, a workload identity pool provider as audience,
a JWT read from a file, the STS at ``*.googleapis.com`` (or loopback), nothing else: no
service-account impersonation, no client secret, no URL or executable source.

The exchange is blocking HTTP (google-auth uses ``requests``): it runs on a worker thread, once
per token lifetime, before the RPC that needs it, bounded by the KMS time-out; an STS refusal is
reported as such instead of as a failed RPC.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from google.auth import exceptions as auth_exceptions
from google.auth import identity_pool
from google.auth.transport import requests as auth_requests

from broker.config import is_loopback
from broker.core.errors import ConfigError, UpstreamError

log = logging.getLogger(__name__)

SETTING = "keys.kms_credentials"
CLOUD_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
JWT_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:jwt"  # noqa: S105 (a type URN)
TEXT_FORMAT = dict(type="text")  # noqa: C408 - not a {"type": …} record literal (test_audit_feeds)
LAUNCHER_TOKEN_FILE = "/run/container_launcher/attestation_verifier_claims_token"  # noqa: S105
MAX_CONFIG_BYTES = 64 * 1024
PROVIDER_AUDIENCE = re.compile(
    r"^//iam\.googleapis\.com/projects/[0-9]+/locations/global/"
    r"workloadIdentityPools/[a-z0-9-]{4,32}/providers/[a-z0-9-]{4,32}$"
)
# What `gcloud iam workload-identity-pools create-cred-config --credential-source-file` writes.
ALLOWED_FIELDS = frozenset(
    {
        "type",
        "audience",
        "subject_token_type",
        "token_url",
        "token_info_url",
        "credential_source",
        "universe_domain",
        "quota_project_id",
    }
)

Unavailable = Callable[[str], UpstreamError]


def config_problem(info: Mapping[str, Any]) -> str | None:  # noqa: PLR0911 (one check each)
    """What makes ``info`` unfit to carry the broker's attestation token; ``None``: nothing."""
    if info.get("type") != "external_account":
        return (
            f"type {info.get('type')!r}: only a Workload Identity Federation configuration "
            "(type external_account), never a service-account key or user credentials"
        )
    extra = sorted(set(info) - ALLOWED_FIELDS)
    if extra:
        return f"{extra} not allowed (no impersonation, client secret or workforce pool)"
    if not PROVIDER_AUDIENCE.match(str(info.get("audience", ""))):
        return (
            "audience must be //iam.googleapis.com/projects/NUMBER/locations/global/"
            "workloadIdentityPools/POOL/providers/PROVIDER"
        )
    if info.get("subject_token_type") != JWT_TOKEN_TYPE:
        return f"subject_token_type must be {JWT_TOKEN_TYPE} (the attestation token)"
    source = info.get("credential_source")
    if (
        not isinstance(source, dict)
        or set(source) - {"file", "format"}
        or not Path(str(source.get("file", ""))).is_absolute()
        or source.get("format", TEXT_FORMAT) != TEXT_FORMAT
    ):
        return f'credential_source must be {{"file": "{LAUNCHER_TOKEN_FILE}"}} (a text file)'
    if info.get("universe_domain", "googleapis.com") != "googleapis.com":
        return "universe_domain must be googleapis.com"
    for field in ("token_url", "token_info_url"):
        if field in info and not sts_url_allowed(str(info[field])):
            return (
                f"{field} must be https://sts.googleapis.com/… (or loopback): the attestation "
                "token is a bearer credential at the STS"
            )
    return None


def sts_url_allowed(url: str) -> bool:
    """Google's STS (global or a regional ``sts.LOCATION.rep`` endpoint), or loopback."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:
        return False
    google = host == "sts.googleapis.com" or (
        host.startswith("sts.") and host.endswith(".rep.googleapis.com")
    )
    return (parts.scheme == "https" and google) or (
        parts.scheme in {"http", "https"} and is_loopback(host)
    )


def read_config(path: Path) -> dict[str, Any]:
    """The credential configuration at ``path``, checked (``config_problem``).

    Raises:
        ConfigError: ``keys.kms_credentials``, naming the file and what is wrong.
    """
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(SETTING, f"cannot read {path} ({exc.strerror})") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(SETTING, f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        info = json.loads(data)
    except ValueError as exc:
        raise ConfigError(SETTING, f"{path} is not a JSON credential configuration") from exc
    if not isinstance(info, dict):
        raise ConfigError(SETTING, f"{path} is not a JSON object")
    problem = config_problem(info)
    if problem:
        raise ConfigError(SETTING, f"{path}: {problem}")
    return info


class _BoundedRequest(auth_requests.Request):
    """google-auth's ``requests`` transport with our time-out instead of its 120 s default."""

    def __init__(self, timeout_seconds: float) -> None:
        super().__init__()
        self._timeout = timeout_seconds

    def __call__(  # type: ignore[override]
        self, url: str, method: str = "GET", body: Any = None, headers: Any = None, **kwargs: Any
    ) -> Any:
        kwargs["timeout"] = self._timeout
        return super().__call__(  # type: ignore[no-untyped-call]
            url, method=method, body=body, headers=headers, **kwargs
        )


class FederatedCredentials:
    """The identity-pool credentials of one KMS client, and the exchange that keeps them fresh."""

    def __init__(self, credentials: identity_pool.Credentials, *, timeout_seconds: float) -> None:
        self.credentials = credentials
        self._timeout = timeout_seconds
        self._lock = asyncio.Lock()

    @classmethod
    def from_file(cls, path: Path, *, timeout_seconds: float) -> FederatedCredentials:
        """Load and check ``path`` (blocking: call on a worker thread).

        Raises:
            ConfigError: ``keys.kms_credentials``: unreadable, or not a configuration we accept.
        """
        info = read_config(path)
        try:
            credentials = identity_pool.Credentials.from_info(  # type: ignore[no-untyped-call]
                info, scopes=[CLOUD_SCOPE]
            )
        except (ValueError, auth_exceptions.GoogleAuthError) as exc:
            raise ConfigError(SETTING, f"{path}: google-auth refused it ({exc})") from exc
        return cls(credentials, timeout_seconds=timeout_seconds)

    async def ensure_fresh(self, unavailable: Unavailable) -> None:
        """Exchange the attestation token unless the federated token is still valid.

        Raises:
            UpstreamError: from ``unavailable``: the STS refused the token (naming its OAuth
                error), or the exchange failed (the token file, the STS's reachability).
        """
        if self.credentials.valid:
            return
        async with self._lock:
            if self.credentials.valid:  # another request refreshed it meanwhile
                return
            request = _BoundedRequest(self._timeout)
            try:
                await asyncio.wait_for(
                    asyncio.to_thread(self.credentials.refresh, request), self._timeout
                )
            except auth_exceptions.OAuthError as exc:
                error, description = _oauth_error(exc)
                log.warning("the STS refused the attestation token: %s: %s", error, description)
                raise unavailable(
                    f"the STS refused this broker's attestation token ({error}): the provider's "
                    "attribute condition (image digest, CONFIDENTIAL_SPACE, STABLE, not debug) "
                    "does not admit this image; the broker log has the STS's reason"
                ) from exc
            except (auth_exceptions.GoogleAuthError, TimeoutError, OSError) as exc:
                log.warning("attestation token exchange failed: %s", exc)
                raise unavailable(
                    f"the attestation token exchange at the STS failed ({type(exc).__name__}); "
                    "the broker log names the cause"
                ) from exc


def _oauth_error(exc: auth_exceptions.OAuthError) -> tuple[str, str]:
    """The OAuth ``error`` and a printable, bounded ``error_description`` of an STS answer."""
    body: Any = exc.args[1] if len(exc.args) > 1 else ""
    try:
        answer = json.loads(body)
    except (TypeError, ValueError):
        answer = {}
    if not isinstance(answer, dict):
        answer = {}
    error = str(answer.get("error", "unknown_error"))
    description = str(answer.get("error_description", ""))
    return _printable(error, 64) or "unknown_error", _printable(description, 300)


def _printable(text: str, limit: int) -> str:
    return "".join(c for c in text if c.isprintable())[:limit]


async def open_federated(path: Path | None, timeout_seconds: float) -> FederatedCredentials | None:
    """``[keys] kms_credentials`` loaded on a worker thread; ``None`` when unset.

    Raises:
        ConfigError: see ``FederatedCredentials.from_file``.
    """
    if path is None:
        return None
    return await asyncio.to_thread(
        FederatedCredentials.from_file, path, timeout_seconds=timeout_seconds
    )
