"""A self-contained development workspace: TLS material, a development issuer's JWKS, a copy of
the shipped policies with data for the given keys, and a ``broker.toml`` pointing at all of it.

DEVELOPMENT ONLY: used by ``broker demo``, the tests and the benchmark.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from broker.dev.issuer import DevIssuer
from broker.dev.tls import make_dev_tls

# policies/ of the repository, installed with the package (pyproject: package-data)
SHIPPED_POLICIES = Path(__file__).resolve().parents[1] / "shipped" / "policies"


def write_dev_workspace(
    workdir: Path,
    issuer: DevIssuer,
    *,
    audience: str,
    images: Mapping[str, Sequence[str]],
    now: datetime,
    gpu_keys: Mapping[str, object] | None = None,
    jwks_url: str | None = None,
    server_extra: Mapping[str, object] | None = None,
    keys_extra: Mapping[str, object] | None = None,
    extra_toml: str = "",
    identities: Mapping[str, str] | None = None,
) -> Path:
    """Lay out the workspace and return the path of its ``broker.toml``. Every path the file
    names is relative to it: the workspace is self-contained and can move.

    Args:
        workdir: an empty or absent directory.
        issuer: the development issuer whose JWKS the broker trusts (or ``jwks_url`` serves).
        audience: ``server.audience``.
        images: image digests the shipped policy allows, per key name.
        now: start of the TLS certificates' validity.
        gpu_keys: ``data.broker.gpu_keys`` of the shipped policy.
        jwks_url: trust the issuer through a JWKS URL instead of a file.
        server_extra: further ``[server]`` keys; ``keys_extra``: further ``[keys]`` keys.
        extra_toml: appended verbatim (further sections).
        identities: ``data.broker.identities`` of the shipped identity policy (image digest →
            SPIFFE ID path).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    make_dev_tls(workdir / "tls", now=now)
    issuer.write_jwks(workdir / "jwks.json")
    policies = workdir / "policies" / "broker"
    policies.mkdir(parents=True, exist_ok=True)
    for module in (
        "release.rego",
        "attest.rego",
        "identity.rego",
        "kbs.rego",
    ):  # the shipped policies, tests aside
        (policies / module).write_bytes((SHIPPED_POLICIES / "broker" / module).read_bytes())
    data = json.loads((SHIPPED_POLICIES / "broker" / "data.json").read_text(encoding="utf-8"))
    data["images"] = {name: list(digests) for name, digests in images.items()}
    data["gpu_keys"] = dict(gpu_keys or {})
    data["identities"] = dict(identities or {})
    (policies / "data.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    server = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (server_extra or {}).items())
    keys = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (keys_extra or {}).items())
    trust = f'jwks_url = "{jwks_url}"' if jwks_url else 'jwks_file = "jwks.json"'
    _log_signing_key(workdir / "log-ed25519.pem")
    config = workdir / "broker.toml"
    config.write_text(
        f"""# a development workspace (broker.dev.workspace)
[server]
listen = "127.0.0.1:0"
audience = "{audience}"
tls_cert = "tls/server.pem"
tls_key = "tls/server.key"
{server}
[[issuers]]
kind = "gca"
issuer = "{issuer.issuer}"
{trust}

[policy]
dir = "policies"

[keys]
store = "sqlite:///keys.db"
kek = "local:kek.key"
{keys}
[audit]
log = "decisions.log"
origin = "broker.dev.invalid/decisions/{{replica}}"
signing_key = "log-ed25519.pem"
checkpoint_seconds = 0.2
{extra_toml}
""",
        encoding="utf-8",
    )
    return config


def allow_images(workdir: Path, images: Mapping[str, Sequence[str]]) -> None:
    """Set the workspace policy's allow-list (``data.broker.images``) to ``images`` (blocking;
    a running broker sees it at its next reload)."""
    path = workdir / "policies" / "broker" / "data.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["images"] = {name: list(digests) for name, digests in images.items()}
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _log_signing_key(path: Path) -> None:
    """The Ed25519 key that signs the workspace's decision-log checkpoints (kept if present)."""
    if not path.exists():
        write_private_pem(path, ed25519.Ed25519PrivateKey.generate())


def private_pem(key: PrivateKeyTypes) -> bytes:
    """``key`` as an unencrypted PKCS#8 PEM (development keys)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_private_pem(path: Path, key: PrivateKeyTypes) -> Path:
    """``private_pem(key)`` in a file readable by its owner only (blocking: not on a loop)."""
    path.write_bytes(private_pem(key))
    path.chmod(0o600)
    return path
