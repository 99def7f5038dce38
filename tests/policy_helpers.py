"""Shared by the policy tests: copies of the shipped policy with data, and signing key pairs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "policies"
EXAMPLE = ROOT / "docs" / "examples" / "per-key-policy"


def policy_copy(target: Path, *, extra: Path | None = None, **data: Any) -> Path:
    """The shipped policy at ``target`` with ``data.json`` keys replaced (``images=…``), plus
    the files of ``extra`` (e.g. the per-key example) laid over it."""
    shutil.copytree(SHIPPED, target)
    data_path = target / "broker" / "data.json"
    document = json.loads(data_path.read_text())
    document.update(data)
    data_path.write_text(json.dumps(document))
    if extra is not None:
        shutil.copytree(extra, target, dirs_exist_ok=True)
    return target


def signing_pair(directory: Path, kind: str = "ec") -> tuple[Path, Path]:
    """A PEM private key and its public key (``sign.pem``, ``verify.pem``) in ``directory``."""
    key: Any = (
        ec.generate_private_key(ec.SECP256R1())
        if kind == "ec"
        else rsa.generate_private_key(public_exponent=65537, key_size=2048)
    )
    private, public = directory / "sign.pem", directory / "verify.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public
