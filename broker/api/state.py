"""The state handlers share, under one typed app key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec

from broker.audit.publisher import CheckpointPublisher
from broker.config import Settings
from broker.nonces import NonceStore
from broker.policy.manager import PolicyManager
from broker.policy.workers import WorkerGroup
from broker.release import ReleaseService

Clock = Callable[[], datetime]


@dataclass
class BrokerState:
    """The objects handlers use; ``release`` is set once every resource has opened."""

    settings: Settings
    clock: Clock
    nonces: NonceStore
    release: ReleaseService | None = None
    checks: dict[str, str] = field(default_factory=dict)
    statement_signer: ec.EllipticCurvePrivateKey | None = None
    policies: PolicyManager | None = None
    checkpoints: CheckpointPublisher | None = None
    workers: WorkerGroup | None = None  # the workers that serve one policy together

    @property
    def ready(self) -> bool:
        return self.release is not None


STATE: web.AppKey[BrokerState] = web.AppKey("state", BrokerState)
