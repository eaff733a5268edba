"""A Triton model repository (config.pbtxt) served as one with config.yaml is."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.generation import generate
from tiered.agent import triton_config
from tiered.agent.repository import model_file
from tiered.errors import ConfigError
from tiered.local.processes import AgentError, AgentProcess
from tiered.models import zoo

# Written the way Triton's documentation writes a model configuration, with a
# field this agent does not read (optimization), which it names and ignores.
ADD_SUB_PBTXT = """
name: "add_sub"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest: { num_versions: 1 } }
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  },
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  },
  {
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
instance_group [ { count: 2, kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 500
  default_queue_policy { max_queue_size: 32 }
}
optimization { graph { level: 1 } }
"""


def test_a_triton_config_reads_as_the_mapping_config_yaml_would_hold():
    data = triton_config.parse(ADD_SUB_PBTXT, "add_sub/config.pbtxt")
    assert data == {
        "name": "add_sub", "backend": "onnxruntime", "max_batch_size": 8,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "dims": [16]},
                   {"name": "INPUT1", "datatype": "FP32", "dims": [16]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "dims": [16]},
                    {"name": "OUTPUT1", "datatype": "FP32", "dims": [16]}],
        "dynamic_batching": {"preferred_batch_sizes": [4, 8], "max_queue_delay_us": 500,
                             "max_queue_size": 32},
        "version_policy": {"latest": 1}, "instance_count": 2,
    }


@pytest.mark.parametrize("text, words", [
    ('platform: "python"', "'python' is not served here"),
    ('default_model_filename: "model.pt"', "must be model.onnx"),
    ("input [ { name: \"x\" dims: [ 1 ] } ]", "data_type: missing"),
    ("max_batch_size: [", "not a Triton model configuration"),
    ('backend: "onnxruntime-genai"', "a generative backend streams many responses"),
    ('backend: "onnxruntime_genai" model_transaction_policy { decoupled: true } '
     'default_model_filename: "model.onnx"', "a generative version is a directory"),
])
def test_what_cannot_be_served_is_refused_by_name(text, words):
    with pytest.raises(ConfigError) as caught:
        triton_config.parse(text, "m/config.pbtxt")
    assert words in str(caught.value)


def test_an_agent_serves_a_triton_model_directory(tmp_path):
    zoo.add_sub(model_file(tmp_path, "add_sub", 1))
    (tmp_path / "add_sub" / "config.pbtxt").write_text(ADD_SUB_PBTXT)
    with AgentProcess("edge", tmp_path) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        config = client.get_model_config("add_sub").config
        assert config.max_batch_size == 8
        assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
        a = np.arange(16, dtype=np.float32)[None]
        inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
        for item in inputs:
            item.set_data_from_numpy(a)
        np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), 2 * a)
        assert "ignoring what this agent does not read" in agent.log()


def test_a_model_with_both_configs_is_refused(tmp_path):
    zoo.add_sub(model_file(tmp_path, "add_sub", 1))
    (tmp_path / "add_sub" / "config.pbtxt").write_text(ADD_SUB_PBTXT)
    (tmp_path / "add_sub" / "config.yaml").write_text("max_batch_size: 8\n")
    with pytest.raises(AgentError) as caught:
        AgentProcess("edge", tmp_path).start()
    assert "both config.yaml and config.pbtxt; keep one" in str(caught.value)


GENERATIVE_PBTXT = """
name: "tiny"
backend: "onnxruntime_genai"
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


def test_an_agent_serves_a_decoupled_triton_model_directory(tmp_path, generative_model):
    import shutil

    shutil.copytree(generative_model, tmp_path / "tiny" / "1")
    (tmp_path / "tiny" / "config.pbtxt").write_text(GENERATIVE_PBTXT)
    with AgentProcess("edge", tmp_path) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        config = client.get_model_config("tiny").config
        assert config.model_transaction_policy.decoupled
        assert config.backend == "onnxruntime-genai"
        answer = generate(client, max_tokens=5)
        assert len(answer.as_numpy("token_ids")) == 5


SEQUENCE_PBTXT = """
name: "counter"
backend: "onnxruntime"
max_batch_size: 2
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  state [ { input_name: "IN_STATE" output_name: "OUT_STATE" data_type: TYPE_FP32 dims: [ 4 ] } ]
}
"""


def test_a_triton_sequence_batcher_reads_as_its_config_yaml_mapping():
    data = triton_config.parse(SEQUENCE_PBTXT, "counter/config.pbtxt")
    assert data["sequence_batching"] == {
        "controls": [{"name": "START", "kind": "start", "datatype": "FP32", "false_true": [0, 1]},
                     {"name": "READY", "kind": "ready", "datatype": "BOOL",
                      "false_true": [False, True]},
                     {"name": "CORRID", "kind": "corrid", "datatype": "BYTES"}],
        "states": [{"input": "IN_STATE", "output": "OUT_STATE", "datatype": "FP32",
                    "dims": [4]}],
        "strategy": "direct", "max_sequence_idle_us": 5_000_000}
    with pytest.raises(ConfigError, match="give one of int32_false_true"):
        triton_config.parse(SEQUENCE_PBTXT.replace("fp32_false_true: [ 0, 1 ] ", ""), "c")
    with pytest.raises(ConfigError, match="only zero_data"):
        triton_config.parse(SEQUENCE_PBTXT.replace(
            "dims: [ 4 ] }", 'dims: [ 4 ] initial_state { data_file: "x" } }'), "c")
