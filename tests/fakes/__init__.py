"""Local servers that speak real Google APIs, for the key custody tests."""

from __future__ import annotations

from typing import Any


async def stop_grpc_server(holder: Any) -> None:
    """Stop ``holder.server`` (immediately: the tests have no calls in flight)."""
    if holder.server is not None:
        await holder.server.stop(grace=None)
        holder.server = None
