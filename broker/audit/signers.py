"""The checkpoint signer ``[audit] signing_key`` names: a local Ed25519 PEM file, or a Cloud KMS
EC_SIGN_ED25519 key version (``cloudkms:…``)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

from broker.config import Settings
from broker.crypto.checkpoint import CheckpointSigner, NoteSigner

KMS_PREFIX = "cloudkms:"  # a Cloud KMS key version (kms_signer.py); anything else: a PEM path


async def open_checkpoint_signer(
    settings: Settings, *, previous: bool = False
) -> CheckpointSigner | None:
    """The configured signer (``previous``: the key it replaced), opened; ``None`` unset.

    Raises:
        ConfigError: an unreadable or wrong key; UpstreamError: the KMS does not answer.
    """
    audit = settings.audit
    key = audit.previous_signing_key if previous else audit.signing_key
    if key is None:
        return None
    if key.startswith(KMS_PREFIX):
        # The KMS client loads only where a KMS signer is configured (start-up time).
        from broker.audit.kms_signer import KmsNoteSigner  # noqa: PLC0415

        signer = KmsNoteSigner(
            audit.origin,
            key,
            endpoint=settings.keys.kms_endpoint,
            timeout_seconds=settings.keys.upstream_timeout_seconds,
            credentials_file=settings.keys.kms_credentials,
        )
        await signer.open()
        return signer
    return await asyncio.to_thread(NoteSigner.from_pem, audit.origin, Path(key))


async def close_checkpoint_signer(signer: CheckpointSigner | None) -> None:
    """Close a signer that holds a connection (the KMS one); a local key holds none."""
    close = getattr(signer, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result
