"""Autoscaling on Kubernetes: the controller, a real process, against the API
test double. The agents' telemetry is played by a small gRPC server whose
load the test sets (the sum of request latencies over the span: the
concurrency the decision holds at its target). A load step scales the edge
Deployment up with a ScaledUp Event and the reason in the status; an HPA
that targets a Deployment keeps its replicas, which the controller then
never writes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client  # noqa: E402

from tests.fake_agents import telemetry_servers  # noqa: E402
from tests.integration.test_kube_controller import (  # noqa: E402
    GROUP,
    PLURAL,
    VERSION,
    set_spec,
    tiered_model,
    wait,
)
from tests.kubeapi import FakeKubeAPI  # noqa: E402
from tiered.controller.kube import render  # noqa: E402
from tiered.controller.reconciler import decode_status  # noqa: E402
from tiered.protocol import telemetry_pb2 as tpb  # noqa: E402
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc  # noqa: E402

NAMESPACE = "models"
SHA = "a" * 64
CONCURRENCY = {"edge": 1.0}  # per the fake agent's reply, what the test sets


class LoadedTelemetry(tpb_grpc.TelemetryServicer):
    """A tier's agents as the controller's Stats polls see them: 10 requests
    a span, whose latencies add up to CONCURRENCY x the span."""

    def __init__(self, tier: str) -> None:
        self.tier = tier

    def Stats(self, request, context):
        end = time.time()
        start = request.cursor or end - 5.0
        span = max(end - start, 1e-3)
        return tpb.StatsResponse(tier=self.tier, start=start, end=end, window_s=60.0, versions=[
            tpb.VersionStats(model_name=request.model_name, model_version="1", success=10,
                             inferences=10, latency=tpb.Histogram(
                                 sum_s=CONCURRENCY.get(self.tier, 0.0) * span))])


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    with telemetry_servers({render.workload_name("digits", tier, 1): LoadedTelemetry(tier)
                            for tier in ("edge", "regional")},
                           tmp_path_factory.mktemp("agents") / "addresses.json") as path:
        yield path


@pytest.fixture(scope="module")
def cluster(agents, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kube-autoscaling")
    with FakeKubeAPI() as api:
        log = (tmp / "controller.log").open("wb")
        controller = subprocess.Popen(
            [sys.executable, "-m", "tiered", "controller", "--kubernetes", "--namespace",
             NAMESPACE, "--kubeconfig", str(api.kubeconfig(tmp / "kubeconfig")),
             "--agent-addresses", str(agents), "--routing-configmap", "tiered-routing",
             "--insecure"], stdout=log, stderr=subprocess.STDOUT)
        try:
            yield api, client.ApiClient(api.client_configuration())
        finally:
            controller.terminate()
            controller.wait(30)


def model() -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TieredModel",
        "metadata": {"name": "digits", "namespace": NAMESPACE},
        "spec": {
            "artifact": {"uri": "https://models.example/digits-1.onnx", "sha256": SHA},
            "tiers": {"edge": {"autoscaling": {"maxReplicas": 4, "target": 2,
                                               "scaleDownWindowSeconds": 600}},
                      "regional": {"replicas": 2}},
            "rollout": {"stages": [{"name": "edge", "weights": {"edge": 20}}]},
        },
    }


def replicas(api, name: str) -> int:
    (deployment,) = [d for d in api.objects("deployments") if d["metadata"]["name"] == name]
    return deployment["spec"]["replicas"]


def test_a_load_step_scales_the_edge_deployment_and_an_hpa_keeps_its_own(cluster):
    api, kube = cluster
    apps = client.AppsV1Api(kube)
    client.CustomObjectsApi(kube).create_namespaced_custom_object(GROUP, VERSION, NAMESPACE,
                                                                  PLURAL, model())
    wait("the Deployments", lambda: len(api.objects("deployments")) == 2)
    for deployment in api.objects("deployments"):
        apps.patch_namespaced_deployment_status(
            deployment["metadata"]["name"], NAMESPACE,
            {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})
    wait("v1 serving", lambda: (tiered_model(kube).get("status") or {}).get("rollout"))
    assert replicas(api, "digits-edge-v1") == 1 and replicas(api, "digits-regional-v1") == 2

    CONCURRENCY["edge"] = 7.0  # a step: 7 requests at once, target 2 an agent
    wait("edge scaled up", lambda: replicas(api, "digits-edge-v1") == 4, timeout_s=60)
    # The Deployment is sized before the status that says why is written.
    wait("the status", lambda: decode_status(
        "digits", tiered_model(kube)["status"]).scaling["edge"].replicas == 4)
    status = decode_status("digits", tiered_model(kube)["status"])
    assert "concurrency 7 an agent over 1 (target 2): 4 agents wanted" in \
        status.scaling["edge"].reason
    events = client.CoreV1Api(kube).list_namespaced_event(NAMESPACE).items
    assert any(e.reason == "ScaledUp" and "edge: 1 -> 4 agents" in e.message for e in events)
    assert replicas(api, "digits-regional-v1") == 2  # fixed: not autoscaled

    # An HPA takes the regional Deployment over: a spec change leaves its count be.
    client.AutoscalingV2Api(kube).create_namespaced_horizontal_pod_autoscaler(NAMESPACE, {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "regional", "namespace": NAMESPACE},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                    "name": "digits-regional-v1"},
                 "minReplicas": 1, "maxReplicas": 9},
        # As an API server writes a new HPA's (its int32 fields are never left out).
        "status": {"currentReplicas": 0, "desiredReplicas": 0}})
    apps.patch_namespaced_deployment("digits-regional-v1", NAMESPACE, {"spec": {"replicas": 7}})
    spec = tiered_model(kube)["spec"]
    spec["tiers"]["regional"]["replicas"] = 3
    set_spec(kube, spec)  # read, change, write; again on a 409
    generation = tiered_model(kube)["metadata"]["generation"]
    wait("the spec seen", lambda: decode_status(
        "digits", tiered_model(kube)["status"]).observed_generation == generation)
    time.sleep(2.0)  # passes go by
    assert replicas(api, "digits-regional-v1") == 7  # the HPA's, not the spec's 3
    assert replicas(api, "digits-edge-v1") == 4
