"""``broker dev``: a development workspace a runner developer can use in five minutes.

``broker dev init DIR`` lays out a broker on loopback (TLS with its own CA, the shipped policy
allowing the given image digests for a key, a local KEK, a decision log) with a **persistent
development issuer** (``DIR/dev-issuer.json``, private), creates the key, and says what to run.
``broker dev token DIR --image … --nonce …`` mints a token from that issuer (for curl), and the
SDK's ``DevTokenSource.from_workspace(DIR, image=…)`` does the same for ``BrokerClient``.
``broker dev launcher --workspace DIR --socket PATH --image …`` serves that issuer as a
Confidential Space launcher on a Unix socket, for a broker with ``[sealed] launcher_socket``.

DEVELOPMENT ONLY. The issuer is a ``*.invalid`` host, which a broker trusts only when it
listens on loopback (``config/``); ``dev token`` refuses a workspace whose broker does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from broker.config import is_development_issuer, is_loopback, load_settings, split_listen
from broker.core.errors import ConfigError
from broker.crypto.svid import valid_trust_domain
from broker.dev.identity_ca import make_dev_identity_ca
from broker.dev.issuer import DEV_ISSUER, ISSUER_FILE, DevIssuer, Workload
from broker.dev.launcher import DevLauncher, serve_dev_launcher
from broker.dev.workspace import private_pem, write_dev_workspace
from broker.keys.factory import open_key_service
from broker.keys.store.base import Purpose

DEV_AUDIENCE = "https://broker.dev.invalid"


def add_commands(commands: Any) -> None:
    dev = commands.add_parser(
        "dev", help="a development workspace on loopback (DEVELOPMENT ONLY)"
    ).add_subparsers(required=True, metavar="ACTION")
    init = dev.add_parser("init", help="lay out a loopback broker with a persistent dev issuer")
    init.add_argument("workspace", type=Path, metavar="DIR")
    init.add_argument(
        "--image", action="append", required=True, help="an image digest (sha256:…) to allow"
    )
    init.add_argument("--key", default="models/dev", help="the key to create and allow")
    init.add_argument("--port", type=int, default=8443, help="the loopback port to serve on")
    init.add_argument(
        "--identity",
        metavar="TRUST_DOMAIN",
        help="also issue workload certificates (SPIFFE X.509-SVIDs) in this trust domain: "
        "[attest] and [identity] on, a development root and intermediate CA, and the images "
        "mapped to spiffe://TRUST_DOMAIN/workloads/dev",
    )
    init.set_defaults(run=_init)
    token = dev.add_parser("token", help="mint a development token from a workspace's issuer")
    token.add_argument("workspace", type=Path, metavar="DIR")
    token.add_argument("--image", required=True, help="the workload's image digest")
    token.add_argument("--nonce", action="append", required=True, help="eat_nonce (repeatable)")
    token.add_argument("--audience", help="default: the workspace broker's [server] audience")
    token.add_argument("--debug", action="store_true", help="a debug image (the policy denies it)")
    token.set_defaults(run=_token)
    launcher = dev.add_parser(
        "launcher", help="a development Confidential Space launcher on a Unix socket"
    )
    launcher.add_argument("--workspace", type=Path, required=True, metavar="DIR")
    launcher.add_argument("--socket", type=Path, required=True, help="the Unix socket to serve")
    launcher.add_argument("--image", required=True, help="the image digest the tokens name")
    launcher.add_argument(
        "--lifetime", type=int, default=3600, help="each token's validity, in seconds"
    )
    launcher.set_defaults(run=_launcher)


DEV_SPIFFE_PATH = "workloads/dev"


def _identity_toml(workspace: Path, trust_domain: str) -> str:
    """``[attest]`` with a result key and ``[identity]`` with a development CA, written under
    ``workspace`` (relative paths: the workspace can move)."""
    if not valid_trust_domain(trust_domain):
        raise ConfigError("--identity", "must be a SPIFFE trust domain name (e.g. dev.example)")
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "ear-signing.pem").write_bytes(
        private_pem(ec.generate_private_key(ec.SECP256R1()))
    )
    make_dev_identity_ca(workspace / "identity", trust_domain, now=datetime.now(UTC))
    return (
        '[attest]\nenabled = true\nsigning_key = "ear-signing.pem"\n\n'
        f'[identity]\nenabled = true\ntrust_domain = "{trust_domain}"\n'
        'ca_certificates = "identity/ca-chain.pem"\nca_key = "identity/ca.key"\n'
    )


def _init(args: argparse.Namespace) -> int:
    workspace: Path = args.workspace
    if (workspace / "broker.toml").exists():
        raise ConfigError("DIR", f"{workspace} already holds a workspace")
    if not 0 < args.port < 65536:
        raise ConfigError("--port", "must be 1..65535")
    issuer = DevIssuer(dev_mode=True)
    config = write_dev_workspace(
        workspace,
        issuer,
        audience=DEV_AUDIENCE,
        images={args.key: list(args.image)},
        now=datetime.now(UTC),
        server_extra={"listen": f"127.0.0.1:{args.port}"},
        extra_toml=_identity_toml(workspace, args.identity) if args.identity else "",
        identities=dict.fromkeys(args.image, DEV_SPIFFE_PATH) if args.identity else None,
    )
    text = config.read_text(encoding="utf-8").replace('listen = "127.0.0.1:0"\n', "", 1)
    config.write_text(text, encoding="utf-8")
    issuer.save(workspace / ISSUER_FILE)
    settings = load_settings(config, {})

    async def create() -> None:
        async with open_key_service(settings.keys, create_missing_kek=True) as keys:
            await keys.create(args.key, Purpose.MODEL_WEIGHTS, now=datetime.now(UTC))

    asyncio.run(create())
    url = f"https://127.0.0.1:{args.port}"
    print(
        json.dumps(
            {
                "config": str(config),
                "serve": f"broker serve --config {config}",
                "url": url,
                "ca": str(workspace / "tls" / "ca.pem"),
                "audience": DEV_AUDIENCE,
                "key": args.key,
                "images": list(args.image),
                "token_source": (
                    f"DevTokenSource.from_workspace(Path({str(workspace)!r}), "
                    f"image={args.image[0]!r})"
                ),
            },
            indent=2,
        )
    )
    return 0


def _token(args: argparse.Namespace) -> int:
    workspace: Path = args.workspace
    settings = load_settings(workspace / "broker.toml", {})
    host, _ = split_listen(settings.server.listen)
    if not is_loopback(host):
        raise ConfigError("DIR", "the workspace's broker does not listen on loopback")
    if not any(is_development_issuer(i.issuer) for i in settings.issuers):
        raise ConfigError("DIR", "the workspace's broker does not trust a development issuer")
    try:
        issuer = DevIssuer.load(workspace / ISSUER_FILE)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("DIR", f"no development issuer in {workspace}: {exc}") from exc
    if issuer.issuer != DEV_ISSUER:
        raise ConfigError("DIR", f"{workspace}'s issuer is not the development issuer")
    print(
        issuer.mint(
            audience=args.audience or settings.server.audience,
            nonces=list(args.nonce),
            workload=Workload(image_digest=args.image, debug=args.debug),
            now=datetime.now(UTC),
        )
    )
    return 0


def _launcher(args: argparse.Namespace) -> int:
    """Serve the development launcher until SIGTERM or SIGINT (``broker dev launcher``)."""
    try:
        issuer = DevIssuer.load(args.workspace / ISSUER_FILE)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            "--workspace", f"no development issuer in {args.workspace}: {exc}"
        ) from exc
    if not args.image.startswith("sha256:") or not 0 < args.lifetime <= 86400:
        raise ConfigError("--image", "a sha256:… digest, and --lifetime 1..86400")
    launcher = DevLauncher(
        issuer, Workload(image_digest=args.image), lifetime=timedelta(seconds=args.lifetime)
    )

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with serve_dev_launcher(launcher, args.socket):
            print(f"development launcher on {args.socket} (DEVELOPMENT ONLY)", flush=True)
            await stop.wait()

    asyncio.run(serve())
    return 0
