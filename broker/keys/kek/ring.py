"""The KEKs a broker can use: one primary (wraps new DEKs) and previous ones (unwrap only).

A stored DEK names its KEK by ``kek_ref``; the ring answers with the provider of that name.
KEK rotation: make the new KEK primary and list the old one under ``kek_previous``, restart,
run ``broker keys rewrap`` (which moves every DEK to the primary), then drop the old one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from broker.errors import ConfigError, ErrorCode, UpstreamError
from broker.keys.kek.base import KekProvider
from broker.keys.kek.cloudkms import CloudKmsKek, parse_cloudkms_uri
from broker.keys.kek.local import LocalKek
from broker.keys.kek.pkcs11 import Pkcs11Kek, parse_pkcs11_uri

log = logging.getLogger(__name__)


class KekRing:
    def __init__(self, primary: KekProvider, previous: Sequence[KekProvider] = ()) -> None:
        self._primary = primary
        self._all = {k.reference: k for k in (*previous, primary)}

    @property
    def primary(self) -> KekProvider:
        return self._primary

    @property
    def references(self) -> list[str]:
        return sorted(self._all)

    def for_ref(self, reference: str) -> KekProvider:
        """The provider that wrapped a DEK.

        Raises:
            UpstreamError: ``kek_unavailable`` when that KEK is not configured here.
        """
        provider = self._all.get(reference)
        if provider is None:
            raise UpstreamError(
                f"this DEK is wrapped under {reference}, which is not configured "
                "(keys.kek or keys.kek_previous)",
                code=ErrorCode.KEK_UNAVAILABLE,
            )
        return provider

    async def close(self) -> None:
        for provider in self._all.values():
            await provider.close()


def kek_kind(uri: str) -> str:
    kind = uri.split(":", 1)[0]
    if kind not in {"local", "pkcs11", "cloudkms"} or ":" not in uri:
        raise ConfigError("keys.kek", "expected local:PATH, pkcs11:… or cloudkms:projects/…")
    return kind


async def open_kek(uri: str, *, kms_endpoint: str, timeout_seconds: float = 10.0) -> KekProvider:
    """Open the provider a KEK URI names (the local file must exist).

    Raises:
        ConfigError: for a malformed URI or a missing local file.
        UpstreamError: ``kek_unavailable`` when an HSM or KMS cannot be reached at start-up.
    """
    kind = kek_kind(uri)
    if kind == "local":
        return await asyncio.to_thread(LocalKek, Path(uri.removeprefix("local:")))
    if kind == "pkcs11":
        provider = Pkcs11Kek(await asyncio.to_thread(parse_pkcs11_uri, uri))
        await provider.open()
        return provider
    kms = CloudKmsKek(
        parse_cloudkms_uri(uri), endpoint=kms_endpoint, timeout_seconds=timeout_seconds
    )
    await kms.open()
    return kms
