"""Decoupled models beyond the generative backends: Triton's `repeat_int32`
(an ONNX graph, `zoo.repeat`) answers a streamed request with a response per
element of IN, zero for none, through an agent, its front ends and a router,
driven by the real tritonclient. ModelInfer and REST infer are refused with
Triton's words; config errors name the field."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from tiered.agent import triton_config
from tiered.agent.config import parse_model_config
from tiered.agent.repository import model_file
from tiered.errors import ConfigError
from tiered.local.processes import AgentProcess, RouterProcess
from tiered.models import zoo
from tiered.profiles import load_profile

MODEL = "repeat_int32"
# Triton's own config of the model, as its example clients expect it.
REPEAT_PBTXT = """
name: "repeat_int32"
backend: "onnxruntime"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
"""


def write_repeat(root) -> None:
    zoo.repeat(model_file(root, MODEL, 1))
    (root / MODEL / "config.pbtxt").write_text(REPEAT_PBTXT)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """An agent, one with two front ends, and a router over both."""
    root = tmp_path_factory.mktemp("decoupled")
    write_repeat(root)
    agents = [AgentProcess("edge", root).start(),
              AgentProcess("edge", root, extra_args=["--front-ends", "2"]).start()]
    table = root.parent / "decoupled-routing.json"
    table.write_text(json.dumps({"version": 1, "models": {MODEL: {"tiers": {
        "edge": {"agents": [agent.address for agent in agents]}}}}}))
    try:
        with RouterProcess(table) as router:
            yield {"agent": agents[0], "front ends": agents[1], "router": router}
    finally:
        for agent in agents:
            agent.stop()


def repeat_inputs(values: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = [grpcclient.InferInput("IN", [len(values)], "INT32"),
              grpcclient.InferInput("DELAY", [len(values)], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(values.astype(np.int32))
    inputs[1].set_data_from_numpy(np.zeros(len(values), np.uint32))
    inputs[2].set_data_from_numpy(np.zeros(1, np.uint32))
    return inputs


def stream(address: str, requests: list[tuple[str, np.ndarray]], empty_final: bool = False,
           wait_s: float = 1.0) -> dict[str, list]:
    """Each request's responses (result objects or errors) by its id, read
    until `wait_s` passes with nothing more."""
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(address) as client:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for request_id, values in requests:
            client.async_stream_infer(MODEL, repeat_inputs(values), request_id=request_id,
                                      enable_empty_final_response=empty_final)
        got: dict[str, list] = {request_id: [] for request_id, _ in requests}
        while True:
            try:
                answer = answers.get(timeout=wait_s)
            except queue.Empty:
                break
            if isinstance(answer, InferenceServerException):
                got.setdefault("errors", []).append(answer)
            else:
                got[answer.get_response().id].append(answer)
        client.stop_stream()
    return got


def final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


@pytest.mark.parametrize("where", ["agent", "front ends", "router"])
def test_a_request_gets_a_response_per_row_and_none_for_none(system, where):
    got = stream(system[where].address, [("ten", np.arange(100, 110)), ("none", np.arange(0)),
                                         ("one", np.array([7]))])
    assert "errors" not in got
    assert [int(r.as_numpy("OUT")[0]) for r in got["ten"]] == list(range(100, 110))
    assert [int(r.as_numpy("IDX")[0]) for r in got["ten"]] == list(range(10))
    assert [final(r) for r in got["ten"]] == [False] * 9 + [True]
    assert got["none"] == []
    assert [int(r.as_numpy("OUT")[0]) for r in got["one"]] == [7] and final(got["one"][0])
    assert got["one"][0].as_numpy("OUT").shape == (1,)  # a response's dims: [1]


@pytest.mark.parametrize("where", ["agent", "router"])
def test_the_empty_final_response_comes_when_asked_even_after_none(system, where):
    got = stream(system[where].address, [("three", np.arange(3)), ("none", np.arange(0))],
                 empty_final=True)
    assert [final(r) for r in got["three"]] == [False, False, False, True]
    assert got["three"][-1].get_response().outputs == []
    assert len(got["none"]) == 1 and final(got["none"][0])


@pytest.mark.parametrize("where", ["agent", "front ends", "router"])
def test_model_infer_is_refused_with_tritons_words(system, where):
    with grpcclient.InferenceServerClient(system[where].address) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(MODEL, repeat_inputs(np.arange(3)))
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" \
        in caught.value.message()


def test_rest_infer_is_refused_and_the_config_says_decoupled(system):
    agent = system["agent"]
    with httpclient.InferenceServerClient(agent.http_address) as client:
        inputs = [httpclient.InferInput("IN", [2], "INT32"),
                  httpclient.InferInput("DELAY", [2], "UINT32"),
                  httpclient.InferInput("WAIT", [1], "UINT32")]
        for tensor, array in zip(inputs, (np.arange(2, dtype=np.int32),
                                          np.zeros(2, np.uint32), np.zeros(1, np.uint32))):
            tensor.set_data_from_numpy(array)
        with pytest.raises(InferenceServerException, match="decoupled transaction policy"):
            client.infer(MODEL, inputs)
    with grpcclient.InferenceServerClient(agent.address) as client:
        config = client.get_model_config(MODEL).config
        assert config.model_transaction_policy.decoupled
        assert [list(t.dims) for t in config.output] == [[1], [1]]
        stats = client.get_inference_statistics(MODEL).model_stats[0].inference_stats
        assert stats.success.count >= 1 and stats.fail.count >= 1  # streams; the refusals


def test_a_bad_request_is_an_error_in_the_stream_which_goes_on(system):
    address = system["agent"].address
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(address) as client:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        wrong = grpcclient.InferInput("IN", [2], "FP32")
        wrong.set_data_from_numpy(np.zeros(2, np.float32))
        client.async_stream_infer(MODEL, [wrong, *repeat_inputs(np.arange(2))[1:]])
        client.async_stream_infer(MODEL, repeat_inputs(np.array([5, 6])), request_id="ok")
        first, *rest = (answers.get(timeout=30) for _ in range(3))
        client.stop_stream()
    assert isinstance(first, InferenceServerException) and "IN" in first.message()
    assert [int(r.as_numpy("OUT")[0]) for r in rest] == [5, 6]


def test_pbtxt_and_yaml_say_decoupled_alike():
    profile = load_profile("edge")
    from_pbtxt = parse_model_config(MODEL, triton_config.parse(REPEAT_PBTXT, "c.pbtxt"),
                                    profile, "c.pbtxt")
    from_yaml = parse_model_config(MODEL, yaml.safe_load(
        "decoupled: true\nmax_batch_size: 0\n"), profile, "config.yaml")
    assert from_pbtxt.decoupled and from_pbtxt.splits_responses
    assert from_yaml.decoupled and from_yaml.engine_shape(from_pbtxt.outputs[0], True) == (-1, 1)


@pytest.mark.parametrize("text, words", [
    ("decoupled: true\nmax_batch_size: 8\ndynamic_batching: {}\n", "set max_batch_size: 0"),
    ("backend: torch-generative\ndecoupled: false\n", "a generative model streams its tokens"),
])
def test_what_a_decoupled_model_cannot_be_is_refused_by_name(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_model_config(MODEL, yaml.safe_load(text), load_profile("edge"), "config.yaml")


def test_outputs_without_an_axis_of_responses_are_refused_at_load(tmp_path):
    zoo.add_sub(model_file(tmp_path, "scalar", 1))  # outputs [batch, 16]: fine
    (tmp_path / "scalar" / "config.yaml").write_text(
        "decoupled: true\noutputs:\n  - {name: OUTPUT0, datatype: FP32, dims: [4]}\n")
    with pytest.raises(Exception, match=r"dims: \[4\] \(full shape \[-1, 4\]\) cannot fit"):
        AgentProcess("edge", tmp_path).start()
