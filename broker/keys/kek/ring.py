"""The KEKs a broker can use: one primary (wraps new DEKs) and previous ones (unwrap only).

A stored DEK names its KEK by ``kek_ref``; the ring answers with the provider of that name.
KEK rotation: make the new KEK primary and list the old one under ``kek_previous``, restart,
run ``broker keys rewrap`` (which moves every DEK to the primary), then drop the old one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from broker.core.errors import ErrorCode, UpstreamError
from broker.keys.kek.base import KekProvider

log = logging.getLogger(__name__)


class KekRing:
    def __init__(self, primary: KekProvider, previous: Sequence[KekProvider] = ()) -> None:
        self._primary = primary
        self._all = {k.reference: k for k in (*previous, primary)}

    @property
    def primary(self) -> KekProvider:
        return self._primary

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
