"""The demand a real router reports for tiers scaled to zero (Telemetry.Routes'
`unmet`), from requests sent with the real tritonclient: one hinted to a
sleeping tier is answered by the tier that is up and counted; one answered
slower than its SLO counts for the sleeping tiers above it; one kept to a
sleeping tier (or for a model asleep everywhere) waits, and ends at its
deadline when nothing wakes it. With two routers, the controller's reading
adds both routers' counts."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tiered.controller.judge import RolloutJudge
from tiered.local.processes import RouterProcess
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.protocol.security import ChannelCache


@pytest.fixture(scope="module")
def table(agent, tmp_path_factory):
    table = tmp_path_factory.mktemp("demand") / "routing.json"
    table.write_text(json.dumps({"version": 1, "models": {
        # regional and datacenter scaled to zero; edge up, its SLO beyond reach
        "add_sub": {"tiers": {"edge": {"agents": [agent.address]}},
                    "asleep": ["regional", "datacenter"], "slo_ms": 0.001},
        "mlp": {"tiers": {}, "asleep": ["edge"]}}}))
    return table


@pytest.fixture(scope="module")
def router(table):
    with RouterProcess(table) as process:
        yield process


def unmet(router: RouterProcess, model: str) -> dict[str, tuple[int, int]]:
    with grpc.insecure_channel(router.address) as channel:
        reply = tpb_grpc.TelemetryStub(channel).Routes(tpb.RoutesRequest(model_name=model),
                                                       timeout=10)
    return {d.tier: (d.requests, d.waiting) for d in reply.unmet}


def add_sub(client, headers=None, timeout_us=None):
    inputs = [grpcclient.InferInput(name, [1, 16], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    answer = client.infer("add_sub", inputs, headers=headers, timeout=timeout_us)
    return answer.get_response().parameters["tiered-tier"].string_param


def test_demand_for_sleeping_tiers_is_counted_and_held_requests_end_at_their_deadline(router):
    with grpcclient.InferenceServerClient(router.address) as client:
        # Hinted to a sleeping tier: edge answers, and regional's demand is counted;
        # every answer misses the unreachable SLO: demand for both tiers above edge.
        assert add_sub(client, {"tiered-tier": "regional"}) == "edge"
        assert add_sub(client) == "edge"
        assert unmet(router, "add_sub") == {"regional": (3, 0), "datacenter": (2, 0)}
        # Kept to a sleeping tier, nothing wakes it: held until its deadline.
        with pytest.raises(InferenceServerException, match="did not wake within"):
            add_sub(client, {"tiered-tier": "regional", "tiered-tier-strict": "true"},
                    timeout_us=300_000)
        # A model asleep on every tier: held too, counted for its cheapest tier.
        inputs = [grpcclient.InferInput("input", [1, 16], "FP32")]
        inputs[0].set_data_from_numpy(np.zeros((1, 16), np.float32))
        with pytest.raises(InferenceServerException, match="did not wake within"):
            client.infer("mlp", inputs, timeout=300_000)
    assert unmet(router, "mlp")["edge"][0] == 1


def test_the_judge_sums_the_unmet_demand_of_every_router(router, table):
    """Two routers, one table: each counts what it could not place, and the
    controller's reading of the load adds both, each router's counts from
    the first look on (what came before is its baseline)."""
    sleeping = {"regional": (), "datacenter": ()}  # no agent: only the unmet demand
    judge = RolloutJudge(ChannelCache())
    with RouterProcess(table) as second:
        routers = [router.address, second.address]
        assert {t: load.unmet for t, load in judge.loads("add_sub", sleeping, routers).items()
                } == {"regional": 0, "datacenter": 0}  # the baselines
        for address, count in ((router.address, 2), (second.address, 3)):
            with grpcclient.InferenceServerClient(address) as client:
                for _ in range(count):  # hinted to regional, and slower than the SLO
                    assert add_sub(client, {"tiered-tier": "regional"}) == "edge"
        loads = judge.loads("add_sub", sleeping, routers)
        assert {t: load.unmet for t, load in loads.items()} == {"regional": 10, "datacenter": 5}
        assert {t: load.unmet for t, load in judge.loads("add_sub", sleeping, routers).items()
                } == {"regional": 0, "datacenter": 0}  # nothing new since
