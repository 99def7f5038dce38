"""Issue 32: rotating the workload-certificate CA is logged. Each start with ``[identity]`` on
appends an ``identity_ca`` record naming the CA in force (its chain and retired authorities by
SHA-256, ``ca_digest`` over them) only when the log's newest one names another: the first
start is one record, a rotation one more naming the old digest, a restart with the same CA none,
whether one process or ``--workers 2`` starts (``DecisionLog.append_if_changed``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from broker.dev.identity_ca import make_dev_identity_ca
from tests.integration.conftest import RunningBroker
from tests.integration.identity import TRUST_DOMAIN, identity_broker


def _ca_records(broker: RunningBroker) -> list[dict[str, Any]]:
    lines = broker.settings.audit.log.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "identity_ca"]


def _fingerprints(chain: Path) -> list[str]:
    return [
        hashlib.sha256(c.public_bytes(Encoding.DER)).hexdigest()
        for c in x509.load_pem_x509_certificates(chain.read_bytes())
    ]


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_the_first_start_is_one_record(start_broker: Callable[..., Any]) -> None:
    broker: RunningBroker = await identity_broker(start_broker)
    (started,) = _ca_records(broker)  # one record, whatever the number of workers
    assert started["old_ca_digest"] is None


async def test_a_rotation_of_the_identity_ca_is_one_record(
    start_broker: Callable[..., Any],
) -> None:
    """A restart with the same CA writes nothing; one with a new CA, one record (a second
    supervisor cannot serve the same log while the first runs: brokers in this process)."""
    first: RunningBroker = await identity_broker(start_broker)
    (started,) = _ca_records(first)
    chain = first.workdir / "identity" / "ca-chain.pem"
    assert started["old_ca_digest"] is None
    assert started["trust_domain"] == TRUST_DOMAIN
    assert [c["sha256"] for c in started["chain"]] == _fingerprints(chain)
    assert started["previous"] == []
    assert started["trigger"] == "start-up"

    config = first.workdir / "broker.toml"
    same: RunningBroker = await start_broker(reuse=(config, first.issuer))
    assert _ca_records(same) == [started]  # the same CA again: nothing to log

    def rotate(workdir: Path) -> None:  # a new intermediate (and root) at the same paths
        make_dev_identity_ca(workdir / "identity", TRUST_DOMAIN, now=datetime.now(UTC))

    rotated: RunningBroker = await start_broker(reuse=(config, first.issuer), workdir_setup=rotate)
    before, after = _ca_records(rotated)
    assert before == started
    assert after["old_ca_digest"] == started["ca_digest"] != after["ca_digest"]
    assert [c["sha256"] for c in after["chain"]] == _fingerprints(chain)
    assert after["key_thumbprint"] != started["key_thumbprint"]  # a new CA key
