"""Per-client rate limits on the unauthenticated runner routes (``/v1/challenge``,
``/v1/release``): a token bucket per client address, per worker process.

``[server] rate_limit_per_ip`` requests per second (0: off) with bursts of
``rate_limit_burst``, for each route on its own. Past it: ``429 rate_limited`` with a
``Retry-After`` header; nothing is decided or logged for a refused request (it never reached
the release path). The table of clients is bounded (the least recently seen are forgotten), and a
lookup is a dict access: it costs nothing on the hot path. With ``--workers N`` each worker
keeps its own buckets, so a client may reach N times the rate (docs/deploy.md). Behind a load
balancer every client has the balancer's address: set the limit for that, or off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from broker.core.buckets import TokenBuckets

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def rate_limited(handler: Handler, rate: float, burst: int) -> Handler:
    """``handler`` behind a per-client token bucket (``rate`` 0: unlimited)."""
    if rate <= 0:
        return handler
    buckets = TokenBuckets(rate, burst)

    async def limited(request: web.Request) -> web.StreamResponse:
        wait = buckets.wait_for(request.remote or "unknown", time.monotonic())
        if wait > 0:
            raise web.HTTPTooManyRequests(
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
                reason="too many requests from this address; retry later",
            )
        return await handler(request)

    return limited
