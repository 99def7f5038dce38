"""aiohttp application factory: wiring only.

``create_app(settings)`` builds the app; the composition root (``_services``) opens every
service (HTTP client session, nonce store, decision log, key service, policy, release service,
checkpoint publisher) in dependency order inside a cleanup context, registers each under its own
typed ``AppKey`` (``api/services.py``), and closes them in reverse order on shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from broker.api.kbs import register_kbs
from broker.api.kbs_services import kbs_fact, open_kbs
from broker.api.log import LOG_PEERS
from broker.api.log_peers import LogPeers
from broker.api.middleware import METRICS, request_context
from broker.api.readiness import Readiness
from broker.api.routes import register
from broker.api.self_attestation import (
    SELF_ATTESTATION,
    SelfAttestation,
    open_self_attestation,
)
from broker.api.services import (
    ATTESTATIONS,
    CHECKPOINTS,
    CLOCK,
    DECISIONS,
    KERNEL,
    KEYS,
    NONCES,
    POLICIES,
    POLICY,
    READINESS,
    RELEASE,
    SETTINGS,
    STATEMENTS,
    Attestations,
    Clock,
    NoCheckpoints,
    StatementKey,
)
from broker.attestation.jwks_sources import FileJwksSource, JwksSource, UrlJwksSource
from broker.attestation.nvidia.sources import (
    CachingRimSource,
    HttpOcspSource,
    NoOcsp,
    OcspSource,
)
from broker.attestation.pipeline import IssuerTrust, Trust
from broker.attestation.service import EvidenceVerifier, GpuSources
from broker.attestation.stored import AttestationStore
from broker.audit.identity import adopt_signing_key, claim_origin
from broker.audit.log import DecisionLog
from broker.audit.mask import load_or_create_mask_key
from broker.audit.publisher import CheckpointPublisher
from broker.audit.records import LogCorrupt
from broker.audit.sink import AuditSink
from broker.audit.witness import Witness, WitnessKey
from broker.config import Settings
from broker.console.web import install as install_console
from broker.core.errors import ConfigError, UpstreamError
from broker.core.metrics import Metrics
from broker.core.refs import (
    CloudKmsRef,
    LocalFileRef,
    Pkcs11Ref,
    PostgresRef,
    RedisRef,
    SignerRef,
)
from broker.crypto.jwks import JwksError
from broker.crypto.keyfiles import p256_private_key_file
from broker.decisions.attest import AttestPlan
from broker.decisions.attested_release import AttestedReleasePlan
from broker.decisions.identity import IdentityPlan
from broker.decisions.kernel import Kernel
from broker.decisions.owed import OwedRecordPass
from broker.decisions.policy import PolicyGate
from broker.decisions.redecide import Redecider
from broker.decisions.release import ReleasePlan
from broker.decisions.results import AttestationResults
from broker.keys.factory import open_key_service
from broker.keys.service import KeyService
from broker.policy.engine import PolicyEngine
from broker.policy.freshness import logged_floor
from broker.policy.manager import SYSTEM_WHO, PolicyManager
from broker.policy.workers import WorkerGroup
from broker.signers.checkpoint import close_checkpoint_signer, open_checkpoint_signer
from broker.signers.identity_ca import load_ca
from broker.signers.results import (
    IDENTITY_CA_KEY,
    RESULT_KEY,
    KeyRole,
    LocalResultSigner,
    ResultKeys,
    ResultSigner,
    result_keys,
)
from broker.stores.attestations import open_attestation_store
from broker.stores.nonces import NonceStore
from broker.stores.spent_nonces import open_nonce_store

log = logging.getLogger(__name__)


def utc_now() -> datetime:
    return datetime.now(UTC)


def create_app(
    settings: Settings, *, clock: Clock = utc_now, workers: WorkerGroup | None = None
) -> web.Application:
    """Build the broker application for ``settings``; ``workers``: this process's place among
    the workers of ``broker serve --workers N`` (default: a single process).

    Every service is built in ``_services`` (the composition root), in dependency order, before
    the server accepts a request."""
    app = web.Application(
        middlewares=[request_context], client_max_size=settings.server.max_body_bytes
    )
    app[METRICS] = Metrics()
    app[SETTINGS] = settings
    app[CLOCK] = clock
    group = workers or WorkerGroup.for_log(settings.audit.log, {})
    app.cleanup_ctx.append(functools.partial(_services, group=group))
    register(app, settings.server)
    install_console(app)  # /console (docs/console.md): served while a token holds auditor
    register_kbs(app, settings)  # [kbs] enabled: the KBS protocol facade (docs/kbs.md)
    return app


async def _services(app: web.Application, *, group: WorkerGroup) -> AsyncIterator[None]:
    """The composition root: open each service once its dependencies are open; close them in
    reverse order on shutdown."""
    settings, clock, metrics = app[SETTINGS], app[CLOCK], app[METRICS]
    async with AsyncExitStack() as stack:
        sealed = await _self_attestation(app, settings, clock)  # first: it fails closed
        session = await stack.enter_async_context(aiohttp.ClientSession())
        nonces = open_nonce_store(
            settings.nonces.store_ref,
            ttl=timedelta(seconds=settings.server.nonce_ttl_seconds),
            capacity=settings.server.max_outstanding_nonces,
            timeout=settings.nonces.timeout_seconds,
            key_path=settings.nonces.challenge_key or settings.audit.log.parent / "challenge.key",
        )
        stack.push_async_callback(nonces.close)
        await nonces.open()  # the challenge key: before the first challenge
        audit = await _decision_log(settings, stack)
        sink = None  # listening before anything is logged: the start-up record is streamed too
        if settings.audit.sink is not None:
            sink = AuditSink(settings.audit.sink, session, metrics)
            audit.add_listener(sink.offer)
            stack.callback(sink.close)
        keys = await stack.enter_async_context(
            open_key_service(settings.keys, change_log=audit.append_entry)
        )
        policies = PolicyManager(
            settings.policy,
            metrics,
            clock=clock,
            workers=group,
            state_dir=settings.audit.log.with_name(settings.audit.log.name + ".policy"),
        )
        engine = await policies.open(
            audit.append,
            audit.append_policy_change,
            session=session,
            logged=logged_floor(audit.last_policy_change),  # the floor survives state.json
        )
        stack.push_async_callback(policies.close)
        verifier, gate = await _verifier_and_gate(settings, session, metrics, engine)
        attestations = await _attestations(
            app,
            stack,
            session=session,
            nonces=nonces,
            verifier=verifier,
            policy=gate,
            audit=audit,
            keys=keys,
            now=clock(),
        )
        await _redecided(attestations.service, policies, clock, stack)
        release = ReleasePlan(
            nonces=nonces,
            verifier=verifier,
            keys=keys,
            policy=gate,
            seen=None if attestations.service is None else attestations.service.seen,
        )
        statements = StatementKey(await _statement_signer(settings))
        publisher = await _checkpoints(settings, audit, session, stack, metrics, now=clock())
        facts = {
            "keys": settings.keys.store_ref.kind,  # never credentials in it
            "kek": "local (DEVELOPMENT ONLY)" if keys.kek.development_only else keys.kek.reference,
            "nonces": settings.nonces.store_ref.kind,
            "checkpoints": "signed" if publisher else "off (no signing_key)",
            "attestations": "on" if attestations.service else "off",
            "self_attestation": "on" if sealed else "off (not in a TEE)",
            "kbs": kbs_fact(app),
        }
        app[NONCES] = nonces
        app[DECISIONS] = audit
        app[KEYS] = keys
        app[POLICIES] = policies
        app[POLICY] = engine
        app[KERNEL] = Kernel(audit, metrics)  # runs every decision plan
        app[RELEASE] = release
        app[STATEMENTS] = statements
        app[ATTESTATIONS] = attestations
        await _serve_logs(app, publisher, session)
        app[READINESS] = readiness = Readiness(
            facts=facts,
            policies=policies,
            policy=engine,
            decisions=audit,
            keys=keys,
            nonces=nonces,
            statement_key_set=statements.key is not None,
            clock=clock,
            interval=settings.server.health_interval_seconds,
            attestation_expired=None if sealed is None else sealed.expired,
            metrics=metrics,
            identity_ca_warning=None
            if attestations.identity is None
            else attestations.identity.ca.expiry_warning,
        )
        await readiness.refresh()  # /readyz answers from this until the background task runs
        background = _background(policies, publisher, sink, sealed)
        background.append(asyncio.create_task(readiness.run(), name="readiness"))
        log.info("broker ready: %s", {"policy": engine.digest, **facts})
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            if publisher is not None:
                try:
                    await publisher.publish()  # the last records are covered too
                except (OSError, UpstreamError, LogCorrupt):  # best effort: records are safe
                    log.exception("the final checkpoint could not be signed or written")


async def _serve_logs(
    app: web.Application, publisher: CheckpointPublisher | None, session: aiohttp.ClientSession
) -> None:
    """What the log API serves: this replica's checkpoints, and the way to the other logs (its
    TLS context reads the peers' CA file: in a thread)."""
    app[CHECKPOINTS] = publisher if publisher is not None else NoCheckpoints()
    app[LOG_PEERS] = await asyncio.to_thread(LogPeers, app[SETTINGS], session)


async def _decision_log(settings: Settings, stack: AsyncExitStack) -> DecisionLog:
    """This replica's log, open, under its own origin (``claim_origin``: before any record)."""
    audit = DecisionLog(
        settings.audit.log,
        segment_bytes=settings.audit.segment_bytes,
        replica=settings.server.replica_id,
    )
    await audit.open()
    stack.push_async_callback(audit.close)
    await asyncio.to_thread(
        claim_origin,
        settings.audit.log,
        origin=settings.audit.origin,
        replica=settings.server.replica_id,
    )
    return audit


async def _redecided(
    service: AttestationResults | None, policies: PolicyManager, clock: Clock, stack: AsyncExitStack
) -> None:
    """Attestation results re-decided now (start-up: the policy may be another than the one
    they were decided under), after each policy change, and again until a failed run succeeds
    (``decisions/redecide.py``); apart from that, revocation records owed written by this
    process's periodic pass (``decisions/owed.py``)."""
    if service is None:
        return
    owed = OwedRecordPass(service.write_owed, clock)
    service.on_owed(owed.wake)
    owed.start()
    stack.push_async_callback(owed.close)
    redecider = Redecider(service.revalidate, clock)
    stack.push_async_callback(redecider.close)
    policies.on_change(lambda who: redecider.now(who, "policy_change"))
    await redecider.now(SYSTEM_WHO, "startup")


async def _checkpoints(
    settings: Settings,
    audit: DecisionLog,
    session: aiohttp.ClientSession,
    stack: AsyncExitStack,
    metrics: Metrics,
    *,
    now: datetime,
) -> CheckpointPublisher | None:
    """The checkpoint publisher (none without ``[audit] signing_key``), having published once,
    under the log's key (a rotation from ``previous_signing_key`` is handed over first)."""
    signer = await open_checkpoint_signer(settings)
    if signer is None:
        return None
    stack.push_async_callback(close_checkpoint_signer, signer)
    previous = await open_checkpoint_signer(settings, previous=True)
    try:
        await adopt_signing_key(audit, signer, previous, now=now.isoformat())
    finally:
        await close_checkpoint_signer(previous)
    witnesses = [
        Witness(url, WitnessKey.parse(key))
        for url, key in zip(settings.audit.witnesses, settings.audit.witness_keys, strict=True)
    ]
    publisher = CheckpointPublisher(
        audit,
        signer,
        interval=settings.audit.checkpoint_seconds,
        witnesses=witnesses,
        session=session,
        metrics=metrics,
    )
    stack.callback(publisher.close)
    await publisher.publish()
    return publisher


async def _evidence_verifier(
    settings: Settings, session: aiohttp.ClientSession, metrics: Metrics
) -> EvidenceVerifier:
    """Trust from configuration; key sets, RIMs and OCSP answers fetched per request (each
    request sent counted in ``broker_outbound_requests_total``)."""
    issuers: dict[str, IssuerTrust] = {}
    sources: dict[str, JwksSource] = {}
    for index, entry in enumerate(settings.issuers):
        if entry.jwks_file is not None:
            try:
                sources[entry.issuer] = await FileJwksSource.load(entry.jwks_file)
            except JwksError as exc:
                raise ConfigError(f"issuers[{index}].jwks_file", str(exc)) from exc
        elif entry.jwks_url is not None:
            sources[entry.issuer] = UrlJwksSource(
                entry.jwks_url,
                session,
                cache_seconds=entry.jwks_cache_seconds,
                refresh_min_seconds=entry.jwks_refresh_min_seconds,
                on_request=metrics.outbound_counter("jwks"),
            )
        roots = await _certificates(f"issuers[{index}].root_cert", entry.root_cert)
        issuers[entry.issuer] = IssuerTrust(settings=entry, roots=roots)
    nvidia = settings.nvidia
    trust = Trust(
        issuers=issuers,
        audience=settings.server.audience,
        leeway=timedelta(seconds=settings.server.clock_leeway_seconds),
        device_roots=await _certificates("nvidia.device_root", nvidia.device_root),
        rim_roots=await _certificates("nvidia.rim_root", nvidia.rim_root),
        local_gpu=nvidia.enabled,
    )
    gpu = _gpu_sources(settings, session, metrics)
    return EvidenceVerifier(trust, key_sources=sources, gpu=gpu)


def _gpu_sources(
    settings: Settings, session: aiohttp.ClientSession, metrics: Metrics
) -> GpuSources | None:
    nvidia = settings.nvidia
    if not nvidia.enabled:
        return None
    rims = CachingRimSource(
        directory=nvidia.rim_dir,
        url=nvidia.rim_url,
        session=session,
        cache_seconds=nvidia.rim_cache_seconds,
        timeout_seconds=nvidia.upstream_timeout_seconds,
        on_request=metrics.outbound_counter("rim"),
    )
    ocsp: OcspSource = (
        HttpOcspSource(
            nvidia.ocsp_url,
            session,
            timeout_seconds=nvidia.upstream_timeout_seconds,
            cache_seconds=nvidia.ocsp_cache_seconds,
            on_request=metrics.outbound_counter("ocsp"),
        )
        if nvidia.ocsp_url
        else NoOcsp()
    )
    return GpuSources(rims=rims, ocsp=ocsp)


async def _self_attestation(
    app: web.Application, settings: Settings, clock: Clock
) -> SelfAttestation | None:
    """``[sealed]``: the broker's own attestation token, published by the app.

    Raises:
        ConfigError: sealed, and the launcher does not answer (the broker does not start).
    """
    sealed = await open_self_attestation(settings, clock)
    if sealed is not None:
        app[SELF_ATTESTATION] = sealed
    return sealed


def _background(
    policies: PolicyManager,
    publisher: CheckpointPublisher | None,
    sink: AuditSink | None,
    sealed: SelfAttestation | None,
) -> list[asyncio.Task[None]]:
    """The service's own tasks: policy reloads, checkpoints, the audit stream, renewals of the
    broker's attestation."""
    background = [asyncio.create_task(policies.watch(), name="policy-watch")]
    if sealed is not None:
        background.append(asyncio.create_task(sealed.run(), name="self-attestation"))
    if publisher is not None:
        background.append(asyncio.create_task(publisher.run(), name="checkpoints"))
    if sink is not None:
        background.append(asyncio.create_task(sink.run(), name="audit-sink"))
    return background


async def _result_signer(
    settings: Settings, key: SignerRef, stack: AsyncExitStack, role: KeyRole = RESULT_KEY
) -> ResultSigner:
    """``[attest] signing_key`` (or ``[identity] ca_key``, ``role``): a Cloud KMS key version, a
    PKCS#11 key pair, or a PEM file (development)."""
    if isinstance(key, Pkcs11Ref):
        # python-pkcs11 loads only where an HSM result key is configured.
        from broker.signers.results_pkcs11 import Pkcs11ResultSigner, parse_result_key  # noqa: PLC0415

        hsm = Pkcs11ResultSigner(await asyncio.to_thread(parse_result_key, key.uri, role), role)
        await hsm.open()
        stack.push_async_callback(hsm.close)
        return hsm
    if isinstance(key, CloudKmsRef):
        # The KMS client loads only where a KMS result key is configured (start-up time).
        from broker.signers.results_kms import KmsResultSigner  # noqa: PLC0415

        signer = KmsResultSigner(
            key.uri,
            endpoint=settings.keys.kms_endpoint,
            timeout_seconds=settings.keys.upstream_timeout_seconds,
            credentials_file=settings.keys.kms_credentials,
            role=role,
        )
        await signer.open()
        stack.push_async_callback(signer.close)
        return signer
    return await asyncio.to_thread(LocalResultSigner.from_pem, key.path)


async def _verifier_and_gate(
    settings: Settings, session: aiohttp.ClientSession, metrics: Metrics, engine: PolicyEngine
) -> tuple[EvidenceVerifier, PolicyGate]:
    """The evidence verifier, and the policy as every plan asks it (with the key that masks
    record fields): releases and attestations share both."""
    mask_key = await asyncio.to_thread(load_or_create_mask_key, _mask_key_path(settings))
    gate = PolicyGate(engine, mask=settings.audit.mask, mask_key=mask_key)
    return await _evidence_verifier(settings, session, metrics), gate


async def _attestations(
    app: web.Application,
    stack: AsyncExitStack,
    *,
    session: aiohttp.ClientSession,
    nonces: NonceStore,
    verifier: EvidenceVerifier,
    policy: PolicyGate,
    audit: DecisionLog,
    keys: KeyService,
    now: datetime,
) -> Attestations:
    """``POST /v1/attest`` with its result-signing key, and releases on results, when
    ``[attest] enabled``; the KBS facade on them when ``[kbs] enabled`` too (``app[KBS]``)."""
    settings = app[SETTINGS]
    ref = settings.attest.signing_ref
    if not settings.attest.enabled:
        return Attestations(None)
    if ref is None:
        raise ConfigError("attest.signing_key", "attest needs a result-signing key")
    signer = await _result_signer(settings, ref, stack)
    store = open_attestation_store(
        settings.nonces.store_ref, timeout=settings.nonces.timeout_seconds
    )
    stack.push_async_callback(store.close)
    verifying = await asyncio.to_thread(
        result_keys, signer, [Path(k) for k in settings.attest.previous_keys]
    )
    results = AttestationResults(store=store, audit=audit, policy=policy.engine)
    attest = AttestPlan(
        settings=settings.attest,
        issuer=settings.server.audience,
        nonces=nonces,
        verifier=verifier,
        policy=policy,
        signer=signer,
        store=store,
        seen=results.seen,
    )
    releases = AttestedReleasePlan(
        issuer=settings.server.audience,
        result_keys=lambda: verifying.verifying,
        store=store,
        nonces=nonces,
        keys=keys,
        policy=policy,
        require_nonce=settings.attest.dpop_nonce,
        public_urls=settings.server.public_base_urls,
        timed=settings.server.server_timing,
        networked_store=isinstance(settings.nonces.store_ref, RedisRef | PostgresRef),
    )
    identity = await _identity_plan(
        settings, stack, store=store, nonces=nonces, policy=policy, verifying=verifying, now=now
    )
    if identity is not None:  # a rotation (or the first start with [identity]) is logged
        await audit.append_if_changed(
            identity.ca.change_record(time=now.isoformat(), trigger="start-up")
        )
    attestations = Attestations(results, attest, releases, verifying, identity)
    await open_kbs(
        app,
        stack,
        session=session,
        nonces=nonces,
        attestations=attestations,
        keys=keys,
        policy=policy,
    )
    return attestations


async def _identity_plan(
    settings: Settings,
    stack: AsyncExitStack,
    *,
    store: AttestationStore,
    nonces: NonceStore,
    policy: PolicyGate,
    verifying: ResultKeys,
    now: datetime,
) -> IdentityPlan | None:
    """``POST /v1/identity`` and the bundle when ``[identity] enabled`` (its CA key: a PEM file,
    Cloud KMS or PKCS#11, as the result key)."""
    identity = settings.identity
    if not identity.enabled or identity.ca_key_ref is None or identity.ca_certificates is None:
        return None
    ref = identity.ca_key_ref
    signer: ResultSigner
    if isinstance(ref, LocalFileRef):
        key = await asyncio.to_thread(p256_private_key_file, ref.path, "identity.ca_key")
        signer = LocalResultSigner(key)
    else:
        signer = await _result_signer(settings, ref, stack, IDENTITY_CA_KEY)
    ca = await asyncio.to_thread(
        load_ca,
        trust_domain=identity.trust_domain,
        signer=signer,
        chain_file=Path(identity.ca_certificates),
        previous_files=[Path(p) for p in identity.previous_ca_certificates],
        max_lifetime=timedelta(seconds=identity.max_lifetime_seconds),
        now=now,
    )
    return IdentityPlan(
        issuer=settings.server.audience,
        result_keys=lambda: verifying.verifying,
        store=store,
        nonces=nonces,
        ca=ca,
        policy=policy,
        require_nonce=settings.attest.dpop_nonce,
        public_urls=settings.server.public_base_urls,
        networked_store=isinstance(settings.nonces.store_ref, RedisRef | PostgresRef),
    )


async def _statement_signer(settings: Settings) -> ec.EllipticCurvePrivateKey | None:
    """The EC P-256 key that signs query-key statements (``[keys] signing_key``)."""
    path = settings.keys.signing_key
    if path is None:
        return None
    return await asyncio.to_thread(p256_private_key_file, path, "keys.signing_key")


async def _certificates(key: str, path: Path | None) -> list[x509.Certificate]:
    """Pinned anchors from a PEM file (configuration and certs/ only)."""
    if path is None:
        return []
    try:
        return x509.load_pem_x509_certificates(await asyncio.to_thread(path.read_bytes))
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"not a readable PEM certificate file: {path}") from exc


def server_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS context for ``serve``; ``None`` only when plain HTTP was explicitly allowed."""
    server = settings.server
    if server.insecure_http:
        log.warning(
            "INSECURE: serving plain HTTP on %s (allowed only on loopback); "
            "do not use this outside development",
            server.listen,
        )
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if server.tls_cert is None or server.tls_key is None:
        raise ConfigError("server.tls_cert", "TLS needs tls_cert and tls_key")
    context.load_cert_chain(server.tls_cert, server.tls_key)
    return context


def _mask_key_path(settings: Settings) -> Path:
    """``[audit] mask_key`` (``load_settings`` defaults it beside the log)."""
    return settings.audit.mask_key or settings.audit.log.parent / "mask.key"
