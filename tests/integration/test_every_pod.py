"""The judge reads every pod of a tier and every router, not one of each.

On Kubernetes a version's agents sit behind a headless Service and the
routers behind another; dialling a Service reaches one pod. Here four real
agent processes stand for one stable pod and three canary pods of one tier,
and two real routers for the router Deployment; the API test double holds
the EndpointSlices that list them, as the endpoint controller would. Canary
requests reach one canary pod only, the routers shadow stable traffic to
the canary: the judge, through the Kubernetes backend, counts every request
of every pod and the sum of both routers' shadow comparisons, and what a pod
that joins during the stage (the tier scaling up) answered before its first
read.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("kubernetes")
pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as triton  # noqa: E402
from kubernetes import client  # noqa: E402

from tests.kubeapi import FakeKubeAPI  # noqa: E402
from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.controller.judge import RolloutJudge  # noqa: E402
from tiered.controller.kube import render  # noqa: E402
from tiered.controller.kube.backend import SERVICE_NAME_LABEL, KubeBackend  # noqa: E402
from tiered.local.processes import AgentProcess, RouterProcess  # noqa: E402
from tiered.models import zoo  # noqa: E402
from tiered.protocol import routing  # noqa: E402
from tiered.protocol import telemetry_pb2 as tpb  # noqa: E402
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc  # noqa: E402
from tiered.protocol.security import ChannelCache  # noqa: E402
from tiered.rollout.spec import load_tiered_model  # noqa: E402
from tiered.rollout.status import RolloutStatus  # noqa: E402
from tiered.router.forward import ChannelPool  # noqa: E402
from tiered.router.observations import Observer, TelemetryPoller, pods_behind  # noqa: E402
from tiered.telemetry.recorder import SLOT_S  # noqa: E402

NAMESPACE, MODEL = "pods", "mlp"
CANARY_DIRECT, STABLE_DIRECT, THROUGH_ROUTER = 30, 20, (12, 8)
JOINED_DIRECT = 7  # answered by a canary pod that joins during the stage


def repository(root: Path, version: int) -> Path:
    zoo.mlp(model_file(root, MODEL, version), seed=version)
    write_config(root, MODEL, {"max_batch_size": 16})
    return root


def endpoint_slice(service: str, address: str, index: int) -> dict:
    host, port = address.rsplit(":", 1)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{service}-{index}", "namespace": NAMESPACE,
                         "labels": {SERVICE_NAME_LABEL: service}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
            "ports": [{"name": "grpc", "port": int(port), "protocol": "TCP"}]}


def infer(address: str, version: str, count: int) -> None:
    with triton.InferenceServerClient(address) as agent:
        for i in range(count):
            data = triton.InferInput("input", [1, 16], "FP32")
            data.set_data_from_numpy(np.random.default_rng(i).random((1, 16), np.float32))
            agent.infer(MODEL, [data], model_version=version)


def shadowed(router: RouterProcess) -> int:
    reply = tpb_grpc.TelemetryStub(ChannelCache()(router.address)).Agreement(
        tpb.AgreementRequest(model_name=MODEL, model_version="2"), timeout=10)
    return sum(t.agreed + t.disagreed for t in reply.tiers)


def test_the_judge_counts_every_pod_and_every_router(tmp_path):
    stable_repo = repository(tmp_path / "v1", 1)
    canary_repo = repository(tmp_path / "v2", 2)
    agents = [AgentProcess("edge", stable_repo)] + [AgentProcess("edge", canary_repo)
                                                     for _ in range(3)]
    for agent in agents:
        agent.start()
    stable, canaries = agents[0], agents[1:]
    table = routing.RoutingTable(1, {MODEL: routing.ModelRoute({"edge": routing.TierRoute(
        (stable.address,), 1, canary=2, shadow_fraction=1.0,
        canary_agents=tuple(c.address for c in canaries))})})
    table_path = tmp_path / "routing.yaml"
    table_path.write_text(routing.dump_table(table))
    routers = [RouterProcess(table_path, metrics_port=None) for _ in range(2)]
    for router in routers:
        router.start()
    try:
        with FakeKubeAPI() as api:
            kube = client.ApiClient(api.client_configuration())
            discovery = client.DiscoveryV1Api(kube)
            slices = [(render.workload_name(MODEL, "edge", 1), [stable]),
                      (render.workload_name(MODEL, "edge", 2), canaries),
                      ("tiered-router", routers)]
            for service, processes in slices:
                for index, process in enumerate(processes):
                    discovery.create_namespaced_endpoint_slice(
                        NAMESPACE, endpoint_slice(service, process.address, index))
            settings = render.ClusterSettings(namespace=NAMESPACE,
                                              router=f"tiered-router.{NAMESPACE}.svc:8001")
            backend = KubeBackend(settings, kube, {}, lambda _: None)
            spec = load_tiered_model({
                "name": MODEL, "artifact": {"uri": "/m.onnx", "sha256": "a" * 64},
                "tiers": {"edge": {}}, "rollout": {"stages": [
                    {"name": "edge", "weights": {"edge": 10}}]}})
            rollout = RolloutStatus(stable_version=1, canary_version=2)
            pods = backend.agents(spec, rollout)
            assert sorted(pods["edge"]) == sorted(a.address for a in agents)
            assert sorted(backend.routers()) == sorted(r.address for r in routers)

            judge = RolloutJudge(ChannelCache())

            def read():
                return judge.read(spec, rollout, backend.agents(spec, rollout),
                                  backend.routers(), time.time()).measurements

            read()  # the stage's first look: cursors and the agreement baseline
            infer(canaries[1].address, "2", CANARY_DIRECT)  # one canary pod of three
            infer(stable.address, "1", STABLE_DIRECT)
            for router, count in zip(routers, THROUGH_ROUTER, strict=True):
                infer(router.address, "", count)
            shadows = sum(THROUGH_ROUTER)
            expected = (STABLE_DIRECT + shadows, CANARY_DIRECT + shadows, shadows)
            assert wait_for_counts(read, expected), [shadowed(r) for r in routers]

            # The tier scales up during the stage: a new canary pod answers
            # before the judge first reads it, and those answers count too.
            joined = AgentProcess("edge", canary_repo)
            agents.append(joined)
            joined.start()
            discovery.create_namespaced_endpoint_slice(NAMESPACE, endpoint_slice(
                render.workload_name(MODEL, "edge", 2), joined.address, len(canaries)))
            infer(joined.address, "2", JOINED_DIRECT)
            time.sleep(2 * SLOT_S)  # their slot closes before the judge first reads the pod
            assert joined.address in backend.agents(spec, rollout)["edge"]
            assert wait_for_counts(read, (*expected[:1], expected[1] + JOINED_DIRECT,
                                          *expected[2:]))
    finally:
        for process in (*routers, *agents):
            process.stop()


def wait_for_counts(read, expected: tuple[int, int, int], timeout_s: float = 30) -> bool:
    """Read until the stage counts `expected` (stable requests, canary
    requests, shadow comparisons): an agent's Stats hold a request once its
    time slot has closed. Fails at once on counting more."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read()
        seen = (m.tiers["edge"].stable.requests, m.tiers["edge"].canary.requests,
                m.shadow_compared)
        assert all(s <= e for s, e in zip(seen, expected, strict=True)), (seen, expected)
        if seen == expected:
            return True
        assert time.monotonic() < deadline, (seen, expected)
        time.sleep(0.5)


class Recording(Observer):
    """An Observer that keeps every response it is given, per address."""

    def __init__(self) -> None:
        super().__init__(time.monotonic)
        self.responses: dict[str, list[tpb.StatsResponse]] = {}

    def record_stats(self, agent: str, response: tpb.StatsResponse) -> None:
        self.responses.setdefault(agent, []).append(response)
        super().record_stats(agent, response)


def answered(response: tpb.StatsResponse) -> int:
    return sum(sum(v.latency.count) for v in response.versions)


def test_the_routers_poller_reads_every_pod_behind_a_name(tmp_path):
    """A name that resolves to two real agents (a headless Service's pods) is
    read pod by pod, each from its own cursor, and observed as their sum."""
    pods = [AgentProcess("edge", repository(tmp_path / f"pod{i}", 1)) for i in range(2)]
    for pod in pods:
        pod.start()
    service = "mlp-edge-v1.pods.svc:8001"

    async def resolve(address: str) -> tuple[str, ...]:
        return tuple(p.address for p in pods) if address == service else (address,)

    try:
        observer = Recording()
        poller = TelemetryPoller(observer, ChannelPool().dial, lambda: [service],
                                 resolve=resolve)
        loop = asyncio.new_event_loop()
        loop.run_until_complete(poller.poll_once())  # cursors start now
        infer(pods[0].address, "1", 30)
        infer(pods[1].address, "1", 10)
        time.sleep(2 * SLOT_S + 0.2)  # the requests' slots have closed
        loop.run_until_complete(poller.poll_once())
        loop.run_until_complete(poller.poll_once())  # nothing new since the cursors
        _, read, again = observer.responses[service]
        assert answered(read) == 40  # both pods, each counted once
        assert answered(again) == 0
        assert observer.observe(service, MODEL).p95_s is not None
        loop.run_until_complete(poller.close())
        loop.close()
    finally:
        for pod in pods:
            pod.stop()


def test_a_name_is_resolved_to_its_addresses_and_an_ip_is_kept():
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(pods_behind("10.1.2.3:8001")) == ("10.1.2.3:8001",)
        assert loop.run_until_complete(pods_behind("[::1]:8001")) == ("[::1]:8001",)
        assert "127.0.0.1:8001" in loop.run_until_complete(pods_behind("localhost:8001"))
        unknown = "no-such-host.invalid:8001"
        assert loop.run_until_complete(pods_behind(unknown)) == (unknown,)
    finally:
        loop.close()
