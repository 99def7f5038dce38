"""``broker verify broker URL``: check a running broker's self-attestation, for owners and auditors.

It fetches ``GET /.well-known/broker-attestation`` over a new TLS connection, verifies the token
and the binding of the broker's keys (``client/broker_identity.py``), and that the connection's
server key is the attested TLS key. Exit 0 with the bound keys as JSON; exit 1 with the failed
check and its reason (also when the broker cannot be reached); exit 2 for a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from broker.client.broker_identity import GOOGLE_ISSUER, BrokerIdentity, BrokerNotAttested
from broker.client.broker_pin import attest_broker

EXIT_NO = 1
EXIT_USAGE = 2
TIMEOUT_SECONDS = 30.0


def run(args: argparse.Namespace) -> int:
    """Verify the broker at ``args.files[0]``; print the verdict as JSON on stdout."""
    try:
        url, identity, context = _inputs(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        verified, _ = asyncio.run(
            attest_broker(
                url, identity, context, now=datetime.now(UTC), timeout_seconds=TIMEOUT_SECONDS
            )
        )
    except BrokerNotAttested as exc:
        return _refused(exc.check, exc.reason)
    except (aiohttp.ClientError, ssl.SSLError, TimeoutError, OSError) as exc:
        return _refused("reach", f"{type(exc).__name__}: {exc}")
    print(json.dumps({"url": url, **verified.as_json()}, indent=2))
    return 0


def _refused(check: str, reason: str) -> int:
    print(json.dumps({"attested": False, "check": check, "reason": reason}, indent=2))
    print(f"error: broker_not_attested: {check}: {reason}", file=sys.stderr)
    return EXIT_NO


def _inputs(args: argparse.Namespace) -> tuple[str, BrokerIdentity, ssl.SSLContext]:
    """The URL, the expected identity and the TLS context from the arguments.

    Raises:
        ValueError: a usage error (its message says which).
        OSError: a file that cannot be read.
    """
    if len(args.files) != 1 or not str(args.files[0]).startswith("https://"):
        raise ValueError("broker verify broker takes one https:// URL")
    if not args.image:
        raise ValueError("--image sha256:<digest> is required (repeatable)")
    if args.jwks is None and args.root is None:
        raise ValueError("--jwks FILE (OIDC tokens) or --root PEM (PKI tokens) is required")
    identity = BrokerIdentity(
        image_digests=frozenset(args.image),
        jwks=Path(args.jwks).read_text(encoding="utf-8") if args.jwks else None,
        root_pem=Path(args.root).read_bytes() if args.root else None,
        audience=args.audience,
        issuer=args.issuer or GOOGLE_ISSUER,
    )
    context = ssl.create_default_context(cafile=str(args.ca) if args.ca else None)
    return str(args.files[0]), identity, context
