"""Token buckets keyed by a name (a client address, an upstream): the one rate limiter of the
broker (``api/limits.py`` per client address, ``attestation/raw/snp_certs.py`` for AMD's KDS).

Time is passed in (seconds, any monotonic origin): the caller's clock, so tests pass fixed
values. A clock that steps back refills nothing. The table is bounded: the least recently seen
names are forgotten (a forgotten name starts again with a full bucket)."""

from __future__ import annotations

from collections import OrderedDict

MAX_NAMES = 65_536


class TokenBuckets:
    """One bucket of ``burst`` tokens per name, refilled at ``rate`` tokens per second."""

    def __init__(self, rate: float, burst: int, *, max_names: int = MAX_NAMES) -> None:
        self._rate = rate
        self._burst = float(max(burst, 1))
        self._max_names = max_names
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when

    def wait_for(self, name: str, now: float) -> float:
        """0 when ``name`` may go now (a token is taken), else seconds until it may."""
        tokens, then = self._buckets.pop(name, (self._burst, now))
        tokens = min(self._burst, tokens + max(0.0, now - then) * self._rate)
        if tokens >= 1.0:
            self._store(name, tokens - 1.0, max(now, then))
            return 0.0
        self._store(name, tokens, max(now, then))
        return (1.0 - tokens) / self._rate

    def _store(self, name: str, tokens: float, now: float) -> None:
        self._buckets[name] = (tokens, now)
        if len(self._buckets) > self._max_names:
            self._buckets.popitem(last=False)  # the least recently seen name
