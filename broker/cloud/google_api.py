"""Plumbing shared by the Cloud KMS KEK and the Secret Manager store.

* ``grpc_transport``: plaintext + anonymous credentials to a loopback endpoint (the local test
  servers), TLS + Application Default Credentials to anything else. Given credentials (Workload
  Identity Federation, ``federation.py``), a loopback endpoint is spoken to over gRPC's local
  channel credentials (a secure channel type for a peer on this host: gRPC sends call
  credentials, the bearer token, only over a secure channel), anything else over TLS. The
  channel and the client are created on the event loop that will use them (once, at start-up;
  the constructors look for mTLS config files); credential discovery runs on a worker thread.
* ``close_client``: closes the channel (at shutdown).
* ``call``: one RPC with a bounded retry (transient errors only, until the deadline), every
  failure turned into the caller's ``UpstreamError``; NOT_FOUND / ALREADY_EXISTS pass through
  for the caller to interpret. With federated credentials the token exchange runs first, so an
  STS refusal is reported as one (not as a failed RPC retried until the deadline).
* ``crc32c``: the checksum both APIs use for end-to-end integrity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import google.auth
import google_crc32c
import grpc
from google.api_core import exceptions as api_exceptions
from google.api_core import retry_async
from google.auth import credentials as auth_credentials

from broker.cloud.federation import FederatedCredentials
from broker.config import is_loopback, split_listen
from broker.core.errors import UpstreamError

CLOUD_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


def crc32c(data: bytes) -> int:
    return int(google_crc32c.value(data))


def is_loopback_endpoint(endpoint: str) -> bool:
    try:
        host, _ = split_listen(endpoint)
    except ValueError:
        return False
    return is_loopback(host)


async def grpc_transport(transport_class: Any, endpoint: str, credentials: Any = None) -> Any:
    """A gRPC asyncio transport of ``transport_class`` for ``endpoint``."""
    if is_loopback_endpoint(endpoint):
        if credentials is not None:
            local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
            return transport_class(
                host=endpoint, credentials=credentials, ssl_channel_credentials=local
            )
        anonymous = auth_credentials.AnonymousCredentials()  # type: ignore[no-untyped-call]
        return transport_class(channel=grpc.aio.insecure_channel(endpoint), credentials=anonymous)
    if credentials is None:
        credentials, _ = await asyncio.to_thread(google.auth.default, scopes=[CLOUD_SCOPE])
    return transport_class(host=endpoint, credentials=credentials)


async def close_client(client: Any) -> None:
    """Close a generated client's gRPC channel."""
    await client.transport.close()


def bounded_retry(deadline_seconds: float) -> retry_async.AsyncRetry:
    """Retry transient errors (UNAVAILABLE, DEADLINE_EXCEEDED) until ``deadline_seconds``, then
    give up: an outage must turn into a prompt 503, not a request that hangs for a minute."""
    return retry_async.AsyncRetry(
        initial=0.1,
        maximum=1.0,
        multiplier=2.0,
        timeout=deadline_seconds,
        predicate=retry_async.if_exception_type(
            api_exceptions.ServiceUnavailable, api_exceptions.DeadlineExceeded
        ),
    )


async def call(
    client: Any,
    method: str,
    request: Any,
    *,
    deadline_seconds: float,
    unavailable: Callable[[str], UpstreamError],
    federated: FederatedCredentials | None = None,
) -> Any:
    """Run one RPC of ``client`` (after the token exchange, with ``federated`` credentials).

    Raises:
        UpstreamError: from ``unavailable`` for every failure but NOT_FOUND / ALREADY_EXISTS.
    """
    if client is None:
        raise unavailable("client not open")
    if federated is not None:
        await federated.ensure_fresh(unavailable)
    try:
        return await getattr(client, method)(
            request=request, timeout=deadline_seconds, retry=bounded_retry(deadline_seconds)
        )
    except (api_exceptions.NotFound, api_exceptions.AlreadyExists):
        raise
    except (api_exceptions.PermissionDenied, api_exceptions.Unauthenticated) as exc:
        status = exc.grpc_status_code.name if exc.grpc_status_code else type(exc).__name__
        raise unavailable(
            f"{method} refused ({status}): these credentials are not granted the resource"
        ) from exc
    except (
        api_exceptions.GoogleAPICallError,
        api_exceptions.RetryError,
        grpc.aio.AioRpcError,
        TimeoutError,
    ) as exc:
        raise unavailable(f"{method} failed ({type(exc).__name__})") from exc
