"""Simulated attestation issuer for ``broker demo`` and tests. DEVELOPMENT ONLY.

It mints tokens shaped like Google Cloud Attestation (Confidential Space) OIDC tokens
(docs/evidence.md), signed RS256 by a key generated in memory, under its own issuer URL in the
reserved ``.invalid`` domain, so its tokens can never pass for Google's: a broker trusts them
only if its configuration lists this issuer and its JWKS explicitly.

It refuses to exist unless dev mode is explicitly on (``DevIssuer(dev_mode=True)``) and its
issuer's host, however spelled, is under ``.invalid`` and is not Google's; nothing on the
``broker serve`` path imports this package.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from broker.core.hostnames import in_domain, normal_host
from broker.crypto.jwk import public_jwk

DEV_ISSUER = "https://dev-attestation.invalid/confidential-space"
ISSUER_FILE = "dev-issuer.json"  # a `broker dev init` workspace keeps its issuer here
GOOGLE_ISSUER = "https://confidentialcomputing.googleapis.com"


class DevModeRequired(RuntimeError):
    """The development issuer was used without dev mode switched on."""


@dataclass(frozen=True)
class Workload:
    """What the simulated Confidential Space VM reports about itself."""

    image_digest: str
    image_reference: str = "us-docker.pkg.dev/demo-project/runners/sealed-runner:1.0"
    hwmodel: str = "GCP_INTEL_TDX"
    debug: bool = False
    support: tuple[str, ...] = ("STABLE", "LATEST")
    project_id: str = "demo-project"
    zone: str = "us-central1-a"
    instance_name: str = "sealed-runner-0"
    instance_id: str = "1234567890123456789"
    gpu_cc_mode: str | None = None  # "ON" adds submods.nvidia_gpu.cc_mode, as on GPU VMs
    extra_claims: Mapping[str, Any] = field(default_factory=dict)


class DevIssuer:
    """Mints GCA-shaped tokens with an in-memory RSA key."""

    def __init__(
        self, *, dev_mode: bool, issuer: str = DEV_ISSUER, key: rsa.RSAPrivateKey | None = None
    ) -> None:
        """``key``: the signing key to use (default: a new RSA-2048 key)."""
        if dev_mode is not True:
            raise DevModeRequired("the development issuer needs dev mode explicitly on")
        _require_development_url(issuer)
        self.issuer = issuer
        self._key = key or rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = secrets.token_hex(20)

    def save(self, path: Path) -> None:
        """Keep this issuer (its key and ``kid``) in a private file of a ``broker dev``
        workspace, so that tokens minted later verify against the JWKS written now."""
        pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode("ascii")
        path.write_text(json.dumps({"issuer": self.issuer, "kid": self.kid, "key": pem}))
        path.chmod(0o600)

    @classmethod
    def load(cls, path: Path) -> DevIssuer:
        """The issuer ``save`` kept (dev mode is implied: only ``broker dev`` writes these).

        Raises:
            ValueError: not such a file.
        """
        document = json.loads(path.read_text(encoding="utf-8"))
        key = serialization.load_pem_private_key(document["key"].encode(), password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"{path}: not a development issuer's RSA key")  # noqa: TRY004
        issuer = cls(dev_mode=True, issuer=str(document["issuer"]), key=key)
        issuer.kid = str(document["kid"])
        return issuer

    def jwks(self) -> dict[str, Any]:
        entry = {
            **public_jwk(self._key.public_key()),
            "alg": "RS256",
            "kid": self.kid,
            "use": "sig",
        }
        return {"keys": [entry]}

    def write_jwks(self, path: Path) -> None:
        path.write_text(json.dumps(self.jwks(), indent=2), encoding="utf-8")

    def sign(self, claims: dict[str, Any], headers: dict[str, Any] | None = None) -> str:
        """RS256-sign arbitrary claims with the issuer key (tests craft hostile tokens).
        ``headers`` replace the default ``{"kid": <this key>}``."""
        chosen = {"kid": self.kid} if headers is None else headers
        return jwt.encode(claims, self._key, algorithm="RS256", headers=chosen)

    def mint(
        self,
        *,
        audience: str,
        nonces: Sequence[str],
        workload: Workload,
        now: datetime,
        lifetime: timedelta = timedelta(hours=1),
    ) -> str:
        """A signed token with the claims a Confidential Space VM would get."""
        issued = int(now.timestamp())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "aud": audience,
            "iat": issued,
            "nbf": issued,
            "exp": issued + int(lifetime.total_seconds()),
            "sub": (
                "https://www.googleapis.com/compute/v1/projects/"
                f"{workload.project_id}/zones/{workload.zone}/instances/{workload.instance_name}"
            ),
            "eat_nonce": nonces[0] if len(nonces) == 1 else list(nonces),
            "eat_profile": "https://cloud.google.com/confidential-computing/confidential-space/docs/reference/token-claims",
            "secboot": True,
            "oemid": 11129,
            "hwmodel": workload.hwmodel,
            "swname": "CONFIDENTIAL_SPACE",
            "swversion": ["250301"],
            "dbgstat": "enabled" if workload.debug else "disabled-since-boot",
            "submods": _submods(workload),
            "google_service_accounts": [f"runner@{workload.project_id}.iam.gserviceaccount.com"],
            **workload.extra_claims,
        }
        return jwt.encode(claims, self._key, algorithm="RS256", headers={"kid": self.kid})


def _require_development_url(issuer: str) -> None:
    """The issuer's host, in its one normal spelling (``core/hostnames.py``), is under
    ``.invalid`` and is not Google's: ``https://ConfidentialComputing.googleapis.com.`` is
    Google's issuer too, and ``https://dev.invalid.`` is a development issuer.

    Raises:
        DevModeRequired: any other issuer URL.
    """
    try:
        host = urlsplit(issuer).hostname or ""
        google = urlsplit(GOOGLE_ISSUER).hostname or ""
        if normal_host(host) == normal_host(google):
            raise DevModeRequired("the development issuer must not use Google's issuer URL")
    except ValueError as exc:
        raise DevModeRequired(f"not an issuer URL: {issuer!r}") from exc
    if not in_domain(host, "invalid"):
        raise DevModeRequired("the development issuer's URL must be under .invalid (RFC 2606)")


def _submods(workload: Workload) -> dict[str, Any]:
    space: dict[str, Any] = {"monitoring_enabled": {"memory": False}}
    if not workload.debug:  # real debug images carry no support attributes
        space["support_attributes"] = list(workload.support)
    gpu = {"nvidia_gpu": {"cc_mode": workload.gpu_cc_mode}} if workload.gpu_cc_mode else {}
    return {
        **gpu,
        "confidential_space": space,
        "container": {
            "image_reference": workload.image_reference,
            "image_digest": workload.image_digest,
            "image_id": "sha256:" + "0" * 64,
            "restart_policy": "Never",
            "args": ["/runner"],
            "env": {"HOSTNAME": workload.instance_name},
        },
        "gce": {
            "zone": workload.zone,
            "project_id": workload.project_id,
            "project_number": "100000000001",
            "instance_name": workload.instance_name,
            "instance_id": workload.instance_id,
        },
    }


class DevTokenSource:
    """A ``TokenSource`` that asks the development issuer instead of a launcher."""

    evidence_kind = "gca"

    def __init__(
        self, issuer: DevIssuer, workload: Workload, clock: Callable[[], datetime]
    ) -> None:
        self._issuer = issuer
        self._workload = workload
        self._clock = clock

    @classmethod
    def from_workspace(cls, workspace: Path, *, image: str, **workload: Any) -> DevTokenSource:
        """Tokens from a ``broker dev init`` workspace's issuer, for a workload running
        ``image`` (a ``sha256:…`` digest the workspace's policy allows)."""
        issuer = DevIssuer.load(workspace / ISSUER_FILE)
        return cls(issuer, Workload(image_digest=image, **workload), lambda: datetime.now(UTC))

    async def token(self, audience: str, nonces: Sequence[str]) -> str:
        return self._issuer.mint(
            audience=audience, nonces=nonces, workload=self._workload, now=self._clock()
        )
