"""One scenario, both backends: the one Reconciler behaves the same on each.

The same TieredModel goes through the same steps on the local backend (a
SQLite store, real `tiered build` processes into tier repositories, agents
loaded over gRPC) and on the Kubernetes backend (the real client against
the API test double, Deployments made available as a kubelet would): v1
serves; v2, healthy, is promoted through both stages; v3, slower and
costlier, is rolled back in its first stage; the retired versions' agents go
once their grace has passed. The agents on both sides are small gRPC servers
that answer RepositoryModelLoad and Telemetry.Stats with the same seeded
behaviour per version, so any difference in what the backends did is the
backends' own.

Compared: the rollout history (every step, with its stage), the final
rollout, the conditions, the routing table (apart from agent addresses), the
versions left with agents, and the spec's batching reaching the agents'
config (the local config.yaml; Kubernetes' build arguments).
"""

from __future__ import annotations

import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

pytest.importorskip("kubernetes")

from kubernetes import client  # noqa: E402

from tests.kubeapi import FakeKubeAPI  # noqa: E402
from tiered.controller.host.backend import HostBackend
from tiered.controller.host.state import RunningSystem, StateLayout  # noqa: E402
from tiered.controller.judge import RolloutJudge  # noqa: E402
from tiered.controller.kube import render  # noqa: E402
from tiered.controller.kube.backend import KubeBackend  # noqa: E402
from tiered.controller.reconciler import Reconciler, decode_status  # noqa: E402
from tiered.controller.store import StateStore  # noqa: E402
from tiered.files import sha256_file  # noqa: E402
from tiered.models import zoo  # noqa: E402
from tiered.protocol import grpc_service_pb2 as pb  # noqa: E402
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc  # noqa: E402
from tiered.protocol import routing  # noqa: E402
from tiered.protocol import telemetry_pb2 as tpb  # noqa: E402
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc  # noqa: E402
from tiered.protocol.security import ChannelCache  # noqa: E402
from tiered.rollout.spec import as_resource  # noqa: E402
from tiered.rollout.wire import API_GROUP, API_VERSION  # noqa: E402

NAME, NAMESPACE = "digits", "both"
TIERS = ("edge", "regional")
BEHAVIOUR = {1: (4.0, 0.10), 2: (4.0, 0.10), 3: (12.0, 0.35)}  # median ms, J/inference
QUEUE_DELAY_US = 250
RATE_PER_S = 400  # requests each fake agent answers per version


class FakeAgent(tpb_grpc.TelemetryServicer, pb_grpc.GRPCInferenceServiceServicer):
    """One agent: it loads what it is told and reports seeded telemetry for
    the versions it serves (`versions()`)."""

    def __init__(self, tier: str, versions) -> None:
        self.tier, self.versions = tier, versions
        self.rng = np.random.default_rng(len(tier))
        self.loads = 0

    def RepositoryModelLoad(self, request, context):
        self.loads += 1
        return pb.RepositoryModelLoadResponse()

    def Stats(self, request, context):
        # Requests at a steady rate since the reader's cursor, so what a stage
        # gathers depends on its time, not on how often it is looked at.
        now = time.time()
        answered = int(RATE_PER_S * (now - request.cursor)) if request.cursor else 40
        versions = []
        for version in self.versions():
            latency_ms, joules = BEHAVIOUR[version]
            samples = self.rng.lognormal(np.log(latency_ms), 0.2, 40) / 1000.0
            versions.append(tpb.VersionStats(
                model_name=request.model_name, model_version=str(version), success=answered,
                inferences=answered, latency_samples_s=samples.tolist(), has_energy=True,
                joules_per_inference=joules * self.rng.uniform(0.9, 1.1)))
        return tpb.StatsResponse(tier=self.tier, start=request.cursor, end=now,
                                 window_s=1.0, versions=versions)


def serve(agent: FakeAgent) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tpb_grpc.add_TelemetryServicer_to_server(agent, server)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(agent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


TWO_STAGES = [
    {"name": "edge", "weights": {"edge": 20}, "min_requests": 60, "min_duration_s": 1.5,
     "max_duration_s": 60},
    {"name": "region", "weights": {"edge": 50, "regional": 50}, "min_requests": 60,
     "min_duration_s": 1.5, "max_duration_s": 60}]


def spec(artifact: Path, stages=TWO_STAGES) -> dict:
    tier = {"precision": "fp32", "batching": {"max_batch_size": 4,
                                              "max_queue_delay_us": QUEUE_DELAY_US}}
    return {
        "artifact": {"uri": str(artifact), "sha256": sha256_file(artifact)},
        "tiers": {t: dict(tier) for t in TIERS},
        "rollout": {
            "stages": stages,
            "analysis": {"latency_p95": {"max_ratio": 1.2},
                         "energy_per_inference": {"max_ratio": 1.3, "min_windows": 3},
                         "agreement": None, "min_samples": 30, "interval_s": 0.5,
                         "consecutive_failure_limit": 2},
        },
    }


class Local:
    """The local backend on a store and tier repositories in a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.layout = StateLayout(root).create()
        self.layout.ensure_admin_token()
        self.store = StateStore(self.layout.store)
        self.servers, agents = [], {}
        for tier in TIERS:
            server, address = serve(FakeAgent(tier, lambda t=tier: self.loaded(t)))
            self.servers.append(server)
            agents[tier] = (address,)
        self.backend = HostBackend(self.layout, self.store, ChannelCache(), lambda _: None)
        self.backend.system = RunningSystem(agents, "")

    def config(self, tier: str) -> dict:
        path = self.layout.repository(tier) / NAME / "config.yaml"
        return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}

    def loaded(self, tier: str) -> list[int]:
        """The versions the tier's config names: what its agent loads."""
        return list((self.config(tier).get("version_policy") or {}).get("specific") or ())

    def present(self) -> set[int]:
        return {v for tier in TIERS for v in self.loaded(tier)}

    def apply(self, document: dict) -> None:
        self.store.apply(NAME, as_resource({"name": NAME, **document}))

    def status(self):
        return decode_status(NAME, self.store.get(NAME).status)

    def drop_stage_samples(self) -> None:
        """The status as a controller without stage samples in it would have left it."""
        record = self.store.get(NAME)
        self.store.write_status(NAME, record.revision,
                                status={**record.status, "stageSamples": None})

    def kubelet(self) -> None:
        """Local agents are up already."""

    def table(self) -> routing.RoutingTable:
        return routing.load_table(self.layout.routing_table)

    def queue_delays(self) -> set[int]:
        return {self.config(tier)["dynamic_batching"]["max_queue_delay_us"] for tier in TIERS}

    def close(self) -> None:
        for server in self.servers:
            server.stop(0)
        self.store.close()


class Kube:
    """The Kubernetes backend against the API double; fake agents per Service."""

    def __init__(self, api: FakeKubeAPI, namespace: str = NAMESPACE) -> None:
        self.namespace = namespace
        self.api = client.ApiClient(api.client_configuration())
        self.custom = client.CustomObjectsApi(self.api)
        self.servers, addresses = [], {}
        for tier in TIERS:
            for version in BEHAVIOUR:
                server, address = serve(FakeAgent(tier, lambda v=version: [v]))
                self.servers.append(server)
                addresses[render.workload_name(NAME, tier, version)] = address
        settings = render.ClusterSettings(namespace=self.namespace)
        self.backend = KubeBackend(settings, self.api, addresses, lambda _: None)
        self.raw = api

    def apply(self, document: dict) -> None:
        body = as_resource({"name": NAME, **document})
        body["metadata"]["namespace"] = self.namespace
        try:
            current = self.custom.get_namespaced_custom_object(
                API_GROUP, API_VERSION, self.namespace, "tieredmodels", NAME)
        except client.exceptions.ApiException:
            self.custom.create_namespaced_custom_object(
                API_GROUP, API_VERSION, self.namespace, "tieredmodels", body)
            return
        current["spec"] = body["spec"]
        self.custom.replace_namespaced_custom_object(
            API_GROUP, API_VERSION, self.namespace, "tieredmodels", NAME, current)

    def status(self):
        obj = self.custom.get_namespaced_custom_object(
            API_GROUP, API_VERSION, self.namespace, "tieredmodels", NAME)
        return decode_status(NAME, obj.get("status"))

    def drop_stage_samples(self) -> None:
        obj = self.custom.get_namespaced_custom_object(
            API_GROUP, API_VERSION, self.namespace, "tieredmodels", NAME)
        obj["status"]["stageSamples"] = None
        self.custom.replace_namespaced_custom_object_status(
            API_GROUP, API_VERSION, self.namespace, "tieredmodels", NAME, obj)

    def kubelet(self) -> None:
        """Every pod of every workload of the namespace is available."""
        apps = client.AppsV1Api(self.api)
        for deployment in self.raw.objects("deployments"):
            pods = deployment["spec"]["replicas"]
            if deployment["metadata"]["namespace"] == self.namespace and (
                    deployment.get("status") or {}).get("availableReplicas") != pods:
                apps.patch_namespaced_deployment_status(
                    deployment["metadata"]["name"], self.namespace, {"status": {
                        "replicas": pods, "readyReplicas": pods, "availableReplicas": pods}})

    def table(self) -> routing.RoutingTable:
        data = client.CoreV1Api(self.api).read_namespaced_config_map(
            "tiered-routing", self.namespace).data[render.ROUTING_KEY]
        return routing.parse_table(yaml.safe_load(data))

    def present(self) -> set[int]:
        """Versions with a workload or a Service left."""
        return {int(obj["metadata"]["labels"][render.LABEL_VERSION])
                for plural in ("deployments", "services") for obj in self.raw.objects(plural)
                if obj["metadata"]["namespace"] == self.namespace}

    def queue_delays(self) -> set[int]:
        delays = set()
        for deployment in self.raw.objects("deployments"):
            command = deployment["spec"]["template"]["spec"]["initContainers"][0]["command"]
            delays.add(int(command[command.index("--max-queue-delay-us") + 1]))
        return delays

    def close(self) -> None:
        for server in self.servers:
            server.stop(0)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    return {v: zoo.mlp(root / f"mlp-{v}.onnx", seed=v) for v in BEHAVIOUR}


@pytest.fixture(scope="module")
def outcomes(artifacts, tmp_path_factory):
    """What each backend did in the scenario: status, table, versions, batching."""
    results = {}
    with FakeKubeAPI() as api:
        for name, backend in (("local", Local(tmp_path_factory.mktemp("local"))),
                              ("kubernetes", Kube(api))):
            try:
                results[name] = run_scenario(backend, artifacts)
            finally:
                backend.close()
    return results


def controller(side) -> Reconciler:
    """A controller as one starts: a Reconciler with a judge that has read nothing."""
    return Reconciler(side.backend, RolloutJudge(ChannelCache(), seed=0), clock=time.time,
                      progress=lambda _: None, retire_grace_s=1.0)


def drive(side, reconciler: Reconciler, what: str, done, timeout_s: float = 90.0):
    """Reconcile (a kubelet marking workloads available) until `done(rollout)`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reconciler.reconcile(NAME)
        side.kubelet()
        status = side.status()
        if status.rollout is not None and done(status.rollout):
            return status
        time.sleep(0.1)
    raise AssertionError(f"{type(side).__name__}: timed out waiting for {what}: "
                         f"{side.status()}")


def run_scenario(side, artifacts) -> dict:
    reconciler = controller(side)

    def until(what, done, timeout_s=90.0):
        return drive(side, reconciler, what, done, timeout_s)

    side.apply(spec(artifacts[1]))
    until("v1 serving", lambda r: r.stable_version == 1)
    side.apply(spec(artifacts[2]))
    until("v2 promoted", lambda r: r.stable_version == 2)
    side.apply(spec(artifacts[3]))
    until("v3 rolled back", lambda r: r.canary_version == 3 and r.phase == "RolledBack")
    deadline = time.monotonic() + 30  # the retired versions' grace (1 s) passes
    while side.present() != {2} and time.monotonic() < deadline:
        reconciler.reconcile(NAME)
        time.sleep(0.2)
    reconciler.reconcile(NAME)  # the pass after a removal forgets it
    return {"status": side.status(), "table": side.table(), "present": side.present(),
            "queue_delays": side.queue_delays()}


def steps(status) -> list[tuple]:
    return [(h.action, h.phase, h.stable_version, h.canary_version, h.stage)
            for h in status.history]


def test_both_backends_take_the_same_steps(outcomes):
    local, kube = outcomes["local"]["status"], outcomes["kubernetes"]["status"]
    assert steps(local) == steps(kube)
    assert steps(local) == [
        ("promote", "Promoted", 1, None, ""),
        ("start", "Progressing", 1, 2, "1/2 edge"),
        ("advance", "Progressing", 1, 2, "2/2 region"),
        ("promote", "Promoted", 2, None, ""),
        ("start", "Progressing", 2, 3, "1/2 edge"),
        ("rollback", "RolledBack", 2, 3, "1/2 edge"),
    ]
    rollback = local.history[-1]
    assert {"p95_stable_ms", "p95_canary_ms"} <= set(rollback.numbers)  # the numbers it used


def test_both_backends_end_with_the_same_status(outcomes):
    local, kube = outcomes["local"]["status"], outcomes["kubernetes"]["status"]
    assert local.rollout.phase == kube.rollout.phase == "RolledBack"
    assert (local.rollout.stable_version, local.rollout.canary_version,
            local.rollout.stage_index) == (kube.rollout.stable_version,
                                           kube.rollout.canary_version,
                                           kube.rollout.stage_index) == (2, 3, 0)
    assert [a.sha256 for a in local.artifacts] == [a.sha256 for a in kube.artifacts]
    assert (local.weights, local.stage, local.weights_summary) == (
        kube.weights, kube.stage, kube.weights_summary)
    conditions = [[(c.type, c.status, c.reason) for c in s.conditions] for s in (local, kube)]
    assert conditions[0] == conditions[1] == [
        ("Ready", "True", "Serving"), ("Progressing", "False", "RolledBack"),
        ("Degraded", "True", "RolledBack")]
    assert local.observed_generation >= 1 and kube.observed_generation >= 1
    assert local.retiring == kube.retiring == ()


def test_both_backends_route_the_same_way(outcomes):
    def routes(table: routing.RoutingTable):  # all but the agents' addresses
        return {name: (model.policy, model.slo_ms,
                       {tier: (r.stable, r.canary, r.canary_weight, r.shadow_fraction)
                        for tier, r in model.tiers.items()})
                for name, model in table.models.items()}

    local, kube = outcomes["local"]["table"], outcomes["kubernetes"]["table"]
    assert routes(local) == routes(kube) == {
        NAME: ("slo-energy", 50.0, {"edge": (2, None, 0.0, 0.0),
                                    "regional": (2, None, 0.0, 0.0)})}


def test_both_backends_retire_the_same_versions_and_apply_the_batching(outcomes):
    for side in ("local", "kubernetes"):
        assert outcomes[side]["present"] == {2}, side
        assert outcomes[side]["queue_delays"] == {QUEUE_DELAY_US}, side


# One stage judged only at its end (min_duration_s = max_duration_s = 10 s),
# whose min_requests take 5 of its 10 s to gather (the fake agents answer
# 400 requests a second): a controller started afresh at 90% has one second
# left, 400 requests, too few without the samples gathered before it.
LATE_STAGE = [{"name": "edge", "weights": {"edge": 20}, "min_requests": 2000,
               "min_duration_s": 10.0, "max_duration_s": 10.0}]


def run_restart(side, artifacts, keep_samples: bool):
    """v2's one stage, the controller replaced at 90% of max_duration_s."""
    first = controller(side)
    side.apply(spec(artifacts[1], LATE_STAGE))
    drive(side, first, "v1 serving", lambda r: r.stable_version == 1)
    side.apply(spec(artifacts[2], LATE_STAGE))
    started = drive(side, first, "the v2 rollout", lambda r: r.canary_version == 2)
    late = started.rollout.stage_started_at + 0.9 * LATE_STAGE[0]["max_duration_s"]
    while time.time() < late:
        first.reconcile(NAME)
        time.sleep(0.1)
    before = side.status()
    if not keep_samples:
        side.drop_stage_samples()
    final = drive(side, controller(side), "v2's outcome",
                  lambda r: r.phase in ("Promoted", "RolledBack", "Paused"), 30)
    return before, final


@pytest.mark.parametrize("backend", ["local", "kubernetes"])
def test_a_controller_restarted_late_in_a_stage_goes_on_from_its_samples(
        backend, artifacts, tmp_path):
    with FakeKubeAPI() as api:
        def side():
            return Local(tmp_path / "state") if backend == "local" else Kube(api, "restart")
        kept = side()
        try:
            before, final = run_restart(kept, artifacts, keep_samples=True)
        finally:
            kept.close()
    samples = before.stage_samples
    canary = sum(s["requests"] for s in samples["series"]
                 if (s["tier"], s["version"]) == ("edge", 2))  # the stage's one tier
    assert canary >= LATE_STAGE[0]["min_requests"], canary  # gathered before the restart
    assert {c[0] for c in samples["cursors"]}  # and where each agent was read up to
    assert final.rollout.phase == "Promoted", final.rollout.message
    promoted = final.history[-1]
    assert promoted.action == "promote"
    assert promoted.numbers["canary_requests"] >= canary  # it went on from them


def test_without_its_samples_a_restarted_controller_would_run_out_of_time(
        artifacts, tmp_path):
    """The control: the same restart with the samples wiped from the status."""
    local = Local(tmp_path / "state")
    try:
        _, final = run_restart(local, artifacts, keep_samples=False)
    finally:
        local.close()
    # Out of time, too few requests to decide: onUndecided (pause, the default),
    # or none at all read since the restart (a slow machine's), which pauses too.
    assert final.rollout.phase == "Paused", final.rollout.message
    assert "undecided at maxDurationSeconds" in final.rollout.message or \
        "no canary traffic in 10 s" in final.rollout.message, final.rollout.message
