"""The checkpoint signer ``[audit] signing_key`` names: a local Ed25519 PEM file, or a Cloud KMS
EC_SIGN_ED25519 key version (``cloudkms:…``)."""

from __future__ import annotations

import asyncio
import inspect

from broker.config import Settings
from broker.core.errors import ConfigError
from broker.core.refs import CloudKmsRef, Pkcs11Ref
from broker.crypto.checkpoint import CheckpointSigner, NoteSigner


async def open_checkpoint_signer(
    settings: Settings, *, previous: bool = False
) -> CheckpointSigner | None:
    """The configured signer (``previous``: the key it replaced), opened; ``None`` unset.

    Raises:
        ConfigError: an unreadable or wrong key; UpstreamError: the KMS does not answer.
    """
    audit = settings.audit
    ref = audit.previous_signing_ref if previous else audit.signing_ref
    if ref is None:
        return None
    if isinstance(ref, CloudKmsRef):
        # The KMS client loads only where a KMS signer is configured (start-up time).
        from broker.signers.checkpoint_kms import KmsNoteSigner  # noqa: PLC0415

        signer = KmsNoteSigner(
            audit.origin,
            ref.uri,
            endpoint=settings.keys.kms_endpoint,
            timeout_seconds=settings.keys.upstream_timeout_seconds,
            credentials_file=settings.keys.kms_credentials,
        )
        await signer.open()
        return signer
    if isinstance(ref, Pkcs11Ref):
        raise ConfigError("audit.signing_key", "checkpoints are signed by a PEM file or Cloud KMS")
    return await asyncio.to_thread(NoteSigner.from_pem, audit.origin, ref.path)


async def close_checkpoint_signer(signer: CheckpointSigner | None) -> None:
    """Close a signer that holds a connection (the KMS one); a local key holds none."""
    close = getattr(signer, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result
