"""``broker verify broker URL``: check a running broker's self-attestation, for owners and auditors.

It fetches ``GET /.well-known/broker-attestation`` over a new TLS connection, verifies the token
and the binding of the broker's keys (``client/broker_identity.py``), and that the connection's
server key is the attested TLS key. Exit 0 with the bound keys as JSON; exit 1 with the failed
check and its reason (also when the broker cannot be reached); exit 2 for a usage error. The
expected identity is read by ``broker_pin.broker_identity_from_args``, as for ``broker audit
monitor`` and ``broker keys create --url`` (their flags are ``--broker-image`` & co.).
"""

from __future__ import annotations

import argparse
import json
import sys

from broker.cli.broker_pin import (
    BrokerUnreachable,
    broker_identity_from_args,
    connect,
    not_attested_line,
)
from broker.client.broker_identity import BrokerIdentity, BrokerNotAttested
from broker.core.errors import ConfigError

EXIT_NO = 1
EXIT_USAGE = 2
TIMEOUT_SECONDS = 30.0


def run(args: argparse.Namespace) -> int:
    """Verify the broker at ``args.files[0]``; print the verdict as JSON on stdout."""
    try:
        url, identity = _inputs(args)
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    try:
        broker = connect(url, identity, ca=args.ca, timeout=TIMEOUT_SECONDS)
    except BrokerNotAttested as exc:
        return _refused(exc)
    except BrokerUnreachable as exc:
        return _refused(BrokerNotAttested("reach", str(exc)))
    assert broker.verified is not None  # noqa: S101 - connect verified it (an identity given)
    print(json.dumps({"url": url, **broker.verified.as_json()}, indent=2))
    return 0


def _refused(exc: BrokerNotAttested) -> int:
    print(json.dumps({"attested": False, "check": exc.check, "reason": exc.reason}, indent=2))
    print(not_attested_line(exc), file=sys.stderr)
    return EXIT_NO


def _inputs(args: argparse.Namespace) -> tuple[str, BrokerIdentity]:
    """The URL and the expected identity from the arguments.

    Raises:
        ConfigError: a usage error (its message names the argument).
    """
    if len(args.files) != 1 or not str(args.files[0]).startswith("https://"):
        raise ConfigError("URL", "broker verify broker takes one https:// URL")
    identity = broker_identity_from_args(args, prefix="")
    if identity is None:
        raise ConfigError("--image", "sha256:<digest> is required (repeatable)")
    return str(args.files[0]), identity
