"""Signed policy never goes back (TUF's rule), tested as deployed: ``broker serve --workers 2``
polling a bundle server on loopback that sends no ETags (every poll downloads the bundle).

Whoever can write the bundle storage can serve any bundle the team ever signed. The attacks:
serve back the bundle from before an image was withdrawn (a rollback), an expired bundle, a
bundle signed for another environment; take the bundle server down so a restarting replica has
nothing to load. Each is refused, logged once (not once per poll, not once per worker), and the
last good policy keeps deciding: the withdrawn image's key stays denied. A deliberate rollback
goes only through the admin API, and the log names who and why.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from broker.config import load_settings
from broker.core.errors import ConfigError, UpstreamError
from broker.core.metrics import Metrics
from broker.dev.issuer import DevIssuer
from broker.policy.freshness import Freshness
from broker.policy.manager import PolicyManager
from tests.integration.conftest import write_config
from tests.support.bundle_server import (
    FAR_FUTURE,
    SCOPE,
    WIDENING_MODULE,
    BundleServer,
    build,
    opa_built,
    signed,
    signing_keys,
)
from tests.support.issuers import dev_issuer
from tests.support.processes import ROOT, create_key_with_cli, free_port, release_body, wait_ready

pytestmark = pytest.mark.timeout(300)
TOKEN = "policy-admin-freshness-7d1a"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
POLL_SECONDS = 1
WAIT_TRIES = 600  # x 0.1 s: generous on a loaded 2-core machine; nothing is timed


def sha256(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


@dataclass
class Deployment:
    """One replica (``--workers 2``) of a broker on a bundle server, and what it logged."""

    workdir: Path
    config: Path
    issuer: DevIssuer
    server: BundleServer
    environ: dict[str, str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "decisions.log"

    @property
    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.workdir / "tls" / "ca.pem"))

    @property
    def stderr(self) -> Path:
        return self.workdir / "broker.stderr"

    async def start(self, *, serves: bool = True) -> None:
        """Run ``broker serve --workers 2``; wait until both workers serve (``serves``)."""
        with self.stderr.open("a") as stderr:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "broker.cli",
                    "serve",
                    "--config",
                    str(self.config),
                    "--workers",
                    "2",
                ],
                cwd=ROOT,
                env={**os.environ, **self.environ},
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
            )
        if not serves:
            return
        await asyncio.to_thread(wait_ready, self.port, self.tls)
        seen: set[int] = set()

        async def both_serve() -> bool:  # a SIGHUP to a worker still starting would kill it
            async with (
                session() as http,
                http.get(self.url + "/healthz", ssl=self.tls) as response,
            ):
                seen.add((await response.json())["worker"])
            return seen == {0, 1}

        await wait_for(both_serve, "both workers serve")

    async def stop(self) -> None:
        assert self.process is not None
        self.process.terminate()
        await asyncio.to_thread(self.process.communicate, timeout=60)
        assert self.process.returncode == 0, self.stderr.read_text()[-3000:]

    def records(self, kind: str) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [r for r in map(json.loads, lines) if r["type"] == kind]


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    issuer = dev_issuer()
    workdir = tmp_path / "b"
    config = await asyncio.to_thread(write_config, workdir, issuer)
    verify = await asyncio.to_thread(signing_keys, workdir)
    await asyncio.to_thread(create_key_with_cli, config)
    server = BundleServer(etags=False)  # every poll downloads the bundle again
    await server.start()
    port = free_port()
    deployed = Deployment(
        workdir,
        config,
        issuer,
        server,
        {
            "BROKER_SERVER_LISTEN": f"127.0.0.1:{port}",
            "BROKER_AUDIT_LOG": str(workdir / "decisions.log"),
            "BROKER_POLICY_BUNDLE_URL": server.url,
            "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": str(verify),
            "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
            "BROKER_POLICY_RELOAD_SECONDS": str(POLL_SECONDS),
            "BROKER_ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
        },
        port=port,
    )
    try:
        yield deployed
    finally:
        if deployed.process is not None and deployed.process.poll() is None:
            deployed.process.kill()
            deployed.process.communicate(timeout=30)
        await server.stop()


async def wait_for(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(WAIT_TRIES):
        if await condition():
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out waiting until {what}")


class Client:
    def __init__(self, session: aiohttp.ClientSession, deployed: Deployment) -> None:
        self.session, self.deployed = session, deployed

    async def readyz(self) -> dict[str, Any]:
        d = self.deployed
        async with self.session.get(d.url + "/readyz", ssl=d.tls, headers=ADMIN) as response:
            body: dict[str, Any] = await response.json()
            return body

    async def digests(self) -> set[str]:
        """The digest each worker serves (readyz answered by both, connections not reused)."""
        return {(await self.readyz())["checks"]["policy"] for _ in range(24)}

    async def release(self) -> int:
        d = self.deployed
        body = await release_body(self.session, d.url, d.tls, d.issuer)
        async with self.session.post(d.url + "/v1/release", json=body, ssl=d.tls) as response:
            return response.status

    async def metrics(self) -> str:
        d = self.deployed
        async with self.session.get(d.url + "/metrics", ssl=d.tls, headers=ADMIN) as response:
            return await response.text()

    async def serving(self, digest: str) -> None:
        async def both() -> bool:
            return await self.digests() == {digest}

        await wait_for(both, f"both workers serve {digest}")

    async def polls(self, count: int) -> None:
        """Until the bundle server has answered ``count`` more polls (both workers poll)."""
        target = self.deployed.server.polls + count

        async def polled() -> bool:
            return self.deployed.server.polls >= target

        await wait_for(polled, f"{count} more polls")


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def refusals(deployed: Deployment, bundle: bytes) -> list[dict[str, Any]]:
    return [
        r
        for r in deployed.records("policy_reload_failed")
        if r.get("bundle_sha256") == sha256(bundle)
    ]


async def refused_once(client: Client, bundle: bytes, says: str, active: str) -> None:
    """Serve ``bundle``; one record for it once both workers polled it many times; the last good
    policy (``active``) keeps serving and the withdrawn image stays denied."""
    deployed = client.deployed
    deployed.server.body = bundle

    async def logged() -> bool:
        return bool(refusals(deployed, bundle))

    await wait_for(logged, "the refused bundle is logged")
    await client.polls(8)  # >= 4 more polls per worker, each downloading the bundle again
    (record,) = refusals(deployed, bundle)
    assert says in record["problem"], record
    assert record["active_digest"] == active
    assert await client.digests() == {active}
    assert await client.release() == 403  # the withdrawn image is still denied


async def test_a_worker_that_missed_a_version_catches_up_with_the_replicas_floor(
    deployment: Deployment,
) -> None:
    """Each worker polls on its own. The storage served v2 to one poll only, then v1 again (a
    freeze): the worker that missed v2 saw nothing new and kept serving v1, releasing the
    withdrawn image, while the other served v2. Now a worker behind the replica's floor loads
    the floor's bundle."""
    workdir = deployment.workdir
    v1, allowed = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    v2, withdrawn = await asyncio.to_thread(build, workdir, "v2", allowed=False)
    deployment.server.body = v1
    await deployment.start()
    async with session() as http:
        client = Client(http, deployment)
        await client.polls(4)
        deployment.server.once = v2  # one worker's next poll gets v2; every other gets v1

        async def one_loaded_it() -> bool:
            return (
                bool(deployment.records("policy_change")[-1:])
                and deployment.records("policy_change")[-1].get("new_digest") == withdrawn
            )

        await wait_for(one_loaded_it, "a worker put v2 in force")
        await client.polls(8)  # both workers polled again, seeing only v1
        served = {(await client.readyz())["checks"]["policy"] for _ in range(40)}
        assert served == {withdrawn}, (served, allowed)
        assert [await client.release() for _ in range(6)] == [403] * 6
        assert not refusals(deployment, v2)
    await deployment.stop()


async def test_rollback_expired_and_foreign_bundles_are_refused_once_each(
    deployment: Deployment,
) -> None:
    workdir = deployment.workdir
    v1, allowed = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    deployment.server.body = v1
    await deployment.start()
    async with session() as http:
        client = Client(http, deployment)
        assert await client.release() == 200
        v2, withdrawn = await asyncio.to_thread(build, workdir, "v2", allowed=False)
        deployment.server.body = v2
        await client.serving(withdrawn)
        assert await client.release() == 403
        # The attack: serve back what the team signed before it withdrew the image.
        await refused_once(client, v1, "older than version 2 already loaded", withdrawn)
        expired, _ = await asyncio.to_thread(build, workdir, "v3", allowed=True, expires=1_000_000)
        await refused_once(client, expired, "expired at", withdrawn)
        foreign, _ = await asyncio.to_thread(build, workdir, "v4", allowed=True, scope="staging")
        await refused_once(client, foreign, "scope does not match", withdrawn)
        # Signed by the team's key, fresh, in scope, but built by OPA's own tools around a
        # module that widens allow: the structure rules hold at load time too (issue 27, 10).
        widening = await asyncio.to_thread(
            opa_built, workdir / "policies", {"broker/widen.rego": WIDENING_MODULE}
        )
        wide = signed(widening, workdir / "sign.pem", Freshness(version=5, expires=FAR_FUTURE))
        await refused_once(client, wide, "package broker.release is not allowed", withdrawn)

        async def degraded() -> bool:  # the source serves refused bundles: shown, still serving
            return bool((await client.readyz())["status"] == "degraded")

        await wait_for(degraded, "/readyz shows the failing source")
    await deployment.stop()
    changes = [(c["trigger"], c["new_digest"], c.get("version")) for c in
               deployment.records("policy_change")]  # fmt: skip
    assert changes == [("startup", allowed, 1), ("poll", withdrawn, 2)]
    state = json.loads((workdir / "decisions.log.policy" / "state.json").read_text())
    assert (state["version"], state["highest"]) == (2, 2)


async def test_replica_restarts_on_its_cached_bundle_while_the_bundle_server_is_down(
    deployment: Deployment,
) -> None:
    workdir = deployment.workdir
    v2, withdrawn = await asyncio.to_thread(build, workdir, "v2", allowed=False)
    deployment.server.body = v2
    await deployment.start()
    await deployment.stop()
    await deployment.server.stop()  # the bundle server is down
    await deployment.start()  # and the replica still starts, on its last verified bundle
    async with session() as http:
        client = Client(http, deployment)
        assert await client.digests() == {withdrawn}
        assert await client.release() == 403

        async def degraded() -> bool:
            return bool((await client.readyz())["status"] == "degraded")

        await wait_for(degraded, "/readyz shows the cached copy")
        ready = await client.readyz()
        source = ready["checks"]["policy_source"]
        assert (source["ok"], source["serving_from"], source["version"]) == (
            False, "cached copy", 2,
        )  # fmt: skip
        metrics = await client.metrics()
        assert "broker_policy_source_up 0.0" in metrics
        failures = [line for line in metrics.splitlines()
                    if line.startswith("broker_policy_source_failures_total ")]  # fmt: skip
        assert failures, metrics
        assert float(failures[0].split()[1]) >= 1, failures
        # The server comes back with the same bundle: the source is up again.
        await deployment.server.start()

        async def source_up() -> bool:
            return "broker_policy_source_up 1.0" in str(await client.metrics())

        await wait_for(source_up, "the source is up again")

        async def from_source() -> bool:
            ready = await client.readyz()
            return bool(ready["checks"]["policy_source"]["serving_from"] == "source")

        await wait_for(from_source, "/readyz shows the source again")
    await deployment.stop()


async def test_deliberate_downgrade_goes_only_through_the_admin_api_to_the_version_it_names(
    deployment: Deployment,
) -> None:
    """The admin names the target version (and bytes): storage that swaps in another signed
    bundle between the request and the workers' fetches is refused by every worker."""
    workdir = deployment.workdir
    older, _ = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    v2, allowed = await asyncio.to_thread(build, workdir, "v2", allowed=True)
    v3, withdrawn = await asyncio.to_thread(build, workdir, "v3", allowed=False)
    deployment.server.body = v3
    await deployment.start()
    reload_url = deployment.url + "/v1/admin/policy/reload"
    async with session() as http:
        client = Client(http, deployment)

        async def reload(body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
            async with http.post(reload_url, json=body, ssl=deployment.tls,
                                 headers=ADMIN) as response:  # fmt: skip
                return response.status, await response.json()

        deployment.server.body = older
        # A plain admin reload does not roll back either.
        status, answer = await reload(None)
        assert status == 409
        assert "older than version 3" in answer["error"]["problem"]
        reason = "INC-4711: v3 breaks every release on the new GPU driver"
        # A downgrade to whatever the storage serves at that moment is no longer asked for.
        status, answer = await reload({"allow_downgrade": True, "reason": reason})
        assert (status, answer["error"]["code"]) == (400, "downgrade_target_required"), answer
        # The admin names version 2; the storage serves version 1: both workers refuse it.
        status, answer = await reload({"allow_downgrade": True, "to_version": 2, "reason": reason})
        assert status == 409, answer
        assert (
            "the downgrade names version 2; the source serves version 1"
            in (answer["error"]["problem"])
        )
        assert [w["ok"] for w in answer["error"]["workers"]] == [False, False], answer
        assert await client.digests() == {withdrawn}
        # Version 2, but not the bytes named.
        deployment.server.body = v2
        status, answer = await reload(
            {"allow_downgrade": True, "to_version": 2, "bundle_sha256": sha256(older),
             "reason": reason}
        )  # fmt: skip
        assert status == 409, answer
        assert "the downgrade names bundle" in answer["error"]["problem"]
        status, answer = await reload(
            {"allow_downgrade": True, "to_version": 2, "bundle_sha256": sha256(v2),
             "reason": reason}
        )  # fmt: skip
        assert status == 200, answer
        assert (answer["active_digest"], answer["version"]) == (allowed, 2)
        assert [w["digest"] for w in answer["workers"]] == [allowed, allowed]
        assert await client.release() == 200
        # The version rolled back from stays refused: storage cannot serve it back.
        await refused_once_after_downgrade(client, v3, allowed)
    await deployment.stop()
    (downgrade,) = [c for c in deployment.records("policy_change") if "downgrade" in c]
    assert downgrade["trigger"] == "admin-downgrade"
    assert downgrade["who"].startswith("token:")
    assert downgrade["downgrade"] == {"from_version": 3, "to_version": 2, "reason": reason}
    assert (downgrade["old_digest"], downgrade["new_digest"]) == (withdrawn, allowed)
    assert downgrade["bundle_sha256"] == sha256(v2)


async def refused_once_after_downgrade(client: Client, bundle: bytes, active: str) -> None:
    deployed = client.deployed
    deployed.server.body = bundle

    async def logged() -> bool:
        return bool(refusals(deployed, bundle))

    await wait_for(logged, "the rolled-back-from bundle is refused")
    await client.polls(8)
    (record,) = refusals(deployed, bundle)
    assert "was rolled back from" in record["problem"]
    assert await client.digests() == {active}


async def test_bundle_server_with_a_private_ca_is_trusted_only_through_bundle_ca(
    tmp_path: Path,
) -> None:
    """An HTTPS bundle server whose certificate a private CA issued: ``[policy] bundle_ca``
    (a path relative to the config file) makes it trusted; without it the broker refuses to
    start (no ``SSL_CERT_FILE`` needed, none honoured as a substitute here)."""
    workdir = tmp_path / "b"
    config = await asyncio.to_thread(write_config, workdir, dev_issuer())
    await asyncio.to_thread(signing_keys, workdir)
    body, digest = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    app = web.Application()

    async def bundle(_: web.Request) -> web.Response:
        return web.Response(body=body)

    app.router.add_get("/bundle.tar.gz", bundle)
    runner = web.AppRunner(app)
    await runner.setup()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    await asyncio.to_thread(
        server_tls.load_cert_chain, workdir / "tls" / "server.pem", workdir / "tls" / "server.key"
    )
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls).start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}/bundle.tar.gz"
    environ = {
        "BROKER_POLICY_BUNDLE_URL": url,
        "BROKER_POLICY_BUNDLE_CA": "tls/ca.pem",
        "BROKER_POLICY_BUNDLE_VERIFICATION_KEY": "verify.pem",
        "BROKER_POLICY_BUNDLE_VERIFICATION_SCOPE": SCOPE,
    }
    settings = await asyncio.to_thread(load_settings, config, environ)
    assert settings.policy.bundle_ca == workdir / "tls" / "ca.pem"
    records: list[Mapping[str, Any]] = []

    async def append(record: Mapping[str, Any]) -> None:
        records.append(record)

    try:
        async with aiohttp.ClientSession() as http:
            trusted = PolicyManager(settings.policy, Metrics(), state_dir=tmp_path / "one")
            assert (await trusted.open(append, session=http)).digest == digest
            untrusted = PolicyManager(
                replace(settings.policy, bundle_ca=None), Metrics(), state_dir=tmp_path / "two"
            )
            with pytest.raises(UpstreamError) as caught:
                await untrusted.open(append, session=http)
            assert "ClientConnectorCertificateError" in caught.value.message
    finally:
        await runner.cleanup()
    with pytest.raises(ConfigError, match="bundle_ca"):
        await asyncio.to_thread(
            load_settings, config, {**environ, "BROKER_POLICY_BUNDLE_URL": "gs://b/o"}
        )


CONFLICT = """
# Two complete definitions that disagree: OPA builds it, and evaluation fails at run time.
conflict := 1 if input.schema

conflict := 2 if input.request

allow if conflict == 3
"""


def build_failing_at_run_time(workdir: Path, revision: str) -> bytes:
    """A signed, fresh, in-scope bundle (``broker policy build``) whose Rego fails when
    evaluated (a conflict between two complete rules that ``allow`` uses)."""
    release = workdir / "policies" / "broker" / "release.rego"
    original = release.read_text()
    release.write_text(original + CONFLICT)
    try:
        return build(workdir, revision, allowed=True)[0]
    finally:
        release.write_text(original)


async def test_bundles_failing_at_run_time_or_reusing_the_version_in_force_are_refused_once(
    deployment: Deployment,
) -> None:
    """A bundle whose Rego fails at run time was refused on every poll of every worker (the
    smoke test's error was not remembered) while /readyz said the source was fine; a bundle
    with the version in force but other bytes went live (a version names one bundle)."""
    workdir = deployment.workdir
    v2, withdrawn = await asyncio.to_thread(build, workdir, "v2", allowed=False)
    deployment.server.body = v2
    await deployment.start()
    async with session() as http:
        client = Client(http, deployment)
        broken = await asyncio.to_thread(build_failing_at_run_time, workdir, "v3")
        await refused_once(client, broken, "policy evaluation failed", withdrawn)

        async def degraded() -> bool:
            source = (await client.readyz())["checks"]["policy_source"]
            return source["ok"] is False and "refused bundle" in str(source["problem"])

        await wait_for(degraded, "/readyz shows the source serving a refused bundle")
        same_version, _ = await asyncio.to_thread(build, workdir, "v2b", allowed=True, version=2)
        await refused_once(client, same_version, "already in force with other bytes", withdrawn)
    await deployment.stop()
    assert [c["new_digest"] for c in deployment.records("policy_change")] == [withdrawn]


async def test_floor_that_cannot_be_saved_keeps_the_new_policy_out(
    deployment: Deployment,
) -> None:
    """The floor was saved after the swap and a failure only logged: the new version served
    with rollback protection silently off. Now it is saved first, or nothing goes live."""
    workdir = deployment.workdir
    v1, allowed = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    v2, withdrawn = await asyncio.to_thread(build, workdir, "v2", allowed=False)
    deployment.server.body = v1
    await deployment.start()
    state = workdir / "decisions.log.policy" / "state.json"
    state.unlink()
    (state / "blocker").mkdir(parents=True)  # os.replace onto a non-empty directory fails
    async with session() as http:
        client = Client(http, deployment)
        deployment.server.body = v2

        async def logged() -> bool:
            return bool(refusals(deployment, v2))

        await wait_for(logged, "the reload whose floor cannot be saved is logged")
        await client.polls(8)
        refused = refusals(deployment, v2)
        assert 1 <= len(refused) <= 2, refused  # once per worker, not once per poll
        assert all("floor cannot be saved" in r["problem"] for r in refused), refused
        assert await client.digests() == {allowed}
        assert await client.release() == 200  # v2 never served

        async def shown() -> bool:
            source = (await client.readyz())["checks"]["policy_source"]
            return source["ok"] is False and "floor cannot be saved" in str(source["problem"])

        await wait_for(shown, "/readyz shows the floor that cannot be saved")
        assert "broker_policy_floor_saved 0.0" in await client.metrics()
        await asyncio.to_thread(shutil.rmtree, state)  # the volume is writable again
        await client.serving(withdrawn)
        assert await client.release() == 403
        assert "broker_policy_floor_saved 1.0" in await client.metrics()
    await deployment.stop()
    assert json.loads(state.read_text())["version"] == 2


async def test_lost_or_corrupt_policy_state_does_not_reset_the_floor(
    deployment: Deployment,
) -> None:
    """Deleting ``<log>.policy/`` (or a new volume) reset the floor to 0, and a corrupt
    ``state.json`` crashed the watch task; the log's last ``policy_change`` now sets the floor."""
    workdir = deployment.workdir
    v1, _ = await asyncio.to_thread(build, workdir, "v1", allowed=True)
    v2, withdrawn = await asyncio.to_thread(build, workdir, "v2", allowed=False)
    deployment.server.body = v2
    await deployment.start()
    await deployment.stop()
    await asyncio.to_thread(shutil.rmtree, workdir / "decisions.log.policy")
    deployment.server.body = v1  # the storage serves back the older signed bundle
    await deployment.start(serves=False)

    async def refused_at_start() -> bool:
        return "older than version 2 already loaded" in deployment.stderr.read_text()

    await wait_for(refused_at_start, "the replica refuses the older bundle at start-up")
    assert deployment.process is not None
    deployment.process.kill()
    await asyncio.to_thread(deployment.process.communicate, timeout=60)
    assert [c["new_digest"] for c in deployment.records("policy_change")] == [withdrawn]
    deployment.server.body = v2
    await deployment.start()
    state = workdir / "decisions.log.policy" / "state.json"
    state.write_text('{"version": "2", "highest": 2}')  # corrupt: not an integer
    async with session() as http:
        client = Client(http, deployment)
        await refused_once(client, v1, "older than version 2 already loaded", withdrawn)
        v3, allowed = await asyncio.to_thread(build, workdir, "v3", allowed=True)
        deployment.server.body = v3  # polling goes on: a newer version still goes live
        await client.serving(allowed)
    await deployment.stop()
    assert json.loads(state.read_text())["version"] == 3
