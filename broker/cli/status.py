"""``broker status URL``: how a running broker is, in one answer (Vault's ``status`` habit).

It asks the broker itself: ``/readyz`` (the state of its background checks: the policy in
force, its source and last reload, the decision log's size, the key store, the KEK, the nonce
store, checkpoint signing) and ``/v1/log/checkpoint`` (the newest signed checkpoint; with
``--key``, its signature is checked). Both routes are public, but ``/readyz`` shows its checks
and problems only to an admin token (any role): ``--token-file`` names a file holding one;
without it the report has the status alone.

Exit codes: 0 ready; 1 reachable but not ready (the problems are listed); 3 not reachable.
"""

from __future__ import annotations

import argparse
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from broker.core.errors import ConfigError
from broker.core.hostnames import is_loopback_host
from broker.crypto.checkpoint import NoteError, NoteVerifier, parse_checkpoint

EXIT_NOT_READY = 1
EXIT_UNREACHABLE = 3
MAX_ANSWER_BYTES = 1024 * 1024


def add_command(commands: Any) -> None:
    status = commands.add_parser("status", help="a running broker's health, policy and log")
    status.add_argument("url", metavar="URL", help="https://broker:8443 (or http://127.0.0.1…)")
    status.add_argument("--ca", type=Path, help="the CA that signs the broker's TLS certificate")
    status.add_argument("--key", help="the log's note verifier key: check the checkpoint with it")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    status.add_argument(
        "--token-file",
        type=Path,
        help="a file holding an admin token (any role): /readyz then shows its checks",
    )
    status.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    url = str(args.url).rstrip("/")
    if not _url_allowed(url):
        raise ConfigError("URL", "a broker URL is https:// (or http:// on loopback)")
    context = ssl.create_default_context(cafile=str(args.ca) if args.ca else None)
    try:
        ready_status, ready = _get(url + "/readyz", context, args.timeout, _bearer(args))
        note_status, note = _get(url + "/v1/log/checkpoint", context, args.timeout)
    except OSError as exc:
        print(json.dumps({"url": url, "reachable": False, "problem": str(exc)}))
        return EXIT_UNREACHABLE
    report: dict[str, Any] = {"url": url, "reachable": True, "ready": ready_status == 200}
    try:
        body = json.loads(ready)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    report["status"] = body.get("status")
    error = body.get("error", {})
    report["checks"] = body.get("checks") or error.get("checks") or {}
    if ready_status != 200:
        report["problem"] = error.get("message") or f"HTTP {ready_status}"
    report["checkpoint"] = _checkpoint(note_status, note, args.key)
    print(json.dumps(report, indent=2))
    return 0 if report["ready"] else EXIT_NOT_READY


def _url_allowed(url: str) -> bool:
    """https, or http to a host that is loopback however spelled (``http://127.0.0.1.evil/``
    and ``http://127.0.0.1@evil/`` are remote: the host is parsed, not the prefix)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme == "https":
        return bool(host)
    return parts.scheme == "http" and host is not None and is_loopback_host(host)


def _bearer(args: argparse.Namespace) -> dict[str, str]:
    """The ``Authorization`` header from ``--token-file`` (none without it).

    Raises:
        ConfigError: the file cannot be read.
    """
    if args.token_file is None:
        return {}
    try:
        token = Path(args.token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeError) as exc:
        raise ConfigError("--token-file", f"cannot read {args.token_file}: {exc}") from exc
    return {"Authorization": f"Bearer {token}"}


def _get(
    url: str, context: ssl.SSLContext, timeout: float, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """(status, body); an HTTP error status is an answer, not an exception."""
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 - scheme checked
    try:
        with urllib.request.urlopen(request, context=context, timeout=timeout) as response:  # noqa: S310 - scheme checked
            return int(response.status), response.read(MAX_ANSWER_BYTES).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        with exc:  # its connection is closed, not left to the garbage collector
            return int(exc.code), exc.read(MAX_ANSWER_BYTES).decode("utf-8", "replace")


def _checkpoint(status: int, note: str, key: str | None) -> dict[str, Any] | None:
    if status != 200:
        return None
    body = note[: note.rfind("\n\n") + 1]
    try:
        if key is not None:
            verifier = NoteVerifier.parse(key)
            body = verifier.open(note)
            checkpoint = parse_checkpoint(body, origin=verifier.name)
        else:
            checkpoint = parse_checkpoint(body)
    except NoteError as exc:
        return {"problem": str(exc)}
    return {
        "origin": checkpoint.origin,
        "size": checkpoint.size,
        "signature": "verified with --key" if key is not None else "not checked (no --key)",
    }
