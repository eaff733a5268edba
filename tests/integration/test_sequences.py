"""The sequence batcher against a real agent: a stateful ONNX model, Triton's
config.pbtxt, and tritonclient's own sequence calls (gRPC, its stream, REST).

The model keeps a running sum in implicit state: ACC_OUT = INPUT on START,
else ACC_IN + INPUT; OUTPUT = ACC_OUT + 1000 * END, and CORRID comes back as
an output, so every control value the agent fills in is seen in an answer.
The same model runs on the ONNX Runtime engine (edge) and on the torch engine
(a datacenter agent, config.yaml's spelling of the settings).
"""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tiered.agent import triton_config
from tiered.agent.repository import model_file
from tiered.local.processes import AgentProcess

IDLE_US = 3_000_000  # long beside a busy machine's gaps between steps, short to wait out
CONFIG = f"""
name: "accumulate"
backend: "onnxruntime"
max_batch_size: 4
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "ID" data_type: TYPE_INT64 dims: [ 1 ] }}
]
sequence_batching {{
  max_sequence_idle_microseconds: {IDLE_US}
  oldest {{ max_candidate_sequences: 3 }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT64 }} ] }}
  ]
  state [ {{ input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state: {{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true }} }} ]
}}
"""


def write_model(root) -> None:
    def vi(name, elem):
        return helper.make_tensor_value_info(name, elem, ["batch", 1])

    thousand = helper.make_tensor("thousand", TensorProto.INT32, [], [1000])
    nodes = [  # ops both engines run (the torch engine converts a few)
        helper.make_node("Mul", ["ACC_IN", "START"], ["forgotten"]),
        helper.make_node("Sub", ["ACC_IN", "forgotten"], ["kept"]),  # 0 on START
        helper.make_node("Add", ["kept", "INPUT"], ["ACC_OUT"]),
        helper.make_node("Mul", ["END", "thousand"], ["ending"]),
        helper.make_node("Add", ["ACC_OUT", "ending"], ["OUTPUT"]),
        helper.make_node("Identity", ["CORRID"], ["ID"]),
    ]
    graph = helper.make_graph(
        nodes, "accumulate",
        [vi("INPUT", TensorProto.INT32), vi("START", TensorProto.INT32),
         vi("END", TensorProto.INT32), vi("CORRID", TensorProto.INT64),
         vi("ACC_IN", TensorProto.INT32)],
        [vi("OUTPUT", TensorProto.INT32), vi("ID", TensorProto.INT64),
         vi("ACC_OUT", TensorProto.INT32)], initializer=[thousand])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = model_file(root, "accumulate", 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    (root / "accumulate" / "config.pbtxt").write_text(CONFIG)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequences")
    write_model(root)
    with AgentProcess("edge", root) as started:
        yield started


@pytest.fixture
def client(agent):
    with grpcclient.InferenceServerClient(agent.address) as opened:
        yield opened


def send(client, value: int, sequence_id, start=False, end=False) -> tuple[int, int]:
    tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    result = client.infer("accumulate", [tensor], sequence_id=sequence_id,
                          sequence_start=start, sequence_end=end)
    return int(result.as_numpy("OUTPUT")[0, 0]), int(result.as_numpy("ID")[0, 0])


def test_interleaved_sequences_keep_their_own_state_and_controls(client):
    assert send(client, 5, 1000, start=True) == (5, 1000)
    assert send(client, 100, 1001, start=True) == (100, 1001)
    assert send(client, 3, 1000) == (8, 1000)
    assert send(client, -1, 1001) == (99, 1001)
    assert send(client, 2, 1000, end=True) == (1010, 1000)  # 10, and END seen
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        send(client, 1, 1000)  # ended: its state is gone
    assert send(client, 1, 1001, end=True) == (1100, 1001)


def test_the_config_names_the_batcher_and_hides_its_tensors(client):
    config = client.get_model_config("accumulate").config
    assert [c.name for c in config.sequence_batching.control_input] == ["START", "END", "CORRID"]
    assert config.sequence_batching.state[0].output_name == "ACC_OUT"
    assert config.sequence_batching.oldest.max_candidate_sequences == 3
    metadata = client.get_model_metadata("accumulate")
    assert [t.name for t in metadata.inputs] == ["INPUT"]
    assert [t.name for t in metadata.outputs] == ["OUTPUT", "ID"]


def test_requests_outside_a_sequence_are_refused_with_tritons_words(client):
    tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty "
                       "correlation ID"):
        client.infer("accumulate", [tensor])
    with pytest.raises(InferenceServerException, match="START flag on the first request"):
        send(client, 1, 4242)
    start = grpcclient.InferInput("START", [1, 1], "INT32")
    start.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="START"):  # the agent's, not a client's
        client.infer("accumulate", [tensor, start], sequence_id=7, sequence_start=True)
    with pytest.raises(InferenceServerException, match="CORRID input is a number"):
        send(client, 1, "not-a-number", start=True)


def metric(agent, line_start: str) -> float:
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    return float(next(line for line in text.splitlines()
                      if line.startswith(line_start)).rsplit(" ", 1)[1])


def test_the_live_sequences_are_bounded_and_idle_ones_are_dropped(agent, client):
    for sequence_id in (1, 2, 3):
        send(client, sequence_id, sequence_id, start=True)
    with pytest.raises(InferenceServerException, match="3 sequences are live") as refused:
        send(client, 4, 4, start=True)
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    time.sleep(IDLE_US / 1e6 + 0.3)
    with pytest.raises(InferenceServerException, match="START flag"):
        send(client, 1, 1)  # idle past the limit: dropped
    assert send(client, 4, 4, start=True) == (4, 4)  # room again
    labels = 'model="accumulate",version="1",tier="edge"'
    assert metric(agent, f"tiered_live_sequences{{{labels}}}") == 1
    assert metric(agent, f'tiered_sequences_total{{{labels},outcome="expired"}}') >= 3
    send(client, 0, 4, end=True)


def test_tritonclients_stream_and_rest_carry_sequences(agent):
    answers = []
    with grpcclient.InferenceServerClient(agent.address) as client:
        client.start_stream(callback=lambda result, error: answers.append(error or result))
        for step, value in enumerate((7, 1, 1)):
            tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            client.async_stream_infer("accumulate", [tensor], sequence_id=555,
                                      sequence_start=step == 0, sequence_end=step == 2)
        client.stop_stream()
    assert [int(a.as_numpy("OUTPUT")[0, 0]) for a in answers] == [7, 8, 1009]
    with httpclient.InferenceServerClient(agent.http_address) as rest:
        values = []
        for step, value in enumerate((2, 3)):
            tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            values.append(int(rest.infer("accumulate", [tensor], sequence_id=9,
                                         sequence_start=step == 0).as_numpy("OUTPUT")[0, 0]))
        assert values == [2, 5]


def test_the_torch_engine_runs_the_same_sequences(tmp_path):
    write_model(tmp_path)
    pbtxt = tmp_path / "accumulate" / "config.pbtxt"
    data = {**triton_config.parse(pbtxt.read_text(), "config.pbtxt"), "backend": "torch",
            "engine": {"device": "cpu", "precision": "fp32"}}
    pbtxt.unlink()
    (tmp_path / "accumulate" / "config.yaml").write_text(yaml.safe_dump(data))
    with AgentProcess("datacenter", tmp_path, extra_args=["--front-ends", "0"]) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        assert client.get_model_config("accumulate").config.backend == "torch"
        assert send(client, 5, 21, start=True) == (5, 21)
        assert send(client, 100, 22, start=True) == (100, 22)
        assert send(client, 3, 21) == (8, 21)
        assert send(client, 2, 21, end=True) == (1010, 21)
        assert send(client, -1, 22, end=True) == (1099, 22)
