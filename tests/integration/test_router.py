"""A real router in front of three real agents (edge, regional, datacenter) on
loopback, driven by the unmodified tritonclient.

Every agent serves the same repository: `digits` versions 1 (v1), 2 (v2, a
retrained model that answers a little differently) and 3 (heavy, many times
the compute). Tests rewrite the routing table file and wait for the router to
load it; which agent answered is read from the agents' own statistics.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from tests.conftest import children, exited, sigterm_with_calls_in_flight
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import AgentProcess
from tiered.local.processes import RouterProcess as RouterCommand
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.router.forward import served_by

pytest.importorskip("torch")
TIERS = ("edge", "regional", "datacenter")
VERSIONS = {1: "v1", 2: "v2", 3: "heavy"}
SLOW = 4  # a version that makes any tier slow (slow_digits)


class RouterProcess(RouterCommand):
    def __init__(self, table: Path) -> None:
        super().__init__(table, extra_args=["--seed", "0"])


@pytest.fixture(scope="module")
def digits_repository(tmp_path_factory, digits_models) -> Path:
    root = tmp_path_factory.mktemp("router-repository")
    for version, variant in VERSIONS.items():
        shutil.copy(digits_models / f"digits-{variant}.onnx", model_file(root, "digits", version))
    slow_digits(model_file(root, "digits", SLOW))
    write_config(root, "digits", {"max_batch_size": 64, "version_policy": {"all": True}})
    return root


def slow_digits(path: Path) -> None:
    """A digits-shaped network some twenty times the light one's work: eight
    1024-wide layers (one shared weight), so a slow tier is slow beyond any
    noise a busy 2-core machine adds."""
    rng = np.random.default_rng(0)
    weights = {"w_in": rng.normal(0, 0.1, (64, 1024)), "w": rng.normal(0, 0.03, (1024, 1024)),
               "w_out": rng.normal(0, 0.03, (1024, 10))}
    nodes = [helper.make_node("Flatten", ["input"], ["x0"], axis=1),
             helper.make_node("MatMul", ["x0", "w_in"], ["h0"])]
    for layer in range(8):
        nodes.append(helper.make_node("MatMul", [f"h{layer}", "w"], [f"m{layer}"]))
        nodes.append(helper.make_node("Relu", [f"m{layer}"], [f"h{layer + 1}"]))
    nodes.append(helper.make_node("MatMul", ["h8", "w_out"], ["logits"]))
    graph = helper.make_graph(
        nodes, "slow_digits",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(w.astype(np.float32), name) for name, w in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.fixture(scope="module")
def agents(digits_repository):
    started = {tier: AgentProcess(tier, digits_repository).start() for tier in TIERS}
    yield started
    for process in started.values():
        process.stop()


@pytest.fixture(scope="module")
def table_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router") / "routing.yaml"


@pytest.fixture(scope="module")
def router(agents, table_path):
    write_table(table_path, table(agents, version=1))
    with RouterProcess(table_path) as process:
        process.table_version = 1
        yield process
        assert process.alive(), process.log_tail()


@pytest.fixture(scope="module")
def client(router):
    with grpcclient.InferenceServerClient(router.address) as c:
        yield c


def table(agents, version: int, policy: str = "slo-energy", tiers=None, **model) -> dict:
    tiers = tiers or {t: {"agents": [agents[t].address], "stable": 1} for t in TIERS}
    return {"version": version, "models": {"digits": {"policy": policy, "tiers": tiers,
                                                      **model}}}


def write_table(path: Path, document: dict) -> None:
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(document))
    os.replace(staging, path)  # the controller's way: never a half-written file


def metrics(router) -> dict[str, float]:
    text = urllib.request.urlopen(router.metrics_url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def metric(router, prefix: str) -> float:
    return sum(v for k, v in metrics(router).items() if k.startswith(prefix))


def use_table(router, table_path, document: dict) -> None:
    router.table_version += 1
    document["version"] = router.table_version
    write_table(table_path, document)
    deadline = time.monotonic() + 10
    while metric(router, "tiered_router_table_version") != router.table_version:
        assert time.monotonic() < deadline, router.log_tail()
        time.sleep(0.1)


def served(agents) -> dict[str, int]:
    counts = {}
    for tier, process in agents.items():
        with grpcclient.InferenceServerClient(process.address) as c:
            stats = c.get_inference_statistics("digits", as_json=True)["model_stats"]
            counts[tier] = sum(int(s.get("inference_count", 0)) for s in stats)
    return counts


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def images(batch: int = 1, seed: int = 0) -> np.ndarray:
    from sklearn.datasets import load_digits

    data = load_digits().images.astype(np.float32) / 16.0
    rows = np.random.default_rng(seed).choice(len(data), batch)
    return data[rows].reshape(batch, 1, 8, 8)


def inputs_of(array: np.ndarray) -> list[grpcclient.InferInput]:
    item = grpcclient.InferInput("input", list(array.shape), "FP32")
    item.set_data_from_numpy(array)
    return [item]


def confidence(repository: Path, array: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repository / "digits" / "1" / "model.onnx"))
    logits = session.run(None, {"input": array})[0]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).max(axis=1)


def test_router_serves_metadata_and_infer_like_an_agent(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits")
    assert not client.is_model_ready("nothing")
    assert client.get_server_metadata().name == "tiered-router"
    assert client.get_model_metadata("digits").inputs[0].name == "input"
    assert client.get_model_config("digits").config.max_batch_size == 64
    result = client.infer("digits", inputs_of(images(4)))
    assert result.as_numpy("logits").shape == (4, 10)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nothing", inputs_of(images()))
    assert caught.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("tier", TIERS)
def test_the_tier_hint_pins_the_request(client, agents, tier):
    before = served(agents)
    answers = [client.infer("digits", inputs_of(images()), headers={"tiered-tier": tier})
               for _ in range(5)]
    answers += [client.infer("digits", inputs_of(images()), parameters={"tiered-tier": tier})
                for _ in range(5)]
    assert delta(before, served(agents)) == {t: 10 if t == tier else 0 for t in TIERS}
    # Every answer names the tier that served it.
    assert {a.get_response().parameters["tiered-tier"].string_param for a in answers} == {tier}


def test_an_unknown_tier_hint_is_invalid_argument(client):
    with pytest.raises(InferenceServerException) as caught:
        client.infer("digits", inputs_of(images()), headers={"tiered-tier": "moon"})
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "tiered-tier" in caught.value.message()


def test_the_answer_is_the_agents_bytes_and_undecodable_bytes_are_invalid(router, agents,
                                                                         table_path):
    edge = {"edge": {"agents": [agents["edge"].address], "stable": 2}}
    use_table(router, table_path, table(agents, 0, tiers=edge))
    request = pb.ModelInferRequest(model_name="digits", id="same")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
    request.raw_input_contents.append(images().tobytes())
    answers = {}
    for target, asked in ((agents["edge"].address, "2"), (router.address, "")):
        request.model_version = asked  # the router asks the agent for the table's stable 2
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            answers[target] = call(request.SerializeToString(), timeout=10)
    # The agent's bytes as they came, with one parameter after them: the tier that answered.
    assert answers[router.address] == answers[agents["edge"].address] + served_by("edge")
    answer = pb.ModelInferResponse.FromString(answers[router.address])
    assert answer.model_version == "2"
    assert answer.parameters["tiered-tier"].string_param == "edge"
    with grpc.insecure_channel(router.address) as channel, \
            pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(b"\xff\xff", timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stream_infer_is_forwarded_per_request(router):
    results, done = [], threading.Event()

    def callback(result, error):
        results.append((result, error))
        if len(results) == 6:
            done.set()

    with grpcclient.InferenceServerClient(router.address) as c:
        c.start_stream(callback)
        for i in range(5):
            c.async_stream_infer("digits", inputs_of(images(2, seed=i)), request_id=str(i))
        c.async_stream_infer("nothing", inputs_of(images()), request_id="bad")
        assert done.wait(30)
        c.stop_stream()
    errors = [e for _, e in results if e is not None]
    assert len(errors) == 1 and "Request for unknown model: " in str(errors[0]) \
        and "not in the routing table" in str(errors[0])
    assert sorted(r.get_response().id for r, e in results if e is None) == list("01234")


def test_the_slo_choice_moves_off_a_tier_that_became_slow(router, client, agents, table_path):
    two = {t: {"agents": [agents[t].address], "stable": 1} for t in ("edge", "regional")}
    use_table(router, table_path, table(agents, 0, tiers=two, slo_ms=5))
    batch = inputs_of(images(64))
    for _ in range(2):  # both tiers measured warm: the router keeps a tier's latest span
        for tier in two:  # with answers, so the last must not hold a cold first call
            for _ in range(10):
                client.infer("digits", batch, headers={"tiered-tier": tier})
        time.sleep(1.5)  # a telemetry poll
    for _ in range(30):  # both tiers fast: energy decides
        client.infer("digits", batch)
    time.sleep(1.5)  # a telemetry poll
    before = served(agents)
    for _ in range(20):
        client.infer("digits", batch)
    first = max(("edge", "regional"), key=lambda t: delta(before, served(agents))[t])
    other = "regional" if first == "edge" else "edge"
    slowed = {**two, first: {"agents": [agents[first].address], "stable": SLOW}}
    use_table(router, table_path, table(agents, 0, tiers=slowed, slo_ms=5))
    # The router measures the slow version: once an agent's telemetry slot with
    # those answers has closed and been polled (up to about 2 s), it moves.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        probe = served(agents)
        for _ in range(10):
            client.infer("digits", batch)
        if delta(probe, served(agents))[other] >= 8 * 64:
            break
        time.sleep(0.5)
    before = served(agents)
    for _ in range(20):
        client.infer("digits", batch)
    moved = delta(before, served(agents))
    # Most of them moved (a request or two may still go out on a figure read
    # before the slow version's first telemetry span).
    assert moved[other] >= 12 * 64 and moved[other] > moved[first], (
        first, moved, router.log_tail())


def requests_by_version(process) -> dict[str, int]:
    """Requests one agent answered per version of digits, from its own statistics."""
    with grpcclient.InferenceServerClient(process.address) as c:
        stats = c.get_inference_statistics("digits", as_json=True)["model_stats"]
    return {s["version"]: figure(s, "inference_stats", "success", "count") for s in stats}


def test_a_live_stage_gets_unhinted_requests_the_policy_sends_elsewhere(router, client, agents,
                                                                        table_path):
    # The README's case: a stage on edge (20% canary) while slo-energy sends
    # every un-hinted request to another tier. Here edge's stable version is
    # the slow one, so it misses the SLO and regional takes everything.
    staged = {"edge": {"agents": [agents["edge"].address], "stable": SLOW, "canary": 2,
                       "canary_weight": 0.2},
              "regional": {"agents": [agents["regional"].address], "stable": 1}}
    use_table(router, table_path, table(agents, 0, tiers=staged, slo_ms=5, stage_floor=0))
    wide = inputs_of(images(64))

    def measure() -> None:
        """Both tiers measured on wide batches: slow edge, fast regional. The
        router forgets a figure 10 s old (STALE_AFTER_S), and a tier it knows
        nothing of meets any SLO: each part below measures again first."""
        for tier in staged:
            for _ in range(4):
                client.infer("digits", wide, headers={"tiered-tier": tier})

    # Once the router has polled those figures (about 1 s; longer on a busy
    # machine), edge's hold while it serves nothing. The floor off: the stage
    # starves (a request may go out on a figure read before that poll).
    one = inputs_of(images())
    deadline = time.monotonic() + 15
    while True:
        measure()
        before = requests_by_version(agents["edge"])
        for _ in range(20):
            client.infer("digits", one)
        starved = delta(before, requests_by_version(agents["edge"]))
        if sum(starved.values()) <= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sum(starved.values()) <= 2, (starved, router.log_tail())

    use_table(router, table_path, table(agents, 0, tiers=staged, slo_ms=5))  # floor: default
    measure()
    floored = metric(router, "tiered_router_stage_floor_total")
    before = requests_by_version(agents["edge"])
    for _ in range(90):
        client.infer("digits", one)
    got = delta(before, requests_by_version(agents["edge"]))
    # About a third of the requests (30), a fifth of those to the canary.
    assert sum(got.values()) >= 15 and got.get("2", 0) > 0, (got, router.log_tail())
    # The counter counts the requests the floor moved. Once edge's fast canary
    # answers reach its telemetry, the policy may choose edge by itself: those
    # are not the floor's, so the count lies between one and what edge answered.
    moved = metric(router, "tiered_router_stage_floor_total") - floored
    assert 0 < moved <= sum(got.values()), (moved, got)
    # A tier hint is never moved.
    before = requests_by_version(agents["edge"])
    for _ in range(10):
        client.infer("digits", one, headers={"tiered-tier": "regional"})
    assert sum(delta(before, requests_by_version(agents["edge"])).values()) == 0


def test_cascade_escalates_unsure_answers_only(router, client, agents, table_path,
                                               digits_repository):
    use_table(router, table_path, table(
        agents, 0, policy="cascade",
        cascade={"tiers": ["edge", "regional", "datacenter"], "threshold": 0.9}))
    pool = images(400, seed=3)
    sure = pool[confidence(digits_repository, pool) > 0.99][:5]
    noise = np.random.default_rng(4).random((400, 1, 8, 8), dtype=np.float32)
    unsure = noise[confidence(digits_repository, noise) < 0.6][:5]
    assert len(sure) == 5 and len(unsure) == 5
    escalations = metric(router, "tiered_router_escalations_total")
    before = served(agents)
    for image in sure:
        client.infer("digits", inputs_of(image[None]))
    assert delta(before, served(agents)) == {"edge": 5, "regional": 0, "datacenter": 0}
    before = served(agents)
    for image in unsure:
        client.infer("digits", inputs_of(image[None]))
    # Every tier runs version 1, so an unsure answer stays unsure all the way up.
    assert delta(before, served(agents)) == {"edge": 5, "regional": 5, "datacenter": 5}
    assert metric(router, "tiered_router_escalations_total") - escalations == 10


async def _versions_by_key(address: str, keys: list[str], concurrency: int = 32) -> list[str]:
    array = images()
    async with aioclient.InferenceServerClient(address) as c:
        out: list[str] = []
        for start in range(0, len(keys), concurrency):
            calls = []
            for key in keys[start:start + concurrency]:
                item = aioclient.InferInput("input", list(array.shape), "FP32")
                item.set_data_from_numpy(array)
                calls.append(c.infer("digits", [item], headers={"tiered-key": key}))
            out.extend(r.get_response().model_version for r in await asyncio.gather(*calls))
    return out


def test_canary_split_is_sticky_and_near_its_weight(router, agents, table_path):
    edge = {"edge": {"agents": [agents["edge"].address], "stable": 1, "canary": 2,
                     "canary_weight": 0.1}}
    use_table(router, table_path, table(agents, 0, tiers=edge))
    keys = [f"user-{i}" for i in range(5000)]
    versions = asyncio.run(_versions_by_key(router.address, keys))
    share = versions.count("2") / len(versions)
    assert abs(share - 0.1) <= 0.02, share
    assert set(versions) == {"1", "2"}
    again = asyncio.run(_versions_by_key(router.address, keys[:300]))
    assert again == versions[:300]  # a key keeps its version


def agreement(router, model: str = "digits", version: str = "2") -> tpb.AgreementResponse:
    with grpc.insecure_channel(router.address) as channel:
        return tpb_grpc.TelemetryStub(channel).Agreement(
            tpb.AgreementRequest(model_name=model, model_version=version), timeout=10)


def compared(response: tpb.AgreementResponse) -> dict[str, tuple[int, int]]:
    return {t.tier: (t.agreed, t.disagreed) for t in response.tiers}


def test_shadowing_counts_agreement_without_touching_answers(router, client, agents,
                                                             table_path):
    edge = {"edge": {"agents": [agents["edge"].address], "stable": 1, "canary": 2,
                     "shadow_fraction": 1.0}}
    use_table(router, table_path, table(agents, 0, tiers=edge))
    before = compared(agreement(router)).get("edge", (0, 0))
    for i in range(20):
        result = client.infer("digits", inputs_of(images(seed=i)))
        assert result.get_response().model_version == "1"
    # What a controller reads to judge the canary: typed counts over gRPC.
    deadline = time.monotonic() + 10
    while sum(compared(agreement(router)).get("edge", (0, 0))) - sum(before) < 20:
        assert time.monotonic() < deadline, router.log_tail()
        time.sleep(0.1)
    after = agreement(router)
    assert set(compared(after)) == {"edge"}
    agreed, disagreed = (a - b for a, b in zip(compared(after)["edge"], before, strict=True))
    assert agreed + disagreed == 20, (agreed, disagreed)  # every shadow compared once
    # v1 and v2 both read digits well: they agree on most real images.
    assert agreed >= 15, (agreed, disagreed)
    # Dashboards see the same counts (the exposition lists labels alphabetically).
    for result, count in zip(("agree", "disagree"), compared(after)["edge"], strict=True):
        assert metric(router, f'tiered_router_shadow_total{{model="digits",result="{result}",'
                              f'tier="edge",version="2"}}') == count
    # A version or model never shadowed is no error: it has no tiers.
    assert not agreement(router, version="7").tiers
    assert not agreement(router, model="nothing").tiers
    # A restarted router (same --seed) reads as another instance, counting from zero.
    assert after.instance == agreement(router).instance
    with RouterProcess(table_path) as restarted:
        fresh = agreement(restarted)
    assert fresh.instance and fresh.instance != after.instance and not fresh.tiers


def test_the_router_keeps_no_stats_of_its_own(router):
    with grpc.insecure_channel(router.address) as channel, \
            pytest.raises(grpc.RpcError) as caught:
        tpb_grpc.TelemetryStub(channel).Stats(tpb.StatsRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_saturated_agents_answer_resource_exhausted_at_once(router, agents, table_path):
    edge = {"edge": {"agents": [agents["edge"].address], "stable": 3}}
    use_table(router, table_path, table(agents, 0, tiers=edge, max_in_flight=1))
    array = images(64)

    async def burst() -> list[str]:
        async with aioclient.InferenceServerClient(router.address) as c:
            item = aioclient.InferInput("input", list(array.shape), "FP32")
            item.set_data_from_numpy(array)
            outcomes = await asyncio.gather(*(c.infer("digits", [item]) for _ in range(8)),
                                            return_exceptions=True)
        return ["ok" if not isinstance(o, Exception) else o.status() for o in outcomes]

    outcomes = asyncio.run(burst())
    assert "ok" in outcomes
    assert "StatusCode.RESOURCE_EXHAUSTED" in outcomes


def test_the_deadline_travels_downstream(router, client, agents, table_path):
    edge = {"edge": {"agents": [agents["edge"].address], "stable": 3}}
    use_table(router, table_path, table(agents, 0, tiers=edge))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("digits", inputs_of(images(64)), client_timeout=0.001)
    assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"


def test_an_invalid_table_is_rejected_and_the_last_good_one_serves(router, client, agents,
                                                                   table_path):
    use_table(router, table_path, table(agents, 0))
    good = router.table_version
    write_table(table_path, {"version": good + 1, "models": {"digits": {"tiers": {
        "edge": {"agents": [agents["edge"].address], "canary_weight": 0.5}}}}})
    deadline = time.monotonic() + 10
    while "routing table rejected" not in router.log():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert re.search(r"canary_weight: is above 0 but no canary version", router.log())
    assert metric(router, "tiered_router_table_version") == good
    client.infer("digits", inputs_of(images()))


def test_an_agent_killed_mid_traffic_costs_no_client_error(router, agents, table_path,
                                                           digits_repository):
    spare = AgentProcess("edge", digits_repository).start()
    try:
        edge = {"edge": {"agents": [agents["edge"].address, spare.address], "stable": 1}}
        use_table(router, table_path, table(agents, 0, tiers=edge))
        failures: list[Exception] = []
        answered = 0
        stop = threading.Event()

        def traffic() -> None:
            nonlocal answered
            with grpcclient.InferenceServerClient(router.address) as c:
                while not stop.is_set():
                    try:
                        c.infer("digits", inputs_of(images()))
                        answered += 1
                    except InferenceServerException as error:
                        failures.append(error)

        threads = [threading.Thread(target=traffic) for _ in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        spare.kill()
        time.sleep(1.5)
        stop.set()
        for thread in threads:
            thread.join(30)
        assert not failures, failures[:3]
        # Traffic flowed through the kill: about 100 answers on an idle
        # machine, half that beside other test workers; 10 is far from either.
        assert answered > 10
    finally:
        spare.kill()


def stats_by_version(client, *args) -> dict[str, dict]:
    stats = client.get_inference_statistics("digits", *args, as_json=True)["model_stats"]
    return {s["version"]: s for s in stats}


def figure(row: dict | None, *path: str) -> int:
    """One number of a statistics row as JSON (int64s are strings; zeros are left out)."""
    value = row or {}
    for key in path:
        value = value.get(key, {})
    return int(value or 0)


def test_statistics_count_the_routers_answers_and_failures(router, client, agents, table_path):
    edge = {"edge": {"agents": [agents["edge"].address], "stable": 1, "canary": 2,
                     "canary_weight": 0.5}}
    use_table(router, table_path, table(agents, 0, tiers=edge))
    before = stats_by_version(client)
    answered = [client.infer("digits", inputs_of(images(3)), headers={"tiered-key": f"k{i}"})
                .get_response().model_version for i in range(20)]
    with pytest.raises(InferenceServerException) as caught:
        client.infer("digits", inputs_of(images()), headers={"tiered-slo-ms": "soon"})
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    after = stats_by_version(client)
    assert set(answered) == {"1", "2"}
    # perf_analyzer reads versions as integers: failures sit under "0", not "".
    assert all(version.isdigit() for version in after)
    for version in ("1", "2"):
        count = answered.count(version)
        for path in (("inference_stats", "success", "count"), ("inference_count",),
                     ("execution_count",)):
            assert figure(after[version], *path) - figure(before.get(version), *path) == count
        assert figure(after[version], "inference_stats", "success", "ns") > \
            figure(before.get(version), "inference_stats", "success", "ns")
        assert figure(after[version], "inference_stats", "fail", "count") == 0
        assert abs(figure(after[version], "last_inference") - time.time() * 1000) < 60_000
    failed = figure(after["0"], "inference_stats", "fail", "count") - \
        figure(before.get("0"), "inference_stats", "fail", "count")
    assert failed == 1
    assert figure(after["0"], "inference_stats", "fail", "ns") > 0
    assert set(stats_by_version(client, "2")) == {"2"}
    with pytest.raises(InferenceServerException) as caught:
        client.get_inference_statistics("nothing")
    assert caught.value.status() == "StatusCode.NOT_FOUND" and "name" in caught.value.message()


def test_repository_index_lists_the_table_with_each_models_state(router, client, agents,
                                                                 table_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    document = table(agents, 0)
    document["models"]["ghost"] = {"tiers": {"edge": {"agents": [dead]}}}
    document["models"]["absent"] = {"tiers": {"edge": {"agents": [agents["edge"].address]}}}
    use_table(router, table_path, document)
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert {name: m.get("state") for name, m in index.items()} == {
        "digits": "READY", "ghost": "UNAVAILABLE", "absent": "UNAVAILABLE"}
    assert "ModelReady" in index["ghost"]["reason"]
    with grpc.insecure_channel(router.address) as channel:
        ready = pb_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
            pb.RepositoryIndexRequest(ready=True), timeout=10)
    assert [m.name for m in ready.models] == ["digits"]


def test_loading_and_unloading_are_the_controllers_job(client):
    for call in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException) as caught:
            call("digits")
        assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "controller" in caught.value.message()


def test_sigterm_answers_every_call_the_router_has_taken_in(tmp_path):
    """Every call sent to the router before its SIGTERM is answered, however
    many wait unread in gRPC's queue (the agents' drain, `protocol/drain.py`;
    run it beside a busy loop to see them pile up), and it exits 0."""
    from tiered.models import zoo

    zoo.resnet18(model_file(tmp_path, "slow", 1), image_size=64, num_classes=10)
    write_config(tmp_path, "slow", {"max_batch_size": 1, "max_queue_size": 128})
    path = tmp_path / "routing.yaml"
    with AgentProcess("edge", tmp_path) as agent:
        write_table(path, {"version": 1, "models": {"slow": {
            "policy": "slo-energy", "tiers": {"edge": {"agents": [agent.address], "stable": 1}}}}})
        router = RouterProcess(path).start()
        image = grpcclient.InferInput("input", [1, 3, 64, 64], "FP32")
        image.set_data_from_numpy(np.zeros((1, 3, 64, 64), np.float32))
        in_flight, outcomes, code = sigterm_with_calls_in_flight(router, "slow", [image])
    assert in_flight > 0, "every call was answered before the signal: nothing was drained"
    failed = [str(o) for o in outcomes if isinstance(o, Exception)]
    assert not failed, f"{len(failed)} of {in_flight} calls in flight failed: {failed[:3]}"
    assert code == 0, router.log_tail()


def _exits(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_workers_share_the_ports_and_each_answers_its_share(agents, tmp_path):
    path = tmp_path / "routing.yaml"
    write_table(path, table(agents, version=1))
    with RouterCommand(path, extra_args=["--workers", "2"]) as router:
        found = re.search(r"tiered router worker 1 of 2 on 127\.0\.0\.1:(\d+); REST on "
                          r"http://127\.0\.0\.1:(\d+); metrics on (\S+)", router.log())
        assert found, router.log_tail()
        assert (int(found.group(1)), int(found.group(2))) == (router.port, router.http_port)
        urls = [router.metrics_url, found.group(3)]
        assert urls[0] != urls[1]
        for n in range(24):  # each on a connection of its own, gRPC and REST in turn
            if n % 2:
                with grpcclient.InferenceServerClient(router.address) as client:
                    client.infer("digits", inputs_of(images()))
            else:
                body = json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8],
                                               "datatype": "FP32",
                                               "data": images().ravel().tolist()}]}).encode()
                request = urllib.request.Request(
                    f"http://{router.http_address}/v2/models/digits/infer", data=body,
                    headers={"Content-Type": "application/json", "Connection": "close"})
                assert urllib.request.urlopen(request, timeout=30).status == 200

        def answered(url: str) -> float:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("tiered_router_requests_total"))

        shares = [answered(url) for url in urls]
        assert sum(shares) == 24 and min(shares) > 0, shares  # all on one: odds of 2 in 2^24
        worker = sorted(children(router.pid))
        assert len(worker) == 1
        assert router.stop() == 0
    assert _exits(worker[0], 5), "stopping the first router left its worker running"


def test_a_worker_stops_when_its_first_router_is_killed(agents, tmp_path):
    path = tmp_path / "routing.yaml"
    write_table(path, table(agents, version=1))
    router = RouterCommand(path, extra_args=["--workers", "2"]).start()
    worker = sorted(children(router.pid))
    os.kill(router.pid, 9)
    router.stop()
    assert len(worker) == 1 and _exits(worker[0], 30), "a killed router's worker lives on"


@pytest.mark.parametrize("flag", ["--workers", "--agent-connections"])
def test_workers_and_agent_connections_must_be_at_least_one(tmp_path, flag):
    import subprocess
    import sys

    path = tmp_path / "routing.yaml"
    write_table(path, {"version": 1, "models": {}})
    done = subprocess.run([sys.executable, "-m", "tiered", "router", "--routing-table",
                           str(path), "--insecure", flag, "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{flag}: at least 1, got 0" in done.stderr
