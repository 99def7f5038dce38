"""The operators' dashboard and alerting rules in deploy/ (issue 34) against the metrics the
broker really exports: a live broker (one process, and ``--workers 2`` as deployed) is driven
through releases allowed, refused and failed (a policy error), an attestation and a refused
policy reload, ``/metrics`` is scraped, and every metric name in the Grafana dashboard's
expressions and in the alert rules must be among its samples, each label a selector matches on
among that metric's labels, and each value it matches exactly (``label="value"``) among that
label's values. The rules file is checked by ``promtool check rules`` and its alerts by
``promtool test rules`` (deploy/prometheus/alerts_test.yml: each alert fires on the series that
should fire it, not on a healthy broker); the dashboard's structure is checked here."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from broker.audit.publisher import CheckpointPublisher, checkpoint_paths
from broker.client import BrokerClientError
from broker.core.errors import UpstreamError
from tests.integration.attested import DENIED_KEY, admin_post, attest_broker
from tests.integration.conftest import RunningBroker
from tests.integration.decision_flows import log_down
from tests.integration.watch import covered
from tests.support.constants import KEY

DEPLOY = Path(__file__).parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "broker-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
PROMTOOL = "/usr/bin/promtool"  # Debian's prometheus package (make test installs it)
# What the issue asks the dashboard and the alerts to show: decisions by result, latency, log
# write failures, sink drops, nonce-store and bundle-source health, checkpoint age.
REQUIRED = {
    "broker_release_decisions_total",
    "broker_release_seconds_bucket",
    "broker_audit_log_writer_up",
    "broker_audit_sink_dropped_total",
    "broker_store_up",
    "broker_policy_source_up",
    "broker_audit_checkpoint_timestamp_seconds",
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "inf", "nan"}
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
TARGET_LABELS = {"instance", "job"}  # Prometheus adds them when it scrapes: not in /metrics
Scraped = dict[str, list[dict[str, str]]]  # sample name -> each sample's labels


def promql_names(expr: str) -> set[str]:
    """The metric names an expression reads: what is left once strings, label matchers, range
    and subquery brackets, grouping clauses, Grafana variables, numbers and keywords are taken
    out, and not called (a name followed by ``(`` is a function)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    text = re.sub(r"(?<![A-Za-z0-9_:])[0-9][0-9.eE+-]*[a-z]*", " ", text)  # numbers, durations
    names = set()
    for match in NAME.finditer(text):
        if text[match.end() :].lstrip().startswith("("):
            continue
        if match.group().lower() not in KEYWORDS:
            names.add(match.group())
    return names


def test_the_tokenizer_finds_metric_names_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (instance, le) (rate(a_seconds_bucket{x="b(c)", '
        'y=~"$instance"}[$__rate_interval]))) > 2.5 and on(instance) b_total offset 5m '
        "/ ignoring(code) group_left c:rule - time() unless d{} or e[5m:1m] > bool 1e3"
    )
    assert promql_names(expr) == {"a_seconds_bucket", "b_total", "c:rule", "d", "e"}


def label_matchers(expr: str) -> Iterator[tuple[str, str, str, str]]:
    """``(metric, label, operator, value)`` of each label matcher of each selector."""
    for selector in SELECTOR.finditer(expr):
        for matcher in MATCHER.finditer(selector.group(2)):
            label, operator, value = matcher.groups()
            yield selector.group(1), label, operator, value


def unmatched(expressions: list[str], scraped: Scraped) -> list[str]:
    """The matchers that can match no exported series: a label the metric does not have, or
    (``=``) a value no sample of it has. Regular expressions and ``!=`` are checked for the
    label only; the labels Prometheus adds (``instance``, ``job``) are left out."""
    problems = []
    for expr in expressions:
        for metric, label, operator, value in label_matchers(expr):
            if label in TARGET_LABELS:
                continue
            labels = scraped.get(metric, [])
            if not any(label in sample for sample in labels):
                problems.append(f"{metric} has no label {label!r}: {expr}")
            elif operator == "=" and not any(sample.get(label) == value for sample in labels):
                problems.append(f'{metric}{{{label}="{value}"}} is not exported: {expr}')
    return problems


def test_the_matchers_are_found_and_checked() -> None:
    expr = 'sum(rate(a_total{instance=~"$instance", outcome!="allow"}[5m])) / b{store = "nonce"}'
    assert list(label_matchers(expr + " + c{}")) == [
        ("a_total", "instance", "=~", "$instance"),
        ("a_total", "outcome", "!=", "allow"),
        ("b", "store", "=", "nonce"),
    ]
    scraped = {"b": [{"store": "key"}, {"store": "nonce"}], "a_total": [{"outcome": "deny"}]}
    assert unmatched(['b{store="nonce"}', 'a_total{outcome!="x"}'], scraped) == []
    assert unmatched(['b{store="nonse"}', 'a_total{result="deny"}'], scraped) == [
        'b{store="nonse"} is not exported: b{store="nonse"}',
        "a_total has no label 'result': a_total{result=\"deny\"}",
    ]


def dashboard_expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panels' targets (rows' too), annotations, and
    the metric of each ``label_values(metric, label)`` variable."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        yield from (target["expr"] for target in panel.get("targets", []))
    yield from (a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
            assert match, f"variable {variable['name']}: {query}"
            yield match.group(1)


def alert_rules(alerts: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for group in alerts["groups"]:
        yield from group["rules"]


def test_the_dashboard_and_the_rules_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert (dashboard["uid"], dashboard["schemaVersion"]) == ("sealed-broker", 39)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)) > 0, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert 'instance=~"$instance"' in target["expr"], target["expr"]

    alerts = yaml.safe_load(ALERTS.read_text())
    names = [rule["alert"] for rule in alert_rules(alerts)]
    assert len(names) == len(set(names))
    for rule in alert_rules(alerts):
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"]
    tested = {
        case["alertname"]
        for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    }
    assert {"BrokerDecisionLogRefusing", "BrokerCheckpointStale", "BrokerNonceStoreDown"} <= tested
    assert {"BrokerAuditSinkDropping", "BrokerAbsent", "BrokerDenyRatioHigh"} <= tested


def test_promtool_checks_the_rules_and_each_tested_alert_fires_as_expected() -> None:
    checked = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(list(alert_rules(yaml.safe_load(ALERTS.read_text()))))} rules found" in (
        checked.stdout
    )
    tested = subprocess.run(
        [PROMTOOL, "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


FAILING_IMAGE = "sha256:" + "e" * 64
# A per-key policy that stops with a run-time error (two values of one complete rule) for one
# image only: a release decided "error", as a broken policy or a store outage would make one.
FAILING_POLICY = f"""package broker.key_policies.monitoring_test

import rego.v1

applies_to := [{json.dumps(KEY)}]

level := 1 if input.tee.workload.image_digest == "{FAILING_IMAGE}"
level := 2 if input.tee.workload.image_digest == "{FAILING_IMAGE}"

deny contains "never" if level == 3
"""


def with_failing_image(workdir: Path) -> None:
    (workdir / "policies" / "broker" / "failing_image.rego").write_text(FAILING_POLICY)


async def scrape(broker: RunningBroker) -> Scraped:
    """The samples ``/metrics`` exports now: each name, with each of its samples' labels."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + "/metrics", ssl=broker.client_tls) as response,
    ):
        assert response.status == 200
        text = await response.text()
    scraped: Scraped = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            scraped.setdefault(sample.name, []).append(dict(sample.labels))
    return scraped


@pytest.mark.parametrize("deployment", ["process", "workers"], indirect=True)
async def test_every_metric_the_dashboard_and_the_alerts_read_is_exported(
    start_broker: Callable[..., Any],
) -> None:
    broker = await attest_broker(start_broker, workdir_setup=with_failing_image)
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
        with pytest.raises(BrokerClientError):
            await client.release(DENIED_KEY, broker.token_source())
        with pytest.raises(BrokerClientError) as failed:  # outcome="error", which an alert reads
            await client.release(KEY, broker.token_source(digest=FAILING_IMAGE))
        assert failed.value.code == "policy_unavailable"
        attestation = await client.attest(broker.token_source())
        await attestation.release(KEY)
    broken = broker.workdir / "policies" / "broker" / "broken.rego"
    broken.write_text("package broker.release\nthis is not rego\n")
    status, _ = await admin_post(broker, "/v1/admin/policy/reload")
    assert status >= 400
    broken.unlink()
    scraped = await scrape(broker)
    exported = set(scraped)

    dashboard = json.loads(DASHBOARD.read_text())
    alerts = yaml.safe_load(ALERTS.read_text())
    in_dashboard = set().union(*(promql_names(e) for e in dashboard_expressions(dashboard)))
    in_alerts = set().union(*(promql_names(rule["expr"]) for rule in alert_rules(alerts)))
    assert sorted(REQUIRED - in_dashboard) == []
    assert sorted(REQUIRED - in_alerts) == []
    assert sorted(in_dashboard - exported) == []
    assert sorted(in_alerts - exported) == []
    assert "broker_made_up_total" not in exported  # the comparison can fail
    expressions = [*dashboard_expressions(dashboard), *(r["expr"] for r in alert_rules(alerts))]
    assert sum(1 for e in expressions for _ in label_matchers(e)) > 10  # the matchers are read
    assert unmatched(expressions, scraped) == []


async def samples(broker: RunningBroker) -> dict[str, float]:
    """``/metrics`` now: each sample as ``name{labels}`` (labels sorted) → value."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(broker.url + "/metrics", ssl=broker.client_tls) as response,
    ):
        text = await response.text()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return found


async def until(broker: RunningBroker, **expected: float) -> dict[str, float]:
    """``/metrics`` once every sample named has at least its value, the first with exactly it
    (set by background tasks: the readiness round, the checkpoint publisher; a failure counter
    may count again before it is read)."""
    (first, value), *others = expected.items()
    for _ in range(200):
        now = await samples(broker)
        if now.get(first) == value and all(now.get(n, -1) >= v for n, v in others):
            return now
        await asyncio.sleep(0.05)
    raise AssertionError(f"never {expected}: {[now.get(name) for name in expected]}")


async def test_the_log_and_checkpoint_metrics_follow_the_log(
    start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the alerts read, as it happens: the log's size and the newest checkpoint's size and
    time; a checkpoint that cannot be signed (records wait, the failure counted); a write that
    fails (the writer down, until a restart)."""
    environ = {"BROKER_SERVER_HEALTH_INTERVAL_SECONDS": "0.1"}
    broker: RunningBroker = await start_broker(environ=environ)
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    size = await covered(broker)
    written = checkpoint_paths(broker.settings.audit.log)[0].stat().st_mtime
    now = await until(
        broker,
        broker_audit_checkpoint_timestamp_seconds=written,
        broker_audit_log_records=size,
        broker_audit_checkpoint_size=size,
    )
    assert (now["broker_audit_log_records"], now["broker_audit_checkpoint_size"]) == (size, size)
    assert now["broker_audit_log_writer_up"] == 1
    assert now["broker_audit_checkpoint_failures_total"] == 0
    assert (now['broker_store_up{store="nonce"}'], now['broker_store_up{store="key"}']) == (1, 1)

    async def unsigned(*_: Any) -> str:
        raise UpstreamError("the checkpoint signer does not answer")

    monkeypatch.setattr(CheckpointPublisher, "_sign", unsigned)
    async with broker.client() as client:
        await client.release(KEY, broker.token_source())
    now = await until(
        broker, broker_audit_log_records=size + 1, broker_audit_checkpoint_failures_total=1
    )
    assert now["broker_audit_checkpoint_size"] == size  # the record waits for a checkpoint
    assert now["broker_audit_checkpoint_timestamp_seconds"] == written

    log_down(monkeypatch)
    async with broker.client() as client:
        with pytest.raises(BrokerClientError, match="audit_log_unavailable"):
            await client.release(KEY, broker.token_source())
    await until(broker, broker_audit_log_writer_up=0)
