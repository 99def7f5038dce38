"""``broker`` command line: serve | status | demo | dev | keys | audit | policy | weights | verify.

Exit codes: 0 success; 1 the command ran and the answer is "no" (a log that does not verify,
failing policy tests, a demo step that did not happen); 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from aiohttp import web

from broker.api.sealed_keys import discarded, make_sealed_keys
from broker.api.server import BrokerRunner, reload_server_certificate
from broker.api.services import POLICIES
from broker.app import create_app, server_ssl_context
from broker.audit.records import LogCorrupt
from broker.cli import audit as cli_audit
from broker.cli import dev as cli_dev
from broker.cli import keys as cli_keys
from broker.cli import policy as cli_policy
from broker.cli import status as cli_status
from broker.cli import verify_offline as offline
from broker.cli import weights as cli_weights
from broker.config import Settings, load_settings, makes_keys
from broker.core.errors import BrokerError, ConfigError, InputError
from broker.policy.workers import WorkerGroup
from broker.supervisor import Supervisor, worker_pipe_fd

T = TypeVar("T")

EXIT_NO = 1
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args))
    except ConfigError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except BrokerError as exc:
        print(f"error: {exc.code.value}: {exc.message}", file=sys.stderr)
        return EXIT_NO
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except LogCorrupt as exc:  # a damaged decision log met outside `audit verify` (start-up)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # a bug: one line, and the traceback with -v (always for serve)
        if args.verbose:
            raise
        if args.run is _serve:  # an operator's log keeps what a bug report needs
            logging.getLogger("broker").error("serve failed", exc_info=True)
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(
            f"error: unexpected {type(exc).__name__}: {first[:300]} (a bug; run `broker -v …` "
            "for the traceback and report it)",
            file=sys.stderr,
        )
        return EXIT_NO


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="broker", description="Sealed-runner key broker")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the broker service")
    serve.add_argument("--config", type=Path, required=True)
    serve.add_argument(
        "--workers", type=int, help="worker processes on the port (overrides [server] workers)"
    )
    serve.set_defaults(run=_serve)

    demo = commands.add_parser("demo", help="run the end-to-end demo on loopback")
    demo.add_argument("--workdir", type=Path, help="keep the demo's files here")
    demo.set_defaults(run=_demo)
    cli_dev.add_commands(commands)
    cli_status.add_command(commands)

    keys = commands.add_parser("keys", help="manage data keys").add_subparsers(
        required=True, metavar="ACTION"
    )
    cli_keys.add_commands(keys)

    weights = commands.add_parser(
        "weights", help="encrypt model weights for a key; inspect encrypted files"
    ).add_subparsers(required=True, metavar="ACTION")
    cli_weights.add_commands(weights)

    audit = commands.add_parser("audit", help="review the decision log").add_subparsers(
        required=True, metavar="ACTION"
    )
    cli_audit.add_commands(audit)

    verify = commands.add_parser(
        "verify", help="verify one piece of evidence offline and print the policy-input fragment"
    )
    offline.add_arguments(verify)
    verify.set_defaults(run=_verify)

    policy = commands.add_parser("policy", help="work on Rego policies").add_subparsers(
        required=True, metavar="ACTION"
    )
    cli_policy.add_commands(policy)
    return parser


def _serve(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    if args.workers is not None:
        environ["BROKER_SERVER_WORKERS"] = str(args.workers)
    life_pipe = worker_pipe_fd(environ)  # set only by the supervisor for its workers
    settings = load_settings(args.config, environ)
    made = None
    if makes_keys(settings):  # sealed: its keys are made here, once, before any worker
        made = asyncio.run(make_sealed_keys(settings, now=datetime.now(UTC)))
        settings = made.settings
        os.environ.update(made.environ)  # the workers read the same files
    with discarded(made):
        if settings.server.workers > 1 and life_pipe is None:
            return run_loop(Supervisor(settings, args.config).run(), settings.server.event_loop)
        run_loop(_serve_until_signalled(settings, life_pipe=life_pipe), settings.server.event_loop)
    return 0


def run_loop(main: Coroutine[object, object, T], event_loop: str) -> T:
    """Run ``main`` on the configured event loop: uvloop (the default) or asyncio's own."""
    if event_loop == "uvloop":
        import uvloop  # noqa: PLC0415 - only the serving commands need it

        return uvloop.run(main)
    return asyncio.run(main)


async def _serve_until_signalled(settings: Settings, *, life_pipe: int | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then shut down cleanly (connections drained). A worker
    (``life_pipe`` set) binds with SO_REUSEPORT and also stops when its supervisor is gone."""
    workers = WorkerGroup.for_log(settings.audit.log, os.environ)  # from the supervisor
    runner = BrokerRunner(
        create_app(settings, workers=workers),
        settings.server,
        access_log=logging.getLogger("broker.access"),
    )
    await runner.setup()
    try:
        tls = server_ssl_context(settings)
        site = web.TCPSite(
            runner,
            settings.server.host,
            settings.server.port,
            ssl_context=tls,
            reuse_port=(life_pipe is not None) or None,
        )
        await site.start()
        bound = ", ".join(
            f"{a[0]}:{a[1]}" for a in runner.addresses
        )  # the port, if listen ends in :0
        print(f"broker serving on {bound}", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if life_pipe is not None:  # end-of-file: the supervisor died (even by SIGKILL)

            def supervisor_gone() -> None:
                loop.remove_reader(life_pipe)
                stop.set()

            loop.add_reader(life_pipe, supervisor_gone)
        reloads: set[asyncio.Task[object]] = set()
        policies = runner.app[POLICIES]  # set by the composition root during runner.setup()

        def reload_policy() -> None:  # SIGHUP: the TLS pair; check, test and swap the policy
            cert, key = settings.server.tls_cert, settings.server.tls_key
            if settings.sealed.launcher_socket is not None:  # the token binds the TLS key
                logging.getLogger("broker").warning(
                    "sealed broker: the TLS certificate is not reloaded (its attestation "
                    "binds the key); restart instead"
                )
            elif tls is not None and cert is not None and key is not None:
                reload_server_certificate(tls, cert, key)
            task = asyncio.create_task(policies.on_signal())
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, reload_policy)
        if workers.supervisor_pid is not None:  # only now: the supervisor then sends SIGHUP,
            await asyncio.to_thread(workers.mark_serving)  # whose default action kills
        await stop.wait()
    finally:
        await runner.cleanup()


def _demo(args: argparse.Namespace) -> int:
    from broker.demo import run_demo  # noqa: PLC0415 - the dev issuer loads only on this path

    return 0 if asyncio.run(run_demo(args.workdir)) else EXIT_NO


def _verify(args: argparse.Namespace) -> int:
    """The verdict as JSON on stdout: exit 1 for evidence that does not verify; exit 2, with the
    same JSON and one line on stderr, for a file or an option the command cannot use."""
    if args.kind == "broker":  # the one kind checked over the network: a running broker
        from broker.cli import verify_broker as cli_verify_broker  # noqa: PLC0415 - the SDK loads only on this path

        return cli_verify_broker.run(args)
    try:
        result = offline.run(args)
    except (InputError, ConfigError) as exc:
        print(json.dumps({"error": {"code": exc.code.value, "message": exc.message}}))
        if isinstance(exc, ConfigError):
            print(f"error: {exc.message}", file=sys.stderr)
            return EXIT_USAGE
        return EXIT_NO
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
