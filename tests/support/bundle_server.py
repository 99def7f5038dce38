"""A policy bundle server on loopback and the team's signed bundles, for the tests that run the
broker as deployed with ``[policy] bundle_url``.

``BundleServer`` serves one body at ``/bundle.tar.gz``, with a strong ``ETag`` (``If-None-Match``
answered 304) or, ``etags=False``, as a plain file server that sends the whole body on every
poll; it counts its answers, and ``stop()`` / ``start()`` take it down and bring it back on the
same port. ``build`` signs the workdir's policy as the team's pipeline does
(``broker policy build --scope --version --expires-in``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from broker.policy import opa_bundle
from broker.policy.build import WRAPPER, build_bundle, run_opa
from broker.policy.freshness import EXPIRES_CLAIM, VERSION_CLAIM, Freshness
from broker.policy.structure import WRAPPER_PACKAGE
from broker.policy.testing import find_opa
from broker.policy.wasm import ENTRYPOINT
from tests.support.constants import ALLOWED, KEY

SCOPE = "test-env"
FAR_FUTURE = 4_000_000_000  # Unix seconds (2096)


class BundleServer:
    """Serves one bundle at /bundle.tar.gz; counts 200s and 304s."""

    def __init__(self, *, etags: bool = True) -> None:
        self.body = b""
        self.once: bytes | None = None  # served to the next request only, then ``body`` again
        self.etags = etags
        self.answers: dict[int, int] = {200: 0, 304: 0}
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bundle.tar.gz"

    @property
    def polls(self) -> int:
        return self.answers[200] + self.answers[304]

    async def handle(self, request: web.Request) -> web.Response:
        body, self.once = (self.body, None) if self.once is None else (self.once, None)
        etag = '"' + hashlib.sha256(body).hexdigest() + '"'
        if self.etags and request.headers.get("If-None-Match") == etag:
            self.answers[304] += 1
            return web.Response(status=304, headers={"ETag": etag})
        self.answers[200] += 1
        return web.Response(body=body, headers={"ETag": etag} if self.etags else {})

    async def start(self) -> None:
        """Listen on 127.0.0.1 (the same port again after ``stop``)."""
        app = web.Application()
        app.router.add_get("/bundle.tar.gz", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """Down: connections to the port are refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def signing_keys(directory: Path) -> Path:
    """``sign.pem`` (EC P-256) and ``verify.pem`` in ``directory``; the latter's path."""
    key = ec.generate_private_key(ec.SECP256R1())
    (directory / "sign.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (directory / "verify.pem").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return directory / "verify.pem"


def build(
    workdir: Path,
    revision: str,
    *,
    allowed: bool,
    version: int | None = None,
    expires: int = FAR_FUTURE,
    scope: str = SCOPE,
) -> tuple[bytes, str]:
    """The workdir's policy, with the image allowed or withdrawn, as a bundle signed for
    ``scope`` with ``policy_version`` ``version`` (default: the revision's number, "v2" -> 2);
    its bytes and policy digest."""
    path = workdir / "policies" / "broker" / "data.json"
    data = json.loads(path.read_text())
    data["images"][KEY] = [ALLOWED] if allowed else []
    path.write_text(json.dumps(data))
    out = workdir / f"bundle-{revision}.tar.gz"
    fresh = Freshness(version=version or int(revision.lstrip("v")), expires=expires)
    compiled = build_bundle(
        workdir / "policies", out, opa=find_opa(), signing_key=workdir / "sign.pem",
        revision=revision, scope=scope, freshness=fresh,
    )  # fmt: skip
    return out.read_bytes(), compiled.digest


WIDENING_MODULE = """package broker.release

import rego.v1

# Not a per-key policy: a second definition of allow, which widens it for one key.
allow if input.request.key == "models/llama"
"""


def opa_built(policy_dir: Path, extra: dict[str, str] | None = None) -> dict[str, bytes]:
    """The files of ``opa build -b -t wasm`` run by the pinned OPA (not ``broker policy
    build``) inside a copy of ``policy_dir`` with the broker's decision wrapper and ``extra``
    modules, tests left out, as the broker's reader reads them (OPA's leading ``/`` taken off),
    nothing else changed."""
    with tempfile.TemporaryDirectory(prefix="opa-built-") as tmp:
        root = Path(tmp) / "policy"
        shutil.copytree(policy_dir, root)
        for name, text in {WRAPPER_PACKAGE: WRAPPER, **(extra or {})}.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        output = Path(tmp) / "bundle.tar.gz"
        done = run_opa(
            find_opa(),
            *("build", "-b", "-t", "wasm", "-e", ENTRYPOINT, "--ignore", "*_test.rego"),
            *("-o", str(output), "."),
            cwd=root,
        )
        assert done.returncode == 0, done.stderr
        return opa_bundle.unpack(output.read_bytes(), source="opa")


def signed(files: dict[str, bytes], key_pem: Path, fresh: Freshness, scope: str = SCOPE) -> bytes:
    """``files`` packed and signed in OPA's format, with the freshness claims."""
    key = load_pem_private_key(key_pem.read_bytes(), None)
    claims = {VERSION_CLAIM: fresh.version, EXPIRES_CLAIM: fresh.expires}
    signature = opa_bundle.signatures_file(files, key, scope=scope, claims=claims)
    return opa_bundle.pack({**files, opa_bundle.SIGNATURES: signature})
