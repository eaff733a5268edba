"""Pod settings in the chart: the routers' PodDisruptionBudget, priority classes,
topology spread, extra arguments and environment, the REST port, and the agent
pods' settings, which reach the controller through a ConfigMap and are read
back here with the controller's own loader and renderer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.chart import helm
from tests.chart.test_chart import container, fullname, mounts, objects, one, pod_spec, workloads
from tiered.controller.desired import ArtifactVersion
from tiered.controller.kube import render
from tiered.rollout.spec import load_tiered_model

ZONE_SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
               "whenUnsatisfiable": "ScheduleAnyway"}
HOST_SPREAD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
               "whenUnsatisfiable": "DoNotSchedule",
               "labelSelector": {"matchLabels": {"team": "ml"}}}
PROXY = {"name": "HTTPS_PROXY", "value": "http://proxy.ml.svc:3128"}
NODE = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
SETTINGS: dict[str, Any] = {
    "controller": {"priorityClassName": "system-cluster-critical",
                   "topologySpreadConstraints": [ZONE_SPREAD],
                   "extraArgs": ["--retire-grace", "300"], "extraEnv": [PROXY]},
    "router": {"priorityClassName": "serving", "topologySpreadConstraints": [ZONE_SPREAD,
                                                                              HOST_SPREAD],
               "extraArgs": ["--log-level", "debug"], "extraEnv": [NODE],
               "podDisruptionBudget": {"minAvailable": "50%"}},
    "agents": {"priorityClassName": "serving", "gpuRuntimeClassName": "nvidia",
               "topologySpreadConstraints": [ZONE_SPREAD], "extraArgs": ["--log-level", "info"],
               "extraEnv": [PROXY],
               "tiers": {"datacenter": {"priorityClassName": "gpu-critical",
                                        "extraEnv": [PROXY, NODE]},
                         "edge": {"topologySpreadConstraints": [],
                                  "runtimeClassName": "edge-npu"}}},
}
OFF = {"router": {"http": {"enabled": False}, "podDisruptionBudget": {"enabled": False}},
       "agents": {"http": {"enabled": False}}}
POD_SETTINGS = ("priorityClassName", "topologySpreadConstraints", "runtimeClassName")


@pytest.fixture(scope="module")
def configured(helm_binary, tmp_path_factory):
    return helm.render(SETTINGS, tmp_path_factory.mktemp("settings"))


@pytest.fixture(scope="module")
def switched_off(helm_binary, tmp_path_factory):
    return helm.render(OFF, tmp_path_factory.mktemp("off"))


def controller(rendered):
    return one(rendered, "Deployment", f"{fullname()}-controller")


def router(rendered):
    return one(rendered, "Deployment", f"{fullname()}-router")


def agent_pods(rendered, tmp_path: Path) -> render.AgentPods:
    """The controller's reading of the file the chart mounts for it."""
    config_map = one(rendered, "ConfigMap", f"{fullname()}-agent-pods")
    path = tmp_path / "agent-pods.yaml"
    path.write_text(config_map["data"]["agent-pods.yaml"])
    return render.load_agent_pods(path)


def digits_on(tiers: dict[str, Any]):
    """A TieredModel on `tiers` (their settings), one stage of equal weights."""
    return load_tiered_model({
        "name": "digits", "artifact": {"uri": "https://models.example/d.onnx", "sha256": "a" * 64},
        "tiers": tiers,
        "rollout": {"stages": [{"name": "all", "weights": {t: 100 // len(tiers) for t in tiers}}]}})


def controller_objects(pods: render.AgentPods, tiers: dict[str, Any]) -> list[dict[str, Any]]:
    """What the controller writes with `pods` for `digits_on(tiers)`, version 1."""
    spec = digits_on(tiers)
    return render.desired_objects(spec, [ArtifactVersion(1, spec.artifact.uri, "a" * 64)], [1],
                                  render.Owner("digits", "uid"),
                                  render.ClusterSettings(helm.NAMESPACE, agent_pods=pods))


def edge_workload(pods: render.AgentPods) -> dict[str, Any]:
    """The Deployment the controller writes with `pods` for an edge-only model."""
    return next(o for o in controller_objects(pods, {"edge": {}}) if o["kind"] == "Deployment")


def test_the_configured_render_validates_strictly_against_kubernetes(configured, switched_off):
    for obj in [*configured, *switched_off]:
        kubernetes_validate.validate(obj, helm.KUBE_VERSION, strict=True)


# ---- defaults ------------------------------------------------------------------------

def test_by_default_pods_get_no_priority_spread_or_extras(default_render, tmp_path):
    for workload in workloads(default_render):
        assert not set(POD_SETTINGS) & set(pod_spec(workload)), workload["metadata"]["name"]
    assert [e["name"] for e in container(router(default_render), "router")["env"]] == [
        "HOME", "PYTHONUNBUFFERED"]
    pods = agent_pods(default_render, tmp_path)
    assert pods.http_port == 8000
    assert {pods.tier(t) for t in ("edge", "regional", "datacenter")} == {render.PodSettings()}


def test_by_default_the_routers_have_a_disruption_budget_of_one(default_render):
    (budget,) = objects(default_render, "PodDisruptionBudget")
    assert budget["metadata"]["name"] == f"{fullname()}-router"
    assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"]
    labels = router(default_render)["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["selector"] == router(default_render)["spec"]["selector"]


# ---- the controller and the router ---------------------------------------------------------

@pytest.mark.parametrize(("workload", "name"), [(controller, "controller"), (router, "router")])
def test_priority_spread_args_and_env_reach_the_component(configured, default_render,
                                                          workload, name):
    values = SETTINGS[name]
    deployment = workload(configured)
    pod = pod_spec(deployment)
    assert pod["priorityClassName"] == values["priorityClassName"]
    # A constraint without a labelSelector spreads the component's own pods.
    own = deployment["spec"]["selector"]
    assert pod["topologySpreadConstraints"] == [
        {**c, "labelSelector": c.get("labelSelector", own)}
        for c in values["topologySpreadConstraints"]]
    c = container(deployment, name)
    default = container(workload(default_render), name)
    assert c["args"] == default["args"] + values["extraArgs"]
    assert c["env"] == default["env"] + values["extraEnv"]


def test_min_available_replaces_max_unavailable(configured):
    (budget,) = objects(configured, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in budget["spec"]


def test_the_routers_rest_port_and_budget_can_be_switched_off(switched_off):
    assert objects(switched_off, "PodDisruptionBudget") == []
    c = container(router(switched_off), "router")
    assert "--http-port" not in c["args"] and "--no-http" in c["args"]
    assert "http" not in {p["name"] for p in c["ports"]}
    service = one(switched_off, "Service", f"{fullname()}-router")
    assert "http" not in {p["name"] for p in service["spec"]["ports"]}


def test_the_controllers_metrics_have_a_service(any_render):
    service = one(any_render, "Service", f"{fullname()}-controller-metrics")
    assert service["spec"]["selector"] == controller(any_render)["spec"]["selector"][
        "matchLabels"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8080,
                                         "targetPort": "metrics", "protocol": "TCP",
                                         "appProtocol": "http"}]


# ---- the agents, through the controller ----------------------------------------------------

def test_agent_settings_resolve_per_tier_for_the_controller(configured, tmp_path):
    pods = agent_pods(configured, tmp_path)
    agents = SETTINGS["agents"]
    common = dict(priority_class_name="serving",
                  topology_spread_constraints=(ZONE_SPREAD,),
                  extra_args=("--log-level", "info"), extra_env=(PROXY,))
    assert pods.tier("regional") == render.PodSettings(runtime_class_name="nvidia", **common)
    assert pods.tier("datacenter") == render.PodSettings(
        **{**common, "priority_class_name": "gpu-critical",
           "extra_env": tuple(agents["tiers"]["datacenter"]["extraEnv"])},
        runtime_class_name="nvidia")
    # An empty list set for a tier clears the common one; the edge is no GPU tier.
    assert pods.tier("edge") == render.PodSettings(
        **{**common, "topology_spread_constraints": ()}, runtime_class_name="edge-npu")
    assert pods.labels == {"app.kubernetes.io/name": "tiered",
                           "app.kubernetes.io/instance": helm.RELEASE,
                           "app.kubernetes.io/part-of": "tiered"}


def test_agent_rest_can_be_switched_off(switched_off, tmp_path):
    assert agent_pods(switched_off, tmp_path).http_port is None


def agent_pods_checksum(rendered) -> str:
    """The controller pod's digest of the agent-pods file: a change restarts it."""
    return controller(rendered)["spec"]["template"]["metadata"]["annotations"][
        "checksum/agent-pods"]


def test_a_change_of_agent_settings_restarts_the_controller(configured, default_render):
    assert agent_pods_checksum(configured) != agent_pods_checksum(default_render)


def test_controller_made_agents_are_what_the_release_selects(configured, tmp_path):
    """The controller given the chart's file: its pods validate, carry the
    release's labels and the tier's settings, and the PodMonitor selects them."""
    pods = agent_pods(configured, tmp_path)
    objs = controller_objects(pods, {"edge": {}, "datacenter": {}})
    monitors = helm.render({"monitoring": {"serviceMonitor": {"enabled": True}}}, tmp_path)
    selector = one(monitors, "PodMonitor", f"{fullname()}-agents")["spec"]["selector"]
    for obj in objs:
        kubernetes_validate.validate(obj, helm.KUBE_VERSION, strict=True)
    datacenter = next(o for o in objs if o["kind"] == "Deployment"
                      and o["metadata"]["labels"][render.LABEL_TIER] == "datacenter")
    for workload in (o for o in objs if o["kind"] == "Deployment"):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        assert "helm.sh/chart" not in labels  # Helm does not manage these pods
    pod = pod_spec(datacenter)
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("gpu-critical", "nvidia")
    agent = container(datacenter, "agent")
    assert agent["command"][-2:] == ["--log-level", "info"]
    assert agent["env"] == [PROXY, NODE]
    assert {"name": "http", "containerPort": 8000} in agent["ports"]
    assert "/etc/tiered/tls" not in mounts(agent)


def test_only_the_routers_and_the_controller_reach_the_agents(default_render, switched_off,
                                                             tmp_path):
    """The NetworkPolicy selects the pods the controller makes from the chart's
    file, and takes calls to them only from the release's routers and controller."""
    policy = one(default_render, "NetworkPolicy", f"{fullname()}-agents")
    kubernetes_validate.validate(policy, helm.KUBE_VERSION, strict=True)
    agent_labels = edge_workload(agent_pods(default_render, tmp_path))["spec"]["template"][
        "metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= agent_labels.items()
    calls, metrics = policy["spec"]["ingress"]
    callers = [peer["podSelector"]["matchLabels"] for peer in calls["from"]]
    assert callers == [workload["spec"]["selector"]["matchLabels"]
                       for workload in (router(default_render), controller(default_render))]
    assert {p["port"] for p in calls["ports"]} == {render.AGENT_PORT, render.AGENT_HTTP_PORT}
    assert metrics == {"ports": [{"port": render.AGENT_METRICS_PORT, "protocol": "TCP"}]}
    assert {p["port"] for p in one(switched_off, "NetworkPolicy", f"{fullname()}-agents")[
        "spec"]["ingress"][0]["ports"]} == {render.AGENT_PORT}  # no REST, no REST port
    off = helm.render({"agents": {"networkPolicy": {"enabled": False}}}, tmp_path)
    assert objects(off, "NetworkPolicy") == []


# ---- placement ------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "digits.yaml"


@pytest.mark.parametrize(("tier", "refused"), [
    ({"node_selector": {"node-role.kubernetes.io/control-plane": ""}},
     "nodeSelector: 'node-role.kubernetes.io/control-plane' is not a label agents may select on"),
    ({"tolerations": [{"operator": "Exists"}]}, "tolerations: {'key': '', 'operator': 'Exists'"),
    ({"resources": {"limits": {"memory": "999Ti"}}},
     "resources.limits.memory: 999Ti is above the most agents get here, 128Gi"),
    ({"resources": {"requests": {"hugepages-2Mi": "1Gi"}}},
     "resources.requests: hugepages-2Mi is not given to agents here"),
])
def test_the_charts_placement_refuses_what_a_model_writer_should_not_ask(
        tier, refused, default_render, tmp_path):
    pods = agent_pods(default_render, tmp_path)
    assert pods.placement.refusal(digits_on({"edge": tier}).tiers["edge"]).startswith(refused)
    assert controller_objects(pods, {"edge": tier}) == []  # nothing deployed for a refused tier


def test_the_charts_placement_admits_the_kubernetes_example(default_render, tmp_path):
    import yaml

    placement = agent_pods(default_render, tmp_path).placement
    spec = load_tiered_model(yaml.safe_load(EXAMPLE.read_text()))
    assert spec.tiers and {t: placement.refusal(s) for t, s in spec.tiers.items()} == \
        dict.fromkeys(spec.tiers)
    assert render.Placement().refusal(spec.tiers["datacenter"]) is None  # no chart: no limit
