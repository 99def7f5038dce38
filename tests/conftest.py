"""Suite-wide hooks."""

from __future__ import annotations

import pytest

# Modules whose tests run longest (several broker processes, time-boxed fuzzing, floods). They
# are collected first so that under ``pytest -n`` (``make test``) they start while the many
# short tests fill the other workers, instead of starting last and setting the wall time.
SLOW_FIRST = (
    "test_schemathesis.py",
    "test_hostile_inputs.py",
    "test_challenge_flood.py",
    "test_workers.py",
    "test_workers_log_view.py",
    "test_workers_policy.py",
    "test_bundle_differential.py",
    "test_bundle_server.py",
    "test_shared_nonces.py",
    "test_postgres_keys.py",
    "test_kubernetes_policy_volume.py",
    "test_rewrap.py",
    "test_policy_differential.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: each module keeps its own order
