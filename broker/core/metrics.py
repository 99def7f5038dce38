"""Prometheus metrics, one registry per app (so several apps can live in one test process).

With ``broker serve --workers N`` the supervisor points every worker at one directory
(``PROMETHEUS_MULTIPROC_DIR``, prometheus-client's multiprocess mode): each worker writes its
values there and any worker's ``/metrics`` answers with the sum over all of them, so one scrape
sees the whole broker and counters never go down between scrapes. Gauges aggregate as
documented per gauge (``multiprocess_mode``): ``broker_policy_info`` is 1 for each digest some
live worker serves (two digests show during a reload), the reload timestamp is the latest of
any live worker. Without the variable (one process) nothing changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

OUTBOUND_KINDS = ("jwks", "rim", "ocsp")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "broker_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "broker_http_request_seconds",
            "HTTP request latency by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "broker_release_decisions",
            "Release decisions by outcome (allow, deny, error) and code",
            ["outcome", "code"],
            registry=self.registry,
        )
        self.release_latency = Histogram(
            "broker_release_seconds",
            "Time from a parsed release request to its logged decision",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.attest_decisions = Counter(
            "broker_attest_decisions",
            "Attestation decisions (POST /v1/attest) by outcome (allow, deny, error) and code",
            ["outcome", "code"],
            registry=self.registry,
        )
        self.attest_latency = Histogram(
            "broker_attest_seconds",
            "Time from a parsed attestation request to its logged decision",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.policy = Gauge(
            "broker_policy_info",
            "The policy in force (1 for each digest a live worker serves)",
            ["digest"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.policy_reloads = Counter(
            "broker_policy_reloads",
            "Policy reload attempts by result (ok, failed)",
            ["result"],
            registry=self.registry,
        )
        self.policy_last_reload = Gauge(
            "broker_policy_last_reload_timestamp_seconds",
            "When the last policy reload attempt finished (the latest of any live worker)",
            ["result"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.policy_source_up = Gauge(
            "broker_policy_source_up",
            "1 while the bundle server answers with the bundle in force; 0 while it fails, serves "
            "a refused bundle, or the broker serves its cached copy (the lowest of any worker; "
            "1 without a bundle server)",
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.policy_source_up.set(1)
        self.policy_source_failures = Counter(
            "broker_policy_source_failures",
            "Fetches from the bundle server that failed (no answer, HTTP error, too large)",
            registry=self.registry,
        )
        self.policy_floor_saved = Gauge(
            "broker_policy_floor_saved",
            "0 while the policy version floor cannot be saved beside the log (the reload that "
            "needed it was refused; the last good policy keeps serving), else 1 (the lowest of "
            "any worker)",
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.policy_floor_saved.set(1)
        self.policy_bundle_version = Gauge(
            "broker_policy_bundle_version",
            "policy_version of the signed bundle in force (the highest of any live worker)",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self._digest: str | None = None

        self.sink_sent = Counter(
            "broker_audit_sink_sent", "Records delivered to the audit sink", registry=self.registry
        )
        self.sink_dropped = Counter(
            "broker_audit_sink_dropped",
            "Records the audit sink did not deliver (the local log still has them)",
            registry=self.registry,
        )
        self.log_writer_up = Gauge(
            "broker_audit_log_writer_up",
            "1 while the decision log takes records; 0 once a write failed and the process "
            "refuses every release until restarted (as of the last readiness round; the lowest "
            "of any worker)",
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.log_writer_up.set(1)
        self.log_records = Gauge(
            "broker_audit_log_records",
            "Records in this replica's decision log, durable and in the tree (as of the last "
            "readiness round; the highest of any worker)",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.checkpoint_size = Gauge(
            "broker_audit_checkpoint_size",
            "Tree size of this replica's newest signed checkpoint (the highest of any worker)",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.checkpoint_time = Gauge(
            "broker_audit_checkpoint_timestamp_seconds",
            "When this replica's newest signed checkpoint was written (Unix time; its age is "
            "time() minus this)",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.checkpoint_failures = Counter(
            "broker_audit_checkpoint_failures",
            "Checkpoints that could not be signed or written (signer, files, a log that no "
            "longer has the last checkpoint's root)",
            registry=self.registry,
        )
        self.store_up = Gauge(
            "broker_store_up",
            "1 while the store answered the last readiness round, by store (nonce, key); 0 "
            "while it does not (the lowest of any worker)",
            ["store"],
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.outbound = Counter(
            "broker_outbound_requests",
            "Requests the evidence verifier sent to upstreams, by kind (jwks, rim, ocsp)",
            ["kind"],
            registry=self.registry,
        )
        for kind in OUTBOUND_KINDS:  # exported at 0 before the first request of a kind
            self.outbound.labels(kind)

    def policy_info(self, digest: str) -> None:
        if self._digest is not None and self._digest != digest:
            # 0, not removed: in multiprocess mode the value lives in this worker's file
            self.policy.labels(self._digest).set(0)
        self._digest = digest
        self.policy.labels(digest).set(1)

    def policy_reloaded(self, ok: bool, digest: str) -> None:
        result = "ok" if ok else "failed"
        self.policy_reloads.labels(result).inc()
        self.policy_last_reload.labels(result).set(time.time())
        self.policy_info(digest)

    def policy_source(self, *, up: bool) -> None:
        self.policy_source_up.set(1 if up else 0)

    def policy_source_failed(self) -> None:
        self.policy_source_failures.inc()
        self.policy_source_up.set(0)

    def checkpoint_published(self, size: int, written_at: float | None) -> None:
        """The newest checkpoint after a publish: its tree size, when its file was written."""
        self.checkpoint_size.set(size)
        if written_at is not None:
            self.checkpoint_time.set(written_at)

    def health_round(
        self, *, nonce_store: bool, key_store: bool, log_records: int, log_writing: bool
    ) -> None:
        """What one readiness round found (``api/readiness.py``)."""
        self.store_up.labels("nonce").set(1 if nonce_store else 0)
        self.store_up.labels("key").set(1 if key_store else 0)
        self.log_records.set(log_records)
        self.log_writer_up.set(1 if log_writing else 0)

    def outbound_counter(self, kind: str) -> Callable[[], None]:
        """What an upstream adapter calls for each request it sends (``kind``: jwks, rim,
        ocsp)."""
        return self.outbound.labels(kind).inc

    def value(self, name: str) -> float:
        """A sample's value (``broker_audit_sink_dropped_total``): this registry's, or with
        workers the sum over every worker's files (then blocking: a thread). 0 if none."""
        directory = os.environ.get(MULTIPROCESS_ENV)
        registry = self.registry
        if directory:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        return registry.get_sample_value(name) or 0.0

    def render(self) -> bytes:
        """The exposition: this registry, or with workers the sum over every worker's files."""
        directory = os.environ.get(MULTIPROCESS_ENV)
        if not directory:
            return generate_latest(self.registry)
        combined = CollectorRegistry()
        MultiProcessCollector(combined, path=directory)  # type: ignore[no-untyped-call]
        return generate_latest(combined)
