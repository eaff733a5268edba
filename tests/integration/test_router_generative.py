"""Generative models through a real router: real agents on loopback serving a
tiny INT4 Llama (onnxruntime-genai) and a small classifier, driven by the
unmodified tritonclient.

A streamed request to a decoupled model goes to one agent on a stream of its
own and comes back one response per token with Triton's final flag; a
cancelled stream frees the agent's sequence (shown by admission on a
one-slot model, not by the clock); failover happens before the first token
only. Which agent served is read from the agents' own statistics.
"""

from __future__ import annotations

import json
import math
import os
import queue
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import add_generative
from tests.generation import (
    PROMPT,
    Stream,
    generate,
    ids_of,
    is_final,
    prompt_input,
    text_of,
)
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import AgentProcess, RouterProcess
from tiered.models import zoo
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc

EDGE = {"tiered-tier": "edge"}  # a hint, a preference: another tier answers when edge cannot
WAIT_MS = 600  # model "one": how long a request waits for its single slot; a long
# generation holds it for well over that, so a request admitted at all was
# admitted because the slot was freed


@pytest.fixture(scope="module")
def repository(generative_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("router-generative-repository")
    add_generative(root, "tiny", generative_model, {"engine": {"max_sequences": 4},
                                                    "version_policy": {"all": True}})
    (root / "tiny" / "2").symlink_to(root / "tiny" / "1", target_is_directory=True)
    add_generative(root, "one", generative_model, {
        "engine": {"max_sequences": 1}, "max_queue_size": 1,
        "generation": {"max_queue_wait_ms": WAIT_MS}})
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    write_config(root, "mlp", {"max_batch_size": 16})
    return root


@pytest.fixture(scope="module")
def agents(repository):
    """Two edge agents and a regional one."""
    started = {name: AgentProcess(tier, repository).start()
               for name, tier in (("edge", "edge"), ("edge2", "edge"), ("regional", "regional"))}
    yield started
    for process in started.values():
        process.stop()


@pytest.fixture(scope="module")
def table_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router-generative") / "routing.json"


@pytest.fixture(scope="module")
def router(agents, table_path):
    write_table(table_path, 1, tiers(agents))
    with RouterProcess(table_path, extra_args=["--seed", "0"]) as process:
        process.table_version = 1
        yield process
        assert process.alive(), process.log_tail()


@pytest.fixture()
def client(router):
    with grpcclient.InferenceServerClient(router.address) as c:
        yield c


def tiers(agents, edge=("edge",), regional=(), **edge_route) -> dict:
    """The tiers of a table: by default the first edge agent alone."""
    out = {}
    if edge:
        out["edge"] = {"agents": [a if ":" in a else agents[a].address for a in edge],
                       **edge_route}
    if regional:
        out["regional"] = {"agents": [a if ":" in a else agents[a].address for a in regional]}
    return out


def write_table(path: Path, version: int, model_tiers: dict, **route) -> None:
    models = {name: {"tiers": model_tiers, **route} for name in ("tiny", "one", "mlp")}
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps({"version": version, "models": models}))
    os.replace(staging, path)


def metrics(router) -> dict[str, float]:
    text = urllib.request.urlopen(router.metrics_url, timeout=10).read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def metric(router, prefix: str) -> float:
    return sum(v for k, v in metrics(router).items() if k.startswith(prefix))


def use_table(router, table_path, model_tiers: dict, **route) -> None:
    router.table_version += 1
    write_table(table_path, router.table_version, model_tiers, **route)
    wait_for(lambda: metric(router, "tiered_router_table_version") == router.table_version,
             router, "the router to load the table")


def wait_for(condition, router, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited for {what}\n{router.log_tail()}"
        time.sleep(0.1)


def served_tier(result) -> str:
    return result.get_response().parameters["tiered-tier"].string_param


def streamed(client, **parameters) -> list:
    stream = Stream(client)
    try:
        stream.send(**parameters)
        return stream.until_final()
    finally:
        client.stop_stream()


def agent_counts(process, model: str = "tiny") -> tuple[int, int]:
    """(requests answered, sequence steps run: one per token) of `model` on the agent."""
    with grpcclient.InferenceServerClient(process.address) as c:
        stats = c.get_inference_statistics(model, as_json=True)["model_stats"]
    return (sum(int(s["inference_stats"].get("success", {}).get("count", 0)) for s in stats),
            sum(int(s.get("inference_count", 0)) for s in stats))


def test_a_generative_stream_is_one_response_per_token_with_the_final_flag(router, client,
                                                                          agents):
    results = streamed(client, max_tokens=16)
    assert len(results) == 16
    assert [is_final(r) for r in results] == [False] * 15 + [True]
    assert all(len(r.as_numpy("token_ids")) == 1 for r in results)
    assert {served_tier(r) for r in results} == {"edge"}
    with grpcclient.InferenceServerClient(agents["edge"].address) as direct:
        whole = generate(direct, max_tokens=16)
    assert "".join(text_of(r) for r in results) == text_of(whole) != ""
    assert [ids_of(r)[0] for r in results] == ids_of(whole)
    # Triton's empty final response, when the client asks for it, comes through too.
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("tiny", [prompt_input()], enable_empty_final_response=True,
                                  parameters={"max_tokens": 4})
        flags = []
        while not flags or not flags[-1]:
            result, error = responses.get(timeout=60)
            assert error is None, error
            flags.append(is_final(result))
    finally:
        client.stop_stream()
    assert flags == [False] * 4 + [True] and not result.get_response().outputs
    # Counted once each, with the time to the first token as the router saw it.
    found = metrics(router)
    first = {k: v for k, v in found.items()
             if k.startswith("tiered_router_time_to_first_token_seconds_count")
             and 'model="tiny"' in k}
    assert sum(first.values()) >= 2 and all('tier="edge"' in k for k in first), first


def test_a_stream_stays_on_one_agent(router, client, agents, table_path):
    use_table(router, table_path, tiers(agents, edge=("edge", "edge2"), regional=()))
    try:
        chosen = []
        for _ in range(6):
            before = {name: agent_counts(agents[name]) for name in ("edge", "edge2")}
            assert len(streamed(client, max_tokens=12)) == 12
            after = {name: agent_counts(agents[name]) for name in ("edge", "edge2")}
            moved = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1])
                     for name in before}
            # One agent answered the request and ran all of its twelve tokens.
            assert sorted(moved.values()) == [(0, 0), (1, 12)], moved
            chosen.append(max(moved, key=lambda name: moved[name][0]))
        assert set(chosen) == {"edge", "edge2"}, chosen  # both were chosen, each kept its stream
    finally:
        use_table(router, table_path, tiers(agents))


def test_cancelling_a_stream_frees_the_agents_slot(router, client):
    stream = Stream(client)
    stream.send("one", max_tokens=4000)  # seconds of work on this model
    assert len(ids_of(stream.next())) == 1  # it is running
    client.stop_stream(cancel_requests=True)
    # Refused (RESOURCE_EXHAUSTED) after WAIT_MS if the cancelled sequence still held it.
    assert len(ids_of(generate(client, "one", max_tokens=3))) == 3


def test_streamed_requests_of_other_models_are_answered_as_before(client):
    stream = Stream(client)
    try:
        for index in range(4):
            item = grpcclient.InferInput("input", [1, 16], "FP32")
            item.set_data_from_numpy(np.full((1, 16), index, np.float32))
            client.async_stream_infer("mlp", [item], request_id=str(index))
        results = [stream.next() for _ in range(4)]
    finally:
        client.stop_stream()
    assert sorted(r.get_response().id for r in results) == ["0", "1", "2", "3"]
    for result in results:
        assert "triton_final_response" not in result.get_response().parameters
        assert served_tier(result) == "edge"
        assert result.as_numpy("probabilities").shape[0] == 1


def test_rest_infer_through_the_router_returns_the_whole_text(router, client):
    whole = generate(client, max_tokens=10)
    with httpclient.InferenceServerClient(router.http_address) as rest:
        item = httpclient.InferInput("text_input", [1], "BYTES")
        item.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
        answer = rest.infer("tiny", [item], parameters={"max_tokens": 10})
    assert answer.as_numpy("text_output")[0].decode() == text_of(whole)
    assert answer.as_numpy("token_ids").tolist() == ids_of(whole)


def test_rest_generate_stream_through_the_router_sends_an_event_a_token(router, client):
    whole = generate(client, max_tokens=10)
    request = urllib.request.Request(
        f"http://{router.http_address}/v2/models/tiny/generate_stream",
        data=json.dumps({"text_input": PROMPT, "max_tokens": 10}).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        sent = [json.loads(chunk.removeprefix("data: "))
                for chunk in answer.read().decode().split("\n\n") if chunk]
    assert [len(e["token_ids"]) for e in sent] == [1] * 10
    assert "".join(e["text_output"] for e in sent) == text_of(whole)


def test_an_agent_killed_before_the_first_token_fails_over(router, client, agents, table_path,
                                                          repository):
    spare = AgentProcess("edge", repository).start()
    try:
        use_table(router, table_path, tiers(agents, edge=(spare.address,),
                                            regional=("regional",)))
        assert {served_tier(r) for r in streamed(client, max_tokens=2, **EDGE)} == \
            {"edge"}  # the router is connected to it
        spare.kill()
        results = streamed(client, max_tokens=8, **EDGE)
        assert len(results) == 8 and is_final(results[-1])
        assert {served_tier(r) for r in results} == {"regional"}
    finally:
        spare.kill()
        use_table(router, table_path, tiers(agents))


def test_an_agent_killed_mid_stream_ends_the_stream_unavailable(router, client, agents,
                                                               table_path, repository):
    spare = AgentProcess("edge", repository).start()
    try:
        use_table(router, table_path, tiers(agents, edge=(spare.address,),
                                            regional=("regional",)))
        before = agent_counts(agents["regional"])
        stream = Stream(client)
        try:
            stream.send(max_tokens=4000, **EDGE)
            assert served_tier(stream.next()) == "edge"  # tokens have flowed
            spare.kill()
            with pytest.raises(InferenceServerException) as caught:
                while not is_final(stream.next()):
                    pass
        finally:
            client.stop_stream()
        message = caught.value.message()
        assert message.startswith("unavailable") and spare.address in message, message
        # The regional agent was never asked: nothing is retried once tokens flowed.
        assert agent_counts(agents["regional"]) == before
    finally:
        spare.kill()
        use_table(router, table_path, tiers(agents))


def test_cascade_escalates_a_generation_whose_tokens_are_unsure(router, client, agents,
                                                              table_path):
    with grpcclient.InferenceServerClient(agents["edge"].address) as direct:
        answer = generate(direct, max_tokens=8)
    mean_logprob = answer.get_response().parameters["mean_logprob"].double_param
    assert mean_logprob < 0  # the agent says how sure it was of its tokens
    confidence = math.exp(mean_logprob)  # their geometric-mean probability
    both = tiers(agents, regional=("regional",))
    try:
        for threshold, served in ((confidence / 1.25, ["edge"]),
                                  (min(1.0, confidence * 1.25), ["edge", "regional"])):
            use_table(router, table_path, both, policy="cascade",
                      cascade={"tiers": ["edge", "regional"], "threshold": threshold})
            before = {tier: agent_counts(agents[tier])[0] for tier in ("edge", "regional")}
            escalations = metric(router, "tiered_router_escalations_total")
            result = generate(client, max_tokens=8)
            moved = [tier for tier in before if agent_counts(agents[tier])[0] > before[tier]]
            assert moved == served, (threshold, confidence, moved)
            assert served_tier(result) == served[-1]
            assert metric(router, "tiered_router_escalations_total") - escalations == \
                len(served) - 1
            assert text_of(result) == text_of(answer)  # same model on both tiers
        # A stream is answered by its first agent: never escalated.
        before = {tier: agent_counts(agents[tier])[0] for tier in ("edge", "regional")}
        assert {served_tier(r) for r in streamed(client, max_tokens=8)} == {"edge"}
        assert agent_counts(agents["regional"])[0] == before["regional"]
    finally:
        use_table(router, table_path, tiers(agents))


def agreement(router, version: str = "2") -> tuple[int, int]:
    with grpc.insecure_channel(router.address) as channel:
        response = tpb_grpc.TelemetryStub(channel).Agreement(
            tpb.AgreementRequest(model_name="tiny", model_version=version), timeout=10)
    counts = {t.tier: (t.agreed, t.disagreed) for t in response.tiers}
    return counts.get("edge", (0, 0))


def test_shadowed_greedy_generations_agree_on_their_tokens(router, client, agents,
                                                          table_path):
    use_table(router, table_path, tiers(agents, stable=1, canary=2, shadow_fraction=1.0))
    incomparable = 'tiered_router_shadow_total{model="tiny",result="incomparable",' \
                   'tier="edge",version="2"}'
    try:
        agreed, disagreed = agreement(router)
        sampled = metrics(router).get(incomparable, 0.0)
        for index in range(3):
            answer = generate(client, text=f"{PROMPT} {index}", max_tokens=6)
            assert answer.get_response().model_version == "1"  # the answer is stable's
        for seed in (1, 2):  # sampled: two samples need not agree, so none is compared
            generate(client, max_tokens=6, temperature=0.8, seed=seed)
        assert len(streamed(client, max_tokens=4)) == 4  # its relayed tokens are compared
        generate(client, text=f"{PROMPT} 3", max_tokens=6)
        wait_for(lambda: sum(agreement(router)) >= agreed + disagreed + 5, router,
                 "five shadow comparisons")
        # Version 2 is the same model: its greedy tokens are the same, every time.
        assert agreement(router) == (agreed + 5, disagreed)
        assert metrics(router).get(incomparable, 0.0) - sampled == 2
    finally:
        use_table(router, table_path, tiers(agents))
