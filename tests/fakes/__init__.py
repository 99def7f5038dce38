"""Local servers that speak real Google APIs, for the key custody tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

Method = tuple[Callable[..., Any], Any, Any]  # (handler, request class, response class)


async def start_grpc_server(
    service: str, methods: Mapping[str, Method], *, local_credentials: bool = False
) -> tuple[Any, str]:
    """A plaintext gRPC server on 127.0.0.1 for proto-plus ``methods``; (server, endpoint).

    ``local_credentials``: serve gRPC's local (LOCAL_TCP) credentials instead, the secure channel
    type over which a client sends call credentials (a bearer token) to a loopback server.
    """
    server = grpc.aio.server()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            handler,
            request_deserializer=request.deserialize,
            response_serializer=response.serialize,
        )
        for name, (handler, request, response) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    if local_credentials:
        local = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        port = server.add_secure_port("127.0.0.1:0", local)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def stop_grpc_server(holder: Any) -> None:
    """Stop ``holder.server`` (immediately: the tests have no calls in flight)."""
    if holder.server is not None:
        await holder.server.stop(grace=None)
        holder.server = None
