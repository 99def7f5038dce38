"""``broker keys …``: the key lifecycle from the command line.

Every command loads the config, opens the store and the KEKs it names, and (for changes) appends
a ``key_admin`` record to the decision log, the same log the service writes. ``keys create
--url URL`` instead asks a running broker (``POST /v1/admin/keys`` with the token of
``--token-file``, ``admin_remote.py``): the only way once the KEK serves the sealed broker
alone. With ``--broker-image`` (``cli/broker_pin.py``) the broker's attestation is verified and
its certificate pinned before the token is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from broker.audit.log import DecisionLog
from broker.cli import keys_transfer as transfer
from broker.cli.admin_remote import add_remote_arguments, ask_admin, refuse_remote_flags
from broker.config import load_settings
from broker.core.errors import FileFormatError
from broker.core.protocol import Algorithm
from broker.core.refs import PostgresRef
from broker.keys import admin
from broker.keys.factory import open_key_service
from broker.keys.kek.pkcs11 import create_pkcs11_kek, parse_pkcs11_uri
from broker.keys.service import KeyService
from broker.keys.store.base import Purpose

EXIT_NO = 1
EXIT_USAGE = 2
MATERIAL_BYTES = 32  # keys import: AES-256
Work = Callable[[KeyService, datetime], Awaitable[Any]]


def add_commands(keys: Any) -> None:
    """Register the ``keys`` sub-commands on an argparse sub-parser group."""

    def command(
        name: str, help_text: str, run: Callable[[argparse.Namespace], int], *, remote: bool = False
    ) -> Any:
        parser = keys.add_parser(name, help=help_text)
        parser.add_argument(
            "--config",
            type=Path,
            required=not remote,
            help="the broker's configuration file (broker.toml); or --url" if remote else None,
        )
        parser.set_defaults(run=run)
        return parser

    create = command(
        "create", "create a key (AES-256 DEK; HPKE key pair for query)", _create, remote=True
    )
    create.add_argument("name")
    create.add_argument("--purpose", required=True, help=", ".join(p.value for p in Purpose))
    create.add_argument("--algorithm", help=", ".join(a.value for a in Algorithm))
    add_remote_arguments(create)
    imported = command("import", "create a key from 32 bytes of your own material", _import)
    imported.add_argument("name")
    imported.add_argument(
        "--purpose", required=True, help=f"{Purpose.MODEL_WEIGHTS.value}, {Purpose.GENERIC.value}"
    )
    imported.add_argument("--material-file", type=Path, required=True, help="32 raw bytes")
    command("list", "list keys and versions (never key material)", _list).add_argument(
        "name", nargs="?"
    )
    command("show", "show one key's versions", _show).add_argument("name")
    command("rotate", "add a version (older versions stay usable)", _rotate).add_argument("name")
    for name, help_text, run in (
        ("disable", "refuse releases of a version", _disable),
        ("enable", "allow releases of a version again", _enable),
        ("destroy", "delete a version's wrapped material for good", _destroy),
    ):
        parser = command(name, help_text, run)
        parser.add_argument("name")
        parser.add_argument("--version", required=True)
        if name == "destroy":
            parser.add_argument("--yes", action="store_true", help="confirm: cannot be undone")
    rewrap = command("rewrap", "re-wrap every DEK under another KEK (resumable)", _rewrap)
    rewrap.add_argument("--to", required=True, metavar="KEK_URI")
    migrate = command(
        "migrate",
        "create or upgrade the key store's schema (PostgreSQL); with --from and/or --to, copy "
        "every wrapped key between stores (idempotent, verified)",
        _migrate,
    )
    migrate.add_argument(
        "--from",
        dest="source",
        metavar="STORE",
        help="the store to copy from (default: the configured [keys] store / BROKER_KEYS_STORE)",
    )
    migrate.add_argument(
        "--to",
        metavar="STORE",
        help="the store to copy to (default: the configured store); e.g. "
        "postgresql://USER@HOST/DB, password from PGPASSWORD, a passfile or the URL",
    )
    transfer.add_commands(command)
    kek = keys.add_parser("kek-create", help="generate a PKCS#11 KEK (non-extractable AES-256)")
    kek.add_argument("uri", metavar="PKCS11_URI")
    kek.set_defaults(run=_kek_create)


def run_keys(
    args: argparse.Namespace,
    work: Work,
    *,
    create_missing_kek: bool = False,
    kek_uri: str | None = None,
    log_changes: bool = True,
) -> Any:
    """Open the key service from ``--config`` and run ``work`` with it."""
    settings = load_settings(args.config)

    async def run() -> Any:
        if not log_changes:
            async with open_key_service(
                settings.keys, create_missing_kek=create_missing_kek, kek_uri=kek_uri
            ) as keys:
                return await work(keys, datetime.now(UTC))
        audit = DecisionLog(settings.audit.log, replica=settings.server.replica_id)
        await audit.open()
        try:
            async with open_key_service(
                settings.keys,
                create_missing_kek=create_missing_kek,
                kek_uri=kek_uri,
                change_log=audit.append_entry,
            ) as keys:
                return await work(keys, datetime.now(UTC))
        finally:
            await audit.close()

    return asyncio.run(run())


def _migrate(args: argparse.Namespace) -> int:
    """PostgreSQL: create or upgrade the schema (idempotent). SQLite and Secret Manager need no
    migration (the store creates what it needs); say so."""
    if args.source is not None or args.to is not None:
        return _print(transfer.migrate_stores(args))
    settings = load_settings(args.config)
    store = settings.keys.store_ref
    if not isinstance(store, PostgresRef):
        return _print({"store": store.kind, "migrated": False, "reason": "not needed"})
    from broker.keys.store.postgres import migrate  # noqa: PLC0415

    before, after = asyncio.run(
        migrate(store.uri, timeout_seconds=settings.keys.upstream_timeout_seconds)
    )
    return _print({"store": "postgresql", "schema_version_before": before, "schema_version": after})


def _print(value: object) -> int:
    print(json.dumps(value, indent=2))
    return 0


# Every command parses its arguments with broker.keys.admin, as the admin API does, and calls
# the same KeyService method: one validation path, one message per refusal.


def _create(args: argparse.Namespace) -> int:
    name, purpose = admin.key_name(args.name), admin.purpose(args.purpose)
    algorithm = admin.algorithm(args.algorithm)
    if args.url is not None:
        body = {"name": name, "purpose": purpose.value}
        if algorithm is not None:
            body["algorithm"] = algorithm.value
        code, answer = ask_admin(args, "/v1/admin/keys", body)
        if code != 0:
            print(answer, file=sys.stderr)
            return int(code)
        return _print(answer)
    refuse_remote_flags(
        args, "the key is made here, in the configured key store, and no broker is asked"
    )
    record = run_keys(
        args,
        lambda keys, now: keys.create(
            name, purpose, now=now, algorithm=algorithm, who=admin.cli_actor()
        ),
        create_missing_kek=True,
    )
    return _print(record.describe())


def _import(args: argparse.Namespace) -> int:
    name, purpose = admin.key_name(args.name), admin.purpose(args.purpose)
    material = args.material_file.read_bytes()
    if len(material) != MATERIAL_BYTES:
        raise FileFormatError(
            args.material_file,
            f"{len(material)} bytes, not the {MATERIAL_BYTES} bytes of an AES-256 key",
            "give a file of exactly 32 raw bytes (not hex or base64)",
        )
    record = run_keys(
        args,
        lambda keys, now: keys.import_key(name, purpose, material, now=now, who=admin.cli_actor()),
        create_missing_kek=True,
    )
    return _print(record.describe())


def _list(args: argparse.Namespace) -> int:
    records = run_keys(args, lambda keys, now: keys.list_versions(args.name), log_changes=False)
    return _print([r.describe() for r in records])


def _show(args: argparse.Namespace) -> int:
    records = run_keys(args, lambda keys, now: keys.show(args.name), log_changes=False)
    return _print([r.describe() for r in records])


def _rotate(args: argparse.Namespace) -> int:
    name = admin.key_name(args.name)
    record = run_keys(args, lambda keys, now: keys.rotate(name, now=now, who=admin.cli_actor()))
    return _print(record.describe())


def _switch(enabled: bool) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        name, version = admin.key_name(args.name), admin.version_text(args.version)
        record = run_keys(
            args,
            lambda keys, now: keys.set_enabled(
                name, version, enabled, now=now, who=admin.cli_actor()
            ),
        )
        return _print(record.describe())

    return run


_disable, _enable = _switch(False), _switch(True)


def _destroy(args: argparse.Namespace) -> int:
    name, version = admin.key_name(args.name), admin.version_text(args.version)
    if not args.yes:
        print("error: destroy cannot be undone; add --yes to confirm", file=sys.stderr)
        return EXIT_USAGE
    record = run_keys(
        args, lambda keys, now: keys.destroy(name, version, now=now, who=admin.cli_actor())
    )
    return _print(record.describe())


def _rewrap(args: argparse.Namespace) -> int:
    def progress(count: int) -> None:
        if count % 100 == 0:
            print(f"rewrapped {count}", file=sys.stderr, flush=True)

    report = run_keys(
        args,
        lambda keys, now: keys.rewrap(now=now, who=admin.cli_actor(), on_progress=progress),
        kek_uri=args.to,
    )
    return _print(vars(report))


def _kek_create(args: argparse.Namespace) -> int:
    uri = parse_pkcs11_uri(args.uri)
    return _print({"created": uri.reference, "fingerprint": create_pkcs11_kek(uri)})
