"""The key service's caches: unwrapped material and key-version records, bounded in age and
count (``[keys] dek_cache_seconds``, ``metadata_cache_seconds``, ``dek_cache_max``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Generic, TypeVar

from broker.keys.store.base import KeyVersionRecord

K = TypeVar("K", bound=tuple[Any, ...])
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """Entries bounded in age and count (least recently used out first); keys start with a name."""

    def __init__(self, *, ttl_seconds: float, max_entries: int) -> None:
        self._ttl = ttl_seconds
        self._max = max_entries
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None or time.monotonic() - entry[0] >= self._ttl:
            self._entries.pop(key, None)
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: K, value: V) -> None:
        if self._ttl <= 0 or self._max <= 0:
            return
        self._entries[key] = (time.monotonic(), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def invalidate(self, name: str) -> None:
        for key in [k for k in self._entries if k[0] == name]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


class DekCache(TtlCache[tuple[str, int, str], bytes]):
    """Unwrapped key material by (name, version, KEK), bounded in time and count."""


def dek_cache_key(record: KeyVersionRecord) -> tuple[str, int, str]:
    return (record.name, record.version, record.kek_ref)


# (name, version or None for "newest enabled") -> the record a release would use
MetadataCache = TtlCache[tuple[str, int | None], KeyVersionRecord]
