"""The key-encryption-key port.

A KEK provider wraps and unwraps DEKs; the KEK itself never leaves the provider. Associated data
binds each wrapped DEK to its key name and version, so a wrapped DEK copied onto another key's
record does not unwrap. Production providers turn every failure into ``UpstreamError``
(``kek_unavailable``): nothing is released when the KEK cannot answer.
"""

from __future__ import annotations

from typing import Protocol


def dek_aad(name: str, version: int) -> bytes:
    """Associated data that binds a wrapped DEK to its key name and version."""
    return f"broker-dek/v1\0{name}\0{version}".encode()


class KekProvider(Protocol):
    @property
    def reference(self) -> str:
        """A stable, non-secret name of the KEK, stored next to every DEK it wraps."""
        ...

    @property
    def development_only(self) -> bool:
        """True for providers that must not guard production keys."""
        ...

    async def wrap(self, dek: bytes, aad: bytes) -> bytes:
        """Encrypt ``dek`` under the KEK, binding ``aad``."""
        ...

    async def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        """Decrypt a DEK wrapped by ``wrap`` with the same ``aad``."""
        ...

    async def close(self) -> None:
        """Release sessions and channels."""
        ...
