"""Commands that ask a running broker's admin API instead of opening the key store themselves.

Once the KEK serves only the sealed broker, a command run with the broker's ``--config`` on an
owner's machine cannot wrap or unwrap a DEK. ``broker keys create --url URL`` and ``broker
weights encrypt --url URL`` ask the broker instead, with the admin token of ``--token-file``;
with ``--broker-image`` & co. (``cli/broker_pin.py``) the broker's attestation is verified and
its certificate pinned before the token, or any key material, is sent. The same flags without
``--url`` are a usage error: a local command talks to no broker, so there is nothing to pin.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
from pathlib import Path
from typing import Any

from broker.cli.broker_pin import (
    BrokerUnreachable,
    add_broker_identity_arguments,
    broker_identity_from_args,
    connect,
    not_attested_line,
)
from broker.cli.status import _bearer as bearer_from_token_file
from broker.client.broker_identity import BrokerNotAttested
from broker.core.encoding import b64url_encode
from broker.core.errors import ConfigError
from broker.core.jsonsafe import loads_bounded
from broker.keys.material import DEK_BYTES
from broker.keys.store.base import Purpose

EXIT_NO = 1
MAX_ANSWER_BYTES = 64 * 1024
IMPORT_PATH = "/v1/admin/keys/import"


class BrokerRefused(Exception):
    """The broker did not take the request (or was not the attested one); the error line."""


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--token-file``, ``--ca``, ``--timeout`` and the ``--broker-*`` flags."""
    parser.add_argument(
        "--url", help="https://broker: ask this running broker (its admin API), not --config"
    )
    parser.add_argument(
        "--token-file", type=Path, help="with --url: a file holding an admin token (key-admin)"
    )
    parser.add_argument("--ca", type=Path, help="the CA that signs the broker's TLS certificate")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    add_broker_identity_arguments(parser)


def check_remote(args: argparse.Namespace) -> None:
    """The usage checks of ``--url`` (before any work, and before any key material is made).

    Raises:
        ConfigError: no token file, not https, ``--config`` too.
    """
    if args.config is not None:
        raise ConfigError("--config", "give --url (a running broker) or --config, not both")
    if args.token_file is None:
        raise ConfigError("--token-file", "--url needs an admin token")
    if not str(args.url).startswith("https://"):
        raise ConfigError("--url", "the admin API is reached over https:// only")


def ask_admin(args: argparse.Namespace, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """``POST body`` to ``path`` of the broker at ``--url`` with the admin token, once the
    broker is verified (with ``--broker-image``); (exit code, the answer or the error line).

    Raises:
        ConfigError: a usage error (``check_remote``).
    """
    check_remote(args)
    headers = {**bearer_from_token_file(args), "Content-Type": "application/json"}
    identity = broker_identity_from_args(args)
    try:  # no byte of the request, and so no token, before the broker is verified
        broker = connect(args.url, identity, ca=args.ca, timeout=args.timeout)
        with broker.open(path, data=json.dumps(body).encode(), headers=headers) as response:
            answer = response.read(MAX_ANSWER_BYTES)
    except BrokerNotAttested as exc:
        return EXIT_NO, not_attested_line(exc)
    except urllib.error.HTTPError as exc:
        with exc:
            error = _error_of(exc.read(MAX_ANSWER_BYTES))
        return EXIT_NO, f"error: {error or f'HTTP {exc.code}'}"
    except (BrokerUnreachable, OSError) as exc:
        return EXIT_NO, f"error: broker_unreachable: {exc}"
    try:
        return 0, loads_bounded(answer)
    except ValueError:
        return EXIT_NO, "error: the broker's answer is not JSON"


def _error_of(body: bytes) -> str | None:
    """``code: message`` of the broker's error answer (``None`` when it is not one)."""
    try:
        error = loads_bounded(body)["error"]
        return f"{error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return None


def refuse_remote_flags(args: argparse.Namespace, local: str) -> None:
    """Refuse the remote-only flags without ``--url`` (they would silently check nothing);
    ``local`` says what the command does without ``--url``.

    Raises:
        ConfigError: ``--broker-image`` or ``--token-file`` without ``--url``; no ``--config``.
    """
    if broker_identity_from_args(args) is not None or args.token_file is not None:
        flag = "--token-file" if args.token_file is not None else "--broker-image"
        raise ConfigError(flag, f"applies to a broker reached with --url; without it {local}")
    if args.config is None:
        raise ConfigError("--config", "is required (or --url: ask a running broker)")


def import_new_dek(args: argparse.Namespace, name: str, purpose: Purpose) -> tuple[int, bytearray]:
    """A new AES-256 DEK, made here and imported into the broker at ``--url`` as the next
    version of ``name`` (``POST /v1/admin/keys/import``); (the version the broker gave it, the
    DEK). The caller encrypts with it only now that the version is known, then ``wipe``s it.

    Raises:
        ConfigError: a usage error (``check_remote``).
        BrokerRefused: the broker was not reached, not attested, or refused the import (the DEK
            is zeroed).
    """
    dek = bytearray(os.urandom(DEK_BYTES))
    try:
        body = {"name": name, "purpose": purpose.value, "dek": b64url_encode(bytes(dek))}
        code, answer = ask_admin(args, IMPORT_PATH, body)
        del body
        return _imported_version(code, answer, name), dek
    except BaseException:
        wipe(dek)
        raise


def _imported_version(code: int, answer: Any, name: str) -> int:
    """The version the broker's import answer names.

    Raises:
        BrokerRefused: a refusal (``answer`` is its error line), or an answer that is not the
            import of ``name``.
    """
    if code != 0:
        raise BrokerRefused(str(answer))
    named, version = (
        (answer.get("name"), answer.get("version")) if isinstance(answer, dict) else (None, None)
    )
    if named != name or isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise BrokerRefused("error: the broker's answer does not name the imported version")
    return version


def wipe(material: bytearray) -> None:
    """Zero our copy of a DEK (the copies the JSON body and the TLS layer made are freed, not
    zeroed: Python cannot promise more)."""
    material[:] = bytes(len(material))
