"""A generative model on a real agent, driven by the unmodified tritonclient:
tokens streamed one per response with Triton's final flag, the whole text
from ModelInfer and REST, in-flight batching, cancellation, bounded admission
and parameter errors."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from tests.conftest import add_generative, engine_processes, environ_of, frames_fed
from tests.generation import (
    PROMPT,
    Stream,
    generate,
    ids_of,
    is_final,
    prompt_input,
    text_of,
)
from tiered.local.processes import AgentProcess
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
from tiered.protocol import telemetry_messages
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc

WAIT_MS = 600  # model "one": how long a request waits for its single slot (4000
# tokens hold it for well over a second); a request admitted at all was admitted
# within it, so no test needs a clock to show a slot was freed at once


# Every test runs against each layout: the engine on a worker thread of the
# agent, in an engine core process of its own (`engine_core.py`), and in an
# engine core behind front-end processes, which build the streams' responses
# from the chunks of tokens the agent sends them (the datacenter's on a GPU).
@pytest.fixture(scope="module", params=["thread", "process", "front ends"])
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def repository(layout, generative_model, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"generative-repository-{layout.replace(' ', '-')}")
    core = {"engine_core": "thread" if layout == "thread" else "process"}
    add_generative(root, "tiny", generative_model, {
        "engine": {"max_sequences": 4}, "generation": core})
    add_generative(root, "meter", generative_model, {"generation": core})  # the telemetry test's
    add_generative(root, "chunks", generative_model, {
        "engine": {"max_sequences": 8},
        "generation": {"max_tokens_per_response": 8, **core}})
    add_generative(root, "one", generative_model, {
        "engine": {"max_sequences": 1}, "max_queue_size": 1,
        "generation": {"max_queue_wait_ms": WAIT_MS, **core}})
    return root


@pytest.fixture(scope="module")
def agent(repository, layout):
    front_ends = ["--front-ends", "2"] if layout == "front ends" else []
    with AgentProcess("edge", repository, extra_args=front_ends) as process:
        yield process
        assert process.alive(), f"the agent died:\n{process.log_tail()}"


@pytest.fixture()
def client(agent):
    with grpcclient.InferenceServerClient(agent.address) as c:
        yield c


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), caught.value.message()


def test_model_config_says_decoupled_and_names_the_tensors(client):
    config = client.get_model_config("tiny").config
    assert config.model_transaction_policy.decoupled
    assert config.backend == "onnxruntime-genai"
    inputs = {t.name: t.optional for t in config.input}
    assert inputs["text_input"] is False and inputs["max_tokens"] and inputs["stop"]
    assert [t.name for t in config.output] == ["text_output", "token_ids"]


def test_tokens_stream_one_per_response_and_match_model_infer(client):
    stream = Stream(client)
    try:
        stream.send(request_id="r1", max_tokens=24)
        results = stream.until_final()
    finally:
        client.stop_stream()
    assert len(results) == 24
    assert all(len(r.as_numpy("token_ids")) == 1 for r in results)
    assert [is_final(r) for r in results] == [False] * 23 + [True]
    assert {r.get_response().id for r in results} == {"r1"}
    whole = generate(client, max_tokens=24)
    assert "".join(text_of(r) for r in results) == text_of(whole)
    assert [int(r.as_numpy("token_ids")[0]) for r in results] == \
        whole.as_numpy("token_ids").tolist()
    assert text_of(whole)  # greedy decoding of the tiny model says something


def stream_request(model: str, request_id: str, max_tokens: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["max_tokens"].int64_param = max_tokens
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(PROMPT.encode())
    return request


def test_a_stream_that_falls_behind_gets_the_ready_tokens_in_one_response(agent, client):
    # A raw stream left unread: once its flow-control window is full the agent
    # cannot send, and each request's tokens pile up while it generates.
    with grpc.insecure_channel(agent.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        requests = [stream_request("chunks", f"c{i}", 400) for i in range(8)]
        responses = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests))
        # Unread until the engine has generated every token (all 8 ran, then
        # none): a fixed sleep let a busy machine's reader catch up.
        for running in (8, 0):
            wait_for_gauge(agent, "tiered_running_sequences", "chunks", running, timeout_s=60)
        by_id: dict[str, list] = {}
        for answer in responses:
            assert not answer.error_message, answer.error_message
            response = answer.infer_response
            ids = np.frombuffer(response.raw_output_contents[1], dtype=np.int64)
            text = deserialize_bytes_tensor(response.raw_output_contents[0])[0].decode()
            by_id.setdefault(response.id, []).append(
                (ids.tolist(), text, response.parameters["triton_final_response"].bool_param))
            if len(by_id) == 8 and all(r[-1][2] for r in by_id.values()):
                break
    whole = generate(client, "chunks", max_tokens=400)
    for chunks in by_id.values():
        assert [len(ids) <= 8 for ids, _, _ in chunks] == [True] * len(chunks)
        assert [final for _, _, final in chunks] == [False] * (len(chunks) - 1) + [True]
        assert sum((ids for ids, _, _ in chunks), []) == whole.as_numpy("token_ids").tolist()
        assert "".join(text for _, text, _ in chunks) == text_of(whole)
    assert min(len(chunks) for chunks in by_id.values()) < 400  # several tokens a response


def test_empty_final_response_when_the_client_asks_for_it(client):
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("tiny", [prompt_input()], enable_empty_final_response=True,
                                  parameters={"max_tokens": 5})
        results = []
        while not results or not is_final(results[-1]):
            result, error = responses.get(timeout=60)
            assert error is None
            results.append(result)
    finally:
        client.stop_stream()
    assert len(results) == 6
    assert not results[-1].get_response().outputs
    assert not any(is_final(r) for r in results[:-1])


def successes(client, model: str = "tiny") -> int:
    return client.get_inference_statistics(model).model_stats[0].inference_stats.success.count


def test_stop_string_ends_the_text_before_it(client):
    whole = text_of(generate(client, max_tokens=40))
    stop = whole[5:8]
    assert len(stop) == 3
    cut = generate(client, max_tokens=40, stop=stop)
    assert text_of(cut) == whole[:whole.find(stop)]
    assert len(cut.as_numpy("token_ids")) < 40
    # Streamed (where front ends run, they make the text and apply the stop
    # string): the same text, the last response says why, and the request
    # ends as a success, not as a client gone away (room for 4000 tokens: the
    # engine would not end it first).
    before = successes(client)
    stream = Stream(client)
    try:
        stream.send(max_tokens=4000, stop=stop)
        results = stream.until_final()
    finally:
        client.stop_stream()
    assert "".join(text_of(r) for r in results) == whole[:whole.find(stop)]
    assert sum(len(r.as_numpy("token_ids")) for r in results) < 40
    finish = results[-1].get_response().parameters["finish_reason"].string_param
    assert finish == "stop"
    deadline = time.monotonic() + 10  # the engine hears of the stop string after the client
    while successes(client) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert successes(client) == before + 1


def test_concurrent_streams_run_in_one_batch(client):
    stream = Stream(client)
    try:
        for index in range(4):
            stream.send(request_id=f"s{index}", max_tokens=300)
        finished = set()
        while len(finished) < 4:
            result = stream.next()
            if is_final(result):
                finished.add(result.get_response().id)
    finally:
        client.stop_stream()
    batches = client.get_inference_statistics("tiny").model_stats[0].batch_stats
    assert max(b.batch_size for b in batches if b.compute_infer.count) > 1


def test_cancelled_stream_frees_its_slot_at_once(client):
    stream = Stream(client)
    stream.send("one", max_tokens=4000)  # seconds of work on this model
    stream.next()  # it is running
    client.stop_stream(cancel_requests=True)
    answer = generate(client, "one", max_tokens=3)  # refused after WAIT_MS if still held
    assert len(answer.as_numpy("token_ids")) == 3


def gauge(agent, family: str, model: str) -> float:
    """One of the agent's per-model gauges, read from /metrics."""
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    for found in text_string_to_metric_families(text):
        if found.name == family:
            return sum(s.value for s in found.samples if s.labels["model"] == model)
    raise AssertionError(f"no {family} in /metrics")


def wait_for_gauge(agent, family: str, model: str, value: float, why=dict,
                   timeout_s: float = 30) -> None:
    give_up = time.monotonic() + timeout_s
    while gauge(agent, family, model) != value:
        assert time.monotonic() < give_up, f"{family} of {model} never reached {value}: {why()}"
        time.sleep(0.01)


class Calls:
    """ModelInfer calls to model "one" in threads, each on its own client; their
    outcomes by name: (status, message, seconds)."""

    def __init__(self, agent) -> None:
        self.agent, self.outcomes, self.threads = agent, {}, []

    def start(self, name: str, max_tokens: int) -> None:
        def call() -> None:
            with grpcclient.InferenceServerClient(self.agent.address) as own:
                started = time.monotonic()
                try:
                    generate(own, "one", max_tokens=max_tokens)
                    self.outcomes[name] = ("OK", "", time.monotonic() - started)
                except InferenceServerException as error:
                    self.outcomes[name] = (error.status(), error.message(),
                                           time.monotonic() - started)

        self.threads.append(threading.Thread(target=call))
        self.threads[-1].start()

    def join(self, timeout_s: float = 240.0) -> dict[str, tuple]:
        """Every call's outcome. A 4000-token call takes seconds alone and
        over a minute beside a busy loop and the other test workers."""
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), \
            f"calls unanswered after {timeout_s:g} s; outcomes so far {self.outcomes}"
        return self.outcomes


def test_the_agent_answers_other_calls_while_a_sequence_generates(agent, client):
    calls = Calls(agent)
    calls.start("holder", 4000)  # seconds of steps that keep the GIL (onnxruntime-genai)
    wait_for_gauge(agent, "tiered_running_sequences", "one", 1)
    for _ in range(5):
        assert client.is_server_live() and client.is_model_ready("tiny")
        client.get_inference_statistics("one")
    assert gauge(agent, "tiered_running_sequences", "one") == 1, "answered only once it ended"
    assert calls.join()["holder"][0] == "OK"


def test_admission_waits_for_a_slot_then_is_refused(agent, client):
    calls = Calls(agent)
    calls.start("holder", 4000)  # holds the one slot for seconds
    wait_for_gauge(agent, "tiered_running_sequences", "one", 1)
    calls.start("waiter", 3)
    wait_for_gauge(agent, "nv_inference_pending_request_count", "one", 1,
                   lambda: calls.outcomes)
    code, message = status_of(lambda: generate(client, "one", max_tokens=3))
    assert code == "StatusCode.RESOURCE_EXHAUSTED" and "max_queue_size" in message
    outcomes = calls.join()
    code, message, waited = outcomes["waiter"]
    assert code == "StatusCode.RESOURCE_EXHAUSTED" and "no sequence slot" in message
    assert waited >= WAIT_MS / 1e3 * 0.9
    assert outcomes["holder"][0] == "OK"  # it ran on while the others were refused


@pytest.mark.parametrize(("parameters", "text", "named"), [
    ({"max_tokens": 0}, PROMPT, "max_tokens"),
    ({"temperature": -1.0}, PROMPT, "temperature"),
    ({"top_p": 0.0}, PROMPT, "top_p"),
    ({"max_tokens": "many"}, PROMPT, "max_tokens"),
    ({"max_tokens": 8}, "fox " * 5000, "text_input"),
])
def test_bad_parameters_are_invalid_argument_naming_the_field(client, parameters, text, named):
    code, message = status_of(lambda: generate(client, text=text, **parameters))
    assert code == "StatusCode.INVALID_ARGUMENT"
    assert message.startswith(named) or f"{named}:" in message, message


def test_bad_parameters_in_a_stream_come_back_as_stream_errors(client):
    stream = Stream(client)
    try:
        stream.send(max_tokens=0)
        with pytest.raises(InferenceServerException, match="max_tokens"):
            stream.next()
        stream.send(max_tokens=2)  # the stream goes on
        assert len(stream.until_final()) == 2
    finally:
        client.stop_stream()


def test_rest_infer_returns_the_whole_text(agent, client):
    whole = generate(client, max_tokens=12)
    with httpclient.InferenceServerClient(agent.http_address) as rest:
        item = httpclient.InferInput("text_input", [1], "BYTES")
        item.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
        answer = rest.infer("tiny", [item], parameters={"max_tokens": 12})
    assert answer.as_numpy("text_output")[0].decode() == text_of(whole)
    assert answer.as_numpy("token_ids").tolist() == whole.as_numpy("token_ids").tolist()


def post(address: str, path: str, body: object) -> tuple[int, str, bytes]:
    """An HTTP POST of `body` as JSON: status, content type and body."""
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def events(body: bytes) -> list[dict]:
    """The JSON of each server-sent event in `body`."""
    chunks = [c for c in body.decode().split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks), chunks
    return [json.loads(c[len("data: "):]) for c in chunks]


def test_rest_generate_answers_the_whole_text_as_json(agent, client):
    whole = generate(client, max_tokens=12)
    code, kind, body = post(agent.http_address, "/v2/models/tiny/generate",
                            {"text_input": PROMPT, "max_tokens": 12, "id": "g1"})
    assert code == 200 and kind.startswith("application/json")
    answer = json.loads(body)
    assert answer["text_output"] == text_of(whole) and answer["id"] == "g1"
    assert answer["token_ids"] == whole.as_numpy("token_ids").tolist()
    assert answer["model_name"] == "tiny" and answer["model_version"] == "1"
    assert answer["parameters"]["mean_logprob"] < 0


def test_rest_generate_stream_sends_an_event_a_token(agent, client):
    whole = generate(client, max_tokens=12, stop="zzz")
    code, kind, body = post(agent.http_address, "/v2/models/tiny/generate_stream",
                            {"text_input": PROMPT, "parameters": {"max_tokens": 12},
                             "stop": ["zzz"]})
    assert code == 200 and kind.startswith("text/event-stream")
    sent = events(body)
    assert [len(e["token_ids"]) for e in sent] == [1] * 12
    assert [e["parameters"]["triton_final_response"] for e in sent] == [False] * 11 + [True]
    assert "".join(e["text_output"] for e in sent) == text_of(whole)


@pytest.mark.parametrize(("path", "body", "code", "named"), [
    ("/v2/models/nothing/generate_stream", {"text_input": "x"}, 400, "nothing"),
    ("/v2/models/tiny/generate_stream", {"text_input": "x", "max_tokens": 0}, 400,
     "max_tokens"),
    ("/v2/models/tiny/generate", {"text_input": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v2/models/tiny/generate", {"prompt": "x"}, 400, "prompt"),
    ("/v2/models/tiny/generate", {"text_input": [{"a": 1}]}, 400, "text_input"),
    ("/v2/models/tiny/generate", ["text_input"], 400, "request body"),
])
def test_rest_generate_errors_name_what_is_wrong(agent, path, body, code, named):
    got, kind, answer = post(agent.http_address, path, body)
    assert got == code and kind.startswith("application/json")
    assert named in json.loads(answer)["error"]


def test_front_ends_answer_streams_from_the_agents_chunks_and_cancel_them(
        repository, client, layout):
    """This layout's engine behind front ends: the same tokens and flags, the
    streams fed as chunks, and a client that goes away frees its sequence."""
    if layout == "front ends":
        pytest.skip("the module's own agent runs front ends in this layout")
    expected = [int(i) for i in generate(client, max_tokens=10).as_numpy("token_ids")]
    with AgentProcess("edge", repository, extra_args=["--front-ends", "2"]) as process, \
            grpcclient.InferenceServerClient(process.address) as fronted:
        stream = Stream(fronted)
        try:
            stream.send(max_tokens=10, request_id="f")
            results = stream.until_final()
            assert [int(r.as_numpy("token_ids")[0]) for r in results] == expected
            assert [is_final(r) for r in results] == [False] * 9 + [True]
            assert {r.get_response().id for r in results} == {"f"}
            assert {r.get_response().model_version for r in results} == {"1"}
            assert frames_fed(process)["stream"] == 1
            stream.send("one", max_tokens=4000)
            stream.next()
        finally:
            fronted.stop_stream(cancel_requests=True)
        # Refused after WAIT_MS if the cancelled stream still held the slot.
        assert len(generate(fronted, "one", max_tokens=3).as_numpy("token_ids")) == 3
        assert frames_fed(process)["stream"] == 2  # ModelInfer's whole text is not one
        assert process.alive(), process.log_tail()


def metric(text: str, name: str, model: str) -> float:
    found = re.search(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.MULTILINE)
    assert found, f"{name} for {model} not in /metrics"
    return float(found.group(1))


def meter_stats(agent, cursor: float = 0.0) -> tpb.StatsResponse:
    with grpc.insecure_channel(agent.address) as channel:
        return tpb_grpc.TelemetryStub(channel).Stats(
            tpb.StatsRequest(model_name="meter", cursor=cursor), timeout=10)


def test_token_telemetry_in_stats_and_metrics(agent, client):
    # From a cursor: the span then starts after the agent's first energy reading.
    cursor = meter_stats(agent).end
    stream = Stream(client)
    try:
        stream.send("meter", max_tokens=20)
        streamed = len(stream.until_final())
    finally:
        client.stop_stream()
    streamed += len(generate(client, "meter", max_tokens=7).as_numpy("token_ids"))
    assert streamed == 27

    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    assert metric(text, "tiered_output_tokens_total", "meter") == streamed
    assert metric(text, "tiered_time_to_first_token_seconds_count", "meter") == 2
    assert metric(text, "tiered_time_to_first_token_seconds_sum", "meter") > 0
    assert metric(text, "tiered_time_per_output_token_seconds_count", "meter") == streamed - 2
    assert metric(text, "tiered_running_sequences", "meter") == 0

    deadline = time.monotonic() + 10
    while True:  # the window holds whole one-second slots
        response = meter_stats(agent, cursor)
        [version] = response.versions
        if version.generation.output_tokens == streamed or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    generation = version.generation
    assert version.HasField("generation") and generation.output_tokens == streamed
    assert version.success == 2
    ttft = telemetry_messages.histogram_quantile(generation.time_to_first_token, 0.5)
    tpot = telemetry_messages.histogram_quantile(generation.time_per_output_token, 0.5)
    # Both plausible; not ordered: a tiny model's prefill is about one decode
    # step, and on a busy machine a later token can wait longer than the first.
    assert 0 < tpot < 5 and 0 < ttft < 5
    assert sum(generation.time_to_first_token.count) == 2
    assert sum(generation.time_per_output_token.count) == streamed - 2
    assert generation.tokens_per_s > 0 and generation.max_sequences == 8
    assert version.has_energy and version.energy.source in ("nvml", "rapl", "model")
    assert generation.joules_per_output_token > 0
    # Energy per token covers whole slots of the recent window: the ones just read.
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    assert re.search(r'^tiered_energy_joules_per_output_token\{[^}]*model="meter"[^}]*'
                     r'source="(nvml|rapl|model)"[^}]*\} \S+$', text, re.MULTILINE)


def test_each_version_runs_where_its_layout_says(agent, client, layout):
    cores = engine_processes(agent)
    said = client.get_model_config("tiny").config.parameters.get("engine_core")
    if layout == "thread":
        assert cores == {} and said is None
    else:
        assert sorted(cores) == ["chunks", "meter", "one", "tiny"], cores
        assert all(len(pids) == 1 for pids in cores.values()), cores
        assert said.string_value == f"process {cores['tiny'][0]}"


def test_a_lost_engine_core_fails_its_requests_and_another_serves_the_next(
        agent, client, layout):
    if layout == "thread":
        pytest.skip("the engine runs in the agent's process here")
    expected = ids_of(generate(client, max_tokens=6))
    [core] = engine_processes(agent)["tiny"]
    stream = Stream(client)
    try:
        stream.send(max_tokens=4000)
        stream.next()  # it runs
        os.kill(core, signal.SIGKILL)
        with pytest.raises(InferenceServerException, match="engine core exited"):
            stream.until_final()
    finally:
        client.stop_stream()
    assert ids_of(generate(client, max_tokens=6)) == expected  # from a new core
    [new] = engine_processes(agent)["tiny"]
    assert new != core and agent.alive()


def device_shares(agent, model: str) -> dict[str, tpb.DeviceShare]:
    with grpc.insecure_channel(agent.address) as channel:
        [version] = tpb_grpc.TelemetryStub(channel).Stats(
            tpb.StatsRequest(model_name=model), timeout=10).versions
    return {share.device: share for share in version.devices}


def test_a_core_per_device_takes_its_share_and_a_lost_one_leaves_the_other_serving(
        repository, layout):
    if layout != "process":
        pytest.skip("the engine runs in the agent's process here" if layout == "thread"
                    else "the process layout's test starts the same agent")
    with AgentProcess("edge", repository, extra_args=["--devices", "cpu,cpu"]) as process, \
            grpcclient.InferenceServerClient(process.address) as client:
        cores = engine_processes(process)["tiny"]
        assert sorted(environ_of(pid)["TIERED_DEVICE"] for pid in cores) == ["cpu:0", "cpu:1"]
        said = client.get_model_config("tiny").config.parameters["engine_core"].string_value
        assert sorted(said.removeprefix("process ").split(", ")) == sorted(map(str, cores))
        # Two streams at once: each on the core holding fewer, so one on each.
        stream = Stream(client)
        try:
            for name in ("a", "b"):
                stream.send(max_tokens=4000, request_id=name)
            for _ in range(2):
                stream.next()
            deadline = time.monotonic() + 10  # the telemetry's slots close each second
            while True:
                shares = device_shares(process, "tiny")
                both = {d for d, share in shares.items() if share.inferences} == {
                    "cpu:0", "cpu:1"}
                if both or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert both, shares
            os.kill(cores[0], signal.SIGKILL)
            with pytest.raises(InferenceServerException, match="engine core exited"):
                while True:  # the request on the lost core fails; the other streams on
                    stream.next()
        finally:
            client.stop_stream(cancel_requests=True)
        # The other core serves at once, while the lost one starts again.
        assert len(ids_of(generate(client, max_tokens=5))) == 5
        wait_until = time.monotonic() + 60
        while time.monotonic() < wait_until:
            now = engine_processes(process)["tiny"]
            if len(now) == 2 and cores[0] not in now:
                break
            time.sleep(0.2)
        assert len(now) == 2 and cores[0] not in now and cores[1] in now, (cores, now)
        assert process.alive(), process.log_tail()
