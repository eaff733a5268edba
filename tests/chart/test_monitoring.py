"""The chart's monitoring: a Grafana dashboard, Prometheus Operator monitors and
alerting rules, off by default; every metric their queries name is one our
components really export."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.chart import helm
from tests.chart.test_chart import objects, one
from tiered.controller.metrics import RolloutMetrics
from tiered.rollout.status import AnalysisRun, MetricResult, RolloutStatus, TieredModelStatus
from tiered.router.counters import RouterMetrics, ShadowAgreement
from tiered.telemetry.exposition import render

DASHBOARD = helm.CHART / "dashboards" / "tiered.json"
ENABLED = {"monitoring": {"grafanaDashboard": {"enabled": True},
                          "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                          "prometheusRule": {"enabled": True, "errorRate": 0.02}}}
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def monitored(helm_binary, tmp_path_factory):
    return helm.render(ENABLED, tmp_path_factory.mktemp("monitoring"))


def test_monitoring_is_off_by_default(default_render):
    assert not [o for o in default_render if o["kind"] in MONITORING_KINDS]
    assert not [o for o in objects(default_render, "ConfigMap")
                if "grafana_dashboard" in o["metadata"].get("labels", {})]


def test_the_dashboard_configmap_carries_the_dashboard_for_grafanas_sidecar(monitored):
    (config_map,) = [o for o in objects(monitored, "ConfigMap")
                     if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert json.loads(config_map["data"]["tiered.json"]) == json.loads(DASHBOARD.read_text())


def test_monitors_select_the_router_the_controller_and_the_agents(monitored):
    fullname = helm.RELEASE + "-tiered"
    router = one(monitored, "ServiceMonitor", f"{fullname}-router")
    assert router["metadata"]["labels"]["release"] == "kps"
    service = one(monitored, "Service", f"{fullname}-router")
    assert router["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert router["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    controller = one(monitored, "ServiceMonitor", f"{fullname}-controller")
    service = one(monitored, "Service", f"{fullname}-controller-metrics")
    assert controller["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert controller["spec"]["endpoints"][0]["port"] in {
        p["name"] for p in service["spec"]["ports"]}
    # The agents of this release only: what the controller labels its agent pods
    # with, given the chart's agent-pods ConfigMap (tests/chart/test_pod_settings.py).
    agents = one(monitored, "PodMonitor", f"{fullname}-agents")
    from tiered.controller.kube.render import LABEL_MANAGED, MANAGER
    assert agents["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "tiered", "app.kubernetes.io/instance": helm.RELEASE,
        "app.kubernetes.io/component": "agent", LABEL_MANAGED: MANAGER}
    assert objects(monitored, "PodMonitor") == [agents]
    rule = one(monitored, "PrometheusRule", fullname)
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {"TieredRolloutRolledBack", "TieredErrorRateHigh", "TieredAgentDown"}
    assert "> 0.02" in alerts["TieredErrorRateHigh"]["expr"]


def exported_names(text: str) -> set[str]:
    """Every series name a scrape of `text` yields (histograms with their suffixes)."""
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.MULTILINE))
    for name in re.findall(r"^# TYPE (\S+) histogram$", text, re.MULTILINE):
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    names |= set(re.findall(r"^# TYPE (\S+) (?:counter|gauge)$", text, re.MULTILINE))
    return names


def controller_text() -> str:
    metrics = RolloutMetrics()
    analysis = AnalysisRun(1, "Failed", (MetricResult("latency_p95", "Failed", "", {}, "edge"),))
    metrics.observe("digits", TieredModelStatus(rollout=RolloutStatus(
        stable_version=1, canary_version=2, last_analysis=analysis)), ["RolledBack"])
    return render(metrics.families())


def router_text() -> str:
    from prometheus_client import generate_latest

    metrics = RouterMetrics(ShadowAgreement())
    metrics.answered("digits", "edge", "1", 0.001)
    metrics.failovers.labels("digits", "edge", "UNAVAILABLE").inc()
    metrics.escalations.labels("digits", "edge").inc()
    return generate_latest(metrics.registry).decode()


def test_every_metric_the_dashboard_and_alerts_query_is_exported(monitored, agent):
    agent_text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    exported = exported_names(agent_text) | exported_names(router_text()) | \
        exported_names(controller_text()) | {"up"}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries.append(dashboard["templating"]["list"][1]["query"])
    rule = one(monitored, "PrometheusRule", helm.RELEASE + "-tiered")
    queries += [r["expr"] for r in rule["spec"]["groups"][0]["rules"]]
    named = {name for q in queries for name in re.findall(r"\b((?:nv|tiered)_[a-z0-9_]+)", q)}
    assert len(named) >= 12  # the check reads what the queries name
    assert named <= exported, f"queried but never exported: {sorted(named - exported)}"
