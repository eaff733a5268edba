"""Kubernetes objects from a spec, and reading the kubelet's pod status back."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import kubernetes_validate
import pytest

from tiered.controller.desired import ArtifactVersion
from tiered.controller.kube import render
from tiered.errors import ConfigError
from tiered.protocol.verdict import BuildVerdict
from tiered.rollout.spec import load_tiered_model

SHA = "a" * 64
REFUSED = ("artifact: /models/in/digits.onnx has sha256 " + "b" * 64 +
           ", not the expected " + SHA + "; refusing to build it")
VERDICT = BuildVerdict(built=False, model="digits", version=3, tier="edge", reason=REFUSED,
                       installed=None, exit_code=2).to_json()


def spec():
    return load_tiered_model({
        "name": "digits", "artifact": {"uri": "https://models.example/digits.onnx", "sha256": SHA},
        "tiers": {"edge": {}}, "rollout": {"stages": [{"name": "all", "weights": {"edge": 100}}]}})


def workload():
    return render.agent_workload(spec(), "edge", ArtifactVersion(3, spec().artifact.uri, SHA),
                                 render.Owner("digits", "uid-1"), render.ClusterSettings("models"))


def test_the_build_reports_its_failure_through_its_logs():
    (build,) = workload()["spec"]["template"]["spec"]["initContainers"]
    assert build["name"] == render.BUILD_CONTAINER
    assert build["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert build["terminationMessagePath"] == render.TERMINATION_LOG
    assert build["command"][-2:] == ["--termination-log", render.TERMINATION_LOG]


def test_agent_pods_carry_no_service_account_token():
    assert workload()["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_the_pod_selector_selects_the_workload_pods():
    labels = workload()["spec"]["template"]["metadata"]["labels"]
    selector = dict(pair.split("=") for pair in render.pod_selector("digits", "edge", 3).split(","))
    assert selector.items() <= labels.items()
    assert workload()["spec"]["selector"]["matchLabels"] == selector


def pod(*init_statuses):
    return {"status": {"initContainerStatuses": list(init_statuses)}}


def build_status(state=None, last_state=None, name=render.BUILD_CONTAINER):
    return {"name": name, "ready": False, "restartCount": 1, "image": "tiered-agent",
            "imageID": "", "state": state or {}, "lastState": last_state or {}}


def terminated(code, message=None, reason="Error"):
    return {"terminated": {"exitCode": code, "reason": reason,
                           **({"message": message} if message is not None else {})}}


@pytest.mark.parametrize(("pods", "failure"), [
    ([], None),                                                         # no pod scheduled yet
    ([{"status": {}}], None),                                           # pending, no statuses
    ([pod(build_status({"running": {}}))], None),                       # still building
    ([pod(build_status(terminated(0, "", "Completed")))], None),        # built
    ([pod(build_status(terminated(2, VERDICT)))], REFUSED),            # the verdict file
    ([pod(build_status(terminated(2, f"fetching\n{VERDICT}\n")))], REFUSED),  # logs' last
    ([pod(build_status({"waiting": {"reason": "CrashLoopBackOff"}},     # restarting: last state
                       terminated(2, VERDICT)))], REFUSED),
    ([pod(build_status(terminated(137, reason="OOMKilled")))],          # no message
     "the build exited with code 137 (OOMKilled) and no verdict"),
    ([pod(build_status(terminated(1, "Traceback ...\nMemoryError")))],  # no verdict in it
     "the build exited with code 1 (Error) and no verdict"),
    ([pod(build_status(terminated(1, "other"), name="sidecar"))], None),  # not the build
    ([pod(build_status({"running": {}})),
      pod(build_status(terminated(2, VERDICT)))], REFUSED),             # any pod of the set
])
def test_build_failure(pods, failure):
    assert render.build_failure(pods) == failure


# ---- the settings of the agent pods (the chart's, through --agent-pods) --------------

STANDARD = {"app.kubernetes.io/name": "tiered", "app.kubernetes.io/part-of": "tiered",
            "app.kubernetes.io/component": "agent",
            "app.kubernetes.io/managed-by": "tiered-controller"}
CHART_PODS = """
labels:
  app.kubernetes.io/name: tiered
  app.kubernetes.io/instance: prod
  app.kubernetes.io/part-of: tiered
httpPort: 8000
tiers:
  edge: {}
  datacenter:
    priorityClassName: gpu-critical
    runtimeClassName: nvidia
    topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule}
      - maxSkew: 2
        topologyKey: topology.kubernetes.io/zone
        whenUnsatisfiable: ScheduleAnyway
        labelSelector: {matchLabels: {team: ml}}
    extraArgs: [--log-level, debug]
    extraEnv:
      - {name: HTTPS_PROXY, value: "http://proxy:3128"}
      - name: NODE
        valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
"""


def two_tier_spec():
    return load_tiered_model({
        "name": "digits", "artifact": {"uri": "https://models.example/digits.onnx", "sha256": SHA},
        "tiers": {"edge": {}, "datacenter": {}},
        "rollout": {"stages": [{"name": "all", "weights": {"edge": 50, "datacenter": 50}}]}})


def rendered(pods: render.AgentPods, tier: str):
    settings = render.ClusterSettings("models", agent_pods=pods)
    owner = render.Owner("digits", "uid-1")
    return (render.agent_workload(two_tier_spec(), tier,
                                  ArtifactVersion(3, spec().artifact.uri, SHA), owner, settings),
            render.agent_service(two_tier_spec(), tier, 3, owner, settings))


def chart_pods(tmp_path, text=CHART_PODS) -> render.AgentPods:
    path = tmp_path / "agent-pods.yaml"
    path.write_text(text)
    return render.load_agent_pods(path)


def agent_container(workload):
    (agent,) = workload["spec"]["template"]["spec"]["containers"]
    return agent


def test_every_object_carries_the_standard_labels_and_selects_by_its_own(tmp_path):
    for pods, extra in [(render.AgentPods(), {}),
                        (chart_pods(tmp_path), {"app.kubernetes.io/instance": "prod"})]:
        for tier in ("edge", "datacenter"):
            workload, service = rendered(pods, tier)
            selector = dict(pair.split("=")
                            for pair in render.pod_selector("digits", tier, 3).split(","))
            assert workload["spec"]["selector"]["matchLabels"] == selector
            assert service["spec"]["selector"] == selector
            for labels in (workload["metadata"]["labels"], service["metadata"]["labels"],
                           workload["spec"]["template"]["metadata"]["labels"]):
                assert labels == {**STANDARD, **extra, **selector}


def test_by_default_agents_serve_rest_on_8000_and_get_nothing_else():
    workload, service = rendered(render.AgentPods(), "datacenter")
    pod = workload["spec"]["template"]["spec"]
    agent = agent_container(workload)
    assert agent["command"][agent["command"].index("--http-port") + 1] == "8000"
    assert {"name": "http", "containerPort": 8000} in agent["ports"]
    assert {"name": "http", "port": 8000, "targetPort": "http"} in service["spec"]["ports"]
    assert not {"priorityClassName", "runtimeClassName", "topologySpreadConstraints"} & set(pod)
    assert all("env" not in c for c in [*pod["initContainers"], *pod["containers"]])
    assert agent["command"][-1] == "--insecure"


def test_a_tiers_settings_reach_its_pods_only(tmp_path):
    pods = chart_pods(tmp_path)
    workload, _ = rendered(pods, "datacenter")
    pod = workload["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "gpu-critical"
    assert pod["runtimeClassName"] == "nvidia"
    own, zone = pod["topologySpreadConstraints"]
    # A constraint without a labelSelector spreads this workload's own pods.
    assert own["labelSelector"] == {"matchLabels": workload["spec"]["selector"]["matchLabels"]}
    assert zone["labelSelector"] == {"matchLabels": {"team": "ml"}}
    agent = agent_container(workload)
    assert agent["command"][-2:] == ["--log-level", "debug"]
    env = [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    (build,) = pod["initContainers"]
    assert agent["env"] == env and build["env"] == env
    edge, _ = rendered(pods, "edge")
    assert not {"priorityClassName", "runtimeClassName", "topologySpreadConstraints"} & set(
        edge["spec"]["template"]["spec"])
    assert "--log-level" not in agent_container(edge)["command"]


def test_rest_can_be_turned_off(tmp_path):
    workload, service = rendered(chart_pods(tmp_path, "httpPort: null\n"), "edge")
    agent = agent_container(workload)
    assert "--http-port" not in agent["command"] and "--no-http" in agent["command"]
    assert "http" not in {p["name"] for p in agent["ports"]}
    assert "http" not in {p["name"] for p in service["spec"]["ports"]}


def test_rendered_agents_validate_strictly_against_kubernetes(tmp_path):
    for pods in (render.AgentPods(), chart_pods(tmp_path)):
        for tier in ("edge", "datacenter"):
            for obj in rendered(pods, tier):
                kubernetes_validate.validate(obj, "1.30.0", strict=True)


@pytest.mark.parametrize(("text", "message"), [
    ("tiers: {gpu: {}}\n", "tiers: unknown tier 'gpu'"),
    ("tiers: {edge: {priorityClass: x}}\n", "tiers.edge: unknown key 'priorityClass'"),
    ("labels: {app.kubernetes.io/managed-by: helm}\n", "is the controller's own selector label"),
    ("httpPort: 8001\n", "httpPort: expected a free port"),
    ("httpPort: '8000'\n", "httpPort: expected an integer"),
    ("tiers: {edge: {extraArgs: --debug}}\n", "tiers.edge.extraArgs: expected a list"),
    ("auth: {inferenceTokens: {secret: t}}\n", "auth: unknown key 'inferenceTokens'"),
    ("auth: {inference: {key: tokens}}\n", "auth.inference.secret: required"),
    ("auth: {inference: {secret: My_Tokens}}\n", "auth.inference.secret: expected a Secret's"),
    ("auth: {admin: {secret: t, key: a/b}}\n", "auth.admin.key: expected a Secret's key"),
])
def test_agent_pod_settings_name_what_is_wrong(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        chart_pods(tmp_path, text)
    assert str(tmp_path / "agent-pods.yaml") in str(caught.value)


AUTH_PODS = """
auth:
  inference: {secret: agent-tokens}
  admin: {secret: agent-tokens, key: admin}
"""


def test_the_agents_token_secrets_reach_the_agent_alone_one_key_each(tmp_path):
    workload, _ = rendered(chart_pods(tmp_path, AUTH_PODS), "edge")
    pod = workload["spec"]["template"]["spec"]
    agent = agent_container(workload)
    tokens = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert tokens == {
        "inference-tokens": {"secretName": "agent-tokens", "defaultMode": 0o440,
                             "items": [{"key": "tokens", "path": "tokens"}]},
        "admin-tokens": {"secretName": "agent-tokens", "defaultMode": 0o440,
                         "items": [{"key": "admin", "path": "admin"}]}}
    mounted = {m["name"]: m for m in agent["volumeMounts"]}
    for name in tokens:
        assert mounted[name]["readOnly"] is True
        assert mounted[name]["mountPath"] == f"{render.TOKENS_DIR}/{name}"
    command = agent["command"]
    assert command[command.index("--inference-token-file") + 1] == \
        f"{render.TOKENS_DIR}/inference-tokens/tokens"
    assert command[command.index("--admin-token-file") + 1] == \
        f"{render.TOKENS_DIR}/admin-tokens/admin"
    (build,) = pod["initContainers"]
    assert not {m["name"] for m in build["volumeMounts"]} & set(tokens)
    kubernetes_validate.validate(workload, "1.30.0", strict=True)


def test_agents_require_no_token_unless_the_chart_names_its_secret(tmp_path):
    inference_only = chart_pods(tmp_path, "auth: {inference: {secret: agent-tokens}}\n")
    for pods, files in [(render.AgentPods(), set()), (chart_pods(tmp_path), set()),
                        (inference_only, {"--inference-token-file"})]:
        workload, _ = rendered(pods, "edge")
        command = agent_container(workload)["command"]
        assert {"--inference-token-file", "--admin-token-file"} & set(command) == files
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        assert len([v for v in volumes if "secret" in v]) == len(files)


NOW = datetime(2026, 12, 1, 12, 0, 30, tzinfo=timezone.utc)


def agent_status(state=None, ready=False):
    return {"name": render.AGENT_CONTAINER, "ready": ready, "state": state or {}}


def scheduled(init=(), containers=()):
    return {"status": {"initContainerStatuses": list(init),
                       "containerStatuses": list(containers)}}


BUILT = build_status(terminated(0, "", "Completed"))
UNSCHEDULABLE = {"status": {"conditions": [{
    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}


@pytest.mark.parametrize(("pods", "progress"), [
    ([], "no pod yet"),
    ([UNSCHEDULABLE], "unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."),
    ([{"status": {}}], "scheduled"),
    ([scheduled([build_status({"waiting": {"reason": "ImagePullBackOff"}})])],
     "build waiting: ImagePullBackOff"),
    ([scheduled([build_status({"running": {"startedAt": "2026-12-01T12:00:18Z"}})])],
     "building, 12 s"),
    ([scheduled([BUILT], [agent_status({"waiting": {"reason": "ContainerCreating"}})])],
     "agent ContainerCreating"),
    ([scheduled([BUILT], [agent_status({"running": {}})])], "loading"),
    ([scheduled([BUILT], [agent_status({"running": {}}, ready=True)])], "ready"),
    ([UNSCHEDULABLE, scheduled([build_status({"running": {}})])], "building"),  # the furthest
])
def test_pod_progress_says_how_far_the_furthest_pod_is(pods, progress):
    assert render.pod_progress(pods, NOW) == progress


def gpu_spec(gpus):
    return load_tiered_model({
        "name": "digits", "artifact": {"uri": "https://models.example/digits.onnx", "sha256": SHA},
        "tiers": {"edge": {"resources": {"limits": {"cpu": 2}}},
                  "datacenter": {"resources": {"limits": {"nvidia.com/gpu": gpus}}}},
        "rollout": {"stages": [{"name": "all", "weights": {"edge": 50, "datacenter": 50}}]}})


@pytest.mark.parametrize("gpus", [4, "2"])
def test_a_pod_given_gpus_runs_an_engine_process_on_each(gpus):
    artifact = ArtifactVersion(3, spec().artifact.uri, SHA)
    owner, settings = render.Owner("digits", "uid-1"), render.ClusterSettings("models")
    datacenter = render.agent_workload(gpu_spec(gpus), "datacenter", artifact, owner, settings)
    agent = agent_container(datacenter)
    assert agent["resources"]["limits"] == {"nvidia.com/gpu": str(gpus)}
    assert agent["command"][agent["command"].index("--devices") + 1] == "auto"
    edge = render.agent_workload(gpu_spec(gpus), "edge", artifact, owner, settings)
    assert "--devices" not in agent_container(edge)["command"]
    kubernetes_validate.validate(datacenter, "1.30.0", strict=True)


def test_a_fraction_of_a_gpu_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"limits\.nvidia\.com/gpu: a whole number of GPUs"):
        gpu_spec("500m")
