"""The KBS facade composed (``app.py`` calls ``open_kbs`` once attestation results are open):
its three plans over the broker's own services — the nonce store's challenges, the attestation
results' signer and store, the key service, the policy — a session store beside them, and the
registry of raw evidence verifiers by KBS ``tee`` name.

**The registry** is built from configuration by ``RAW_VERIFIERS``: each factory returns its
verifier when its configuration asks for one, else ``None``; every ``tee_names`` entry of a
verifier maps to it, and two verifiers claiming one name is a configuration error: ``tdx`` when
``[tdx]`` names a collateral source (``attestation/raw/tdx_sources.py``), ``snp`` always (its
roots ship; ``attestation/raw/snp_certs.py``), ``sample`` only with ``[kbs]
allow_sample_evidence`` (a loopback broker's development switch).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import timedelta

import aiohttp
from aiohttp import web

from broker.api.kbs import KBS, KbsFacade
from broker.api.middleware import METRICS
from broker.api.services import SETTINGS, Attestations
from broker.attestation.raw import RawVerifier
from broker.attestation.raw.sample import SampleVerifier
from broker.attestation.raw.snp_certs import build_snp_verifier
from broker.attestation.raw.tdx_sources import open_tdx_verifier
from broker.config import Settings
from broker.core.errors import ConfigError
from broker.core.metrics import Metrics
from broker.core.secrets_files import load_or_create_secret
from broker.decisions.kbs_attest import KbsAttestPlan
from broker.decisions.kbs_auth import KbsAuthPlan
from broker.decisions.kbs_resource import KbsResourcePlan
from broker.decisions.kbs_session import SessionCodec
from broker.decisions.policy import PolicyGate
from broker.keys.service import KeyService
from broker.stores.kbs_sessions import open_kbs_session_store
from broker.stores.nonces import NonceStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawContext:
    """What a verifier factory may use: the configuration, the broker's one HTTP client
    session (collateral, certificates), the exit stack (a resource to close), the metrics."""

    settings: Settings
    session: aiohttp.ClientSession
    stack: AsyncExitStack
    metrics: Metrics


RawFactory = Callable[[RawContext], Awaitable[RawVerifier | None]]


async def _sample(context: RawContext) -> RawVerifier | None:
    """``sample``: only with the development switch (refused off loopback by the config)."""
    if not context.settings.kbs.allow_sample_evidence:
        return None
    log.warning(
        "DEVELOPMENT: [kbs] allow_sample_evidence is on: unsigned sample evidence is accepted"
    )
    return SampleVerifier()


async def _tdx(context: RawContext) -> RawVerifier | None:
    """``tdx``: when ``[tdx]`` names a collateral source (files or a PCS/PCCS)."""
    tdx = context.settings.tdx
    if not tdx.enabled:
        return None
    return await open_tdx_verifier(
        tdx, context.session, on_request=context.metrics.outbound_counter("tdx_collateral")
    )


async def _snp(context: RawContext) -> RawVerifier | None:
    """``snp``: always with the facade (the pinned AMD roots ship in ``certs/``; the VCEK or
    VLEK comes from the guest, ``[snp] certs_dir`` or AMD's KDS when ``kds_url`` is set).

    Raises:
        ConfigError: ``snp.roots`` or ``snp.certs_dir`` unusable.
    """
    snp = context.settings.snp
    try:
        return await build_snp_verifier(
            roots=snp.roots,
            certs_dir=snp.certs_dir,
            kds_url=snp.kds_url,
            session=context.session,
            timeout_seconds=snp.kds_timeout_seconds,
            max_vmpl=snp.max_vmpl,
            on_request=context.metrics.outbound_counter("snp_kds"),
        )
    except (OSError, ValueError) as exc:
        raise ConfigError("snp", f"the SEV-SNP roots or certificates are unusable: {exc}") from exc


RAW_VERIFIERS: tuple[RawFactory, ...] = (_sample, _tdx, _snp)


async def raw_verifiers(context: RawContext) -> dict[str, RawVerifier]:
    """KBS ``tee`` name → the verifier configured for it (see the module's docstring).

    Raises:
        ConfigError: two verifiers for one name; a verifier's own configuration unusable.
    """
    registry: dict[str, RawVerifier] = {}
    for factory in RAW_VERIFIERS:
        made = await factory(context)
        if made is None:  # not configured
            continue
        for name in made.tee_names:
            if name in registry:
                raise ConfigError("kbs", f"two raw evidence verifiers for tee {name!r}")
            registry[name] = made
    return registry


def kbs_fact(app: web.Application) -> str:
    """What ``/readyz`` says of the facade (sample evidence accepted: said so)."""
    facade = app.get(KBS)
    return "off" if facade is None else "on" + facade.development_note


async def open_kbs(
    app: web.Application,
    stack: AsyncExitStack,
    *,
    session: aiohttp.ClientSession,
    nonces: NonceStore,
    attestations: Attestations,
    keys: KeyService,
    policy: PolicyGate,
) -> KbsFacade | None:
    """The facade when ``[kbs] enabled`` (``[attest] enabled`` too: the config requires it),
    set under ``api.kbs.KBS``."""
    settings = app[SETTINGS]
    kbs = settings.kbs
    attest, published = attestations.attest, attestations.result_keys
    if not kbs.enabled or attest is None or published is None:
        return None
    key_path = settings.nonces.challenge_key or settings.audit.log.parent / "challenge.key"
    challenge_key = await asyncio.to_thread(load_or_create_secret, key_path, "nonces.challenge_key")
    codec = SessionCodec(challenge_key, timedelta(seconds=kbs.session_ttl_seconds))
    sessions = open_kbs_session_store(
        settings.nonces.store_ref,
        timeout=settings.nonces.timeout_seconds,
        capacity=settings.server.max_outstanding_nonces,
    )
    stack.push_async_callback(sessions.close)
    verifiers = await raw_verifiers(RawContext(settings, session, stack, app[METRICS]))
    issuer = settings.server.audience
    app[KBS] = facade = KbsFacade(
        auth=KbsAuthPlan(codec=codec, nonces=nonces, verifiers=verifiers),
        attest=KbsAttestPlan(
            codec=codec,
            nonces=nonces,
            verifiers=verifiers,
            policy=policy,
            signer=attest.signer,
            store=attest.store,
            sessions=sessions,
            issuer=issuer,
            token_ttl=timedelta(seconds=kbs.token_ttl_seconds),
        ),
        resource=KbsResourcePlan(
            codec=codec,
            sessions=sessions,
            issuer=issuer,
            result_keys=lambda: published.verifying,
            store=attest.store,
            keys=keys,
            policy=policy,
            resources={path: (name, version) for path, name, version in kbs.resources},
        ),
        deny_status=kbs.deny_status,
        secure_cookie=not settings.server.insecure_http,
    )
    return facade
