"""Ensembles on a real agent, from a Triton-layout repository: pre-processing
(a uint8 image to normalized FP32), a small classifier and post-processing
(softmax and argmax) as one model `classify`, called with tritonclient over
gRPC, its stream and REST, through front ends and through a router."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tiered.local.processes import AgentProcess, RouterProcess
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc

CLASSES, SIDE = 10, 8
ADMIN_TOKEN = "ensembles-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}

PRE_PBTXT = f"""
name: "preprocess"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "RAW" data_type: TYPE_UINT8 dims: [ {SIDE}, {SIDE} ] }} ]
output [ {{ name: "PIXELS" data_type: TYPE_FP32 dims: [ {SIDE * SIDE} ] }} ]
"""
CLASSIFIER_PBTXT = f"""
name: "classifier"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {SIDE * SIDE} ] }} ]
output [ {{ name: "logits" data_type: TYPE_FP32 dims: [ {CLASSES} ] }} ]
dynamic_batching {{ }}
"""
POST_PBTXT = f"""
name: "postprocess"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "LOGITS" data_type: TYPE_FP32 dims: [ {CLASSES} ] }} ]
output [
  {{ name: "PROBS" data_type: TYPE_FP32 dims: [ {CLASSES} ] }},
  {{ name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] }}
]
"""
# As Triton's documentation writes an ensemble: an empty version directory beside it.
CLASSIFY_PBTXT = f"""
name: "classify"
platform: "ensemble"
max_batch_size: 4
input [ {{ name: "IMAGE" data_type: TYPE_UINT8 dims: [ {SIDE}, {SIDE} ] }} ]
output [
  {{ name: "PROBS" data_type: TYPE_FP32 dims: [ {CLASSES} ] }},
  {{ name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] }}
]
ensemble_scheduling {{
  step [
    {{
      model_name: "preprocess"
      model_version: -1
      input_map {{ key: "RAW" value: "IMAGE" }}
      output_map {{ key: "PIXELS" value: "pixels" }}
    }},
    {{
      model_name: "classifier"
      model_version: -1
      input_map {{ key: "x" value: "pixels" }}
      output_map {{ key: "logits" value: "logits" }}
    }},
    {{
      model_name: "postprocess"
      model_version: -1
      input_map {{ key: "LOGITS" value: "logits" }}
      output_map [
        {{ key: "PROBS" value: "PROBS" }},
        {{ key: "LABEL" value: "LABEL" }}
      ]
    }}
  ]
}}
"""


# An ensemble whose one step is the ensemble above; its name sorts before the
# models it waits on, which load first all the same.
NESTED_PBTXT = f"""
name: "all_in_one"
platform: "ensemble"
max_batch_size: 4
input [ {{ name: "PICTURE" data_type: TYPE_UINT8 dims: [ {SIDE}, {SIDE} ] }} ]
output [ {{ name: "CLASS" data_type: TYPE_INT64 dims: [ 1 ] }} ]
ensemble_scheduling {{
  step [ {{ model_name: "classify" model_version: -1
            input_map {{ key: "IMAGE" value: "PICTURE" }}
            output_map {{ key: "LABEL" value: "CLASS" }} }} ]
}}
"""


def _save(graph, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _vi(name: str, elem, *dims):
    return helper.make_tensor_value_info(name, elem, ["batch", *dims])


def write_classifier(path: Path, classes: int, rng: np.random.Generator) -> None:
    weights = helper.make_tensor("W", TensorProto.FLOAT, [SIDE * SIDE, classes],
                                 rng.normal(size=(SIDE * SIDE, classes)).astype(np.float32)
                                 .ravel().tolist())
    bias = helper.make_tensor("b", TensorProto.FLOAT, [classes],
                              rng.normal(size=classes).astype(np.float32).tolist())
    _save(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["product"]),
         helper.make_node("Add", ["product", "b"], ["logits"])],
        "classifier", [_vi("x", TensorProto.FLOAT, SIDE * SIDE)],
        [_vi("logits", TensorProto.FLOAT, classes)], initializer=[weights, bias]), path)


def write_models(root: Path) -> Path:
    """The three models and the ensemble, each with its config.pbtxt."""
    rng = np.random.default_rng(5)
    scalars = [helper.make_tensor("mean", TensorProto.FLOAT, [], [0.5]),
               helper.make_tensor("scale", TensorProto.FLOAT, [], [1 / (255 * 0.25)]),
               helper.make_tensor("flat", TensorProto.INT64, [2], [-1, SIDE * SIDE])]
    _save(helper.make_graph(
        [helper.make_node("Cast", ["RAW"], ["wide"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["wide", "scale"], ["unit"]),  # (x/255 - 0.5) / 0.25
         helper.make_node("Sub", ["unit", "mean"], ["centred"]),
         helper.make_node("Reshape", ["centred", "flat"], ["PIXELS"])],
        "preprocess", [_vi("RAW", TensorProto.UINT8, SIDE, SIDE)],
        [_vi("PIXELS", TensorProto.FLOAT, SIDE * SIDE)], initializer=scalars),
        root / "preprocess" / "1" / "model.onnx")
    write_classifier(root / "classifier" / "1" / "model.onnx", CLASSES, rng)
    _save(helper.make_graph(
        [helper.make_node("Softmax", ["LOGITS"], ["PROBS"], axis=-1),
         helper.make_node("ArgMax", ["LOGITS"], ["LABEL"], axis=-1, keepdims=1)],
        "postprocess", [_vi("LOGITS", TensorProto.FLOAT, CLASSES)],
        [_vi("PROBS", TensorProto.FLOAT, CLASSES), _vi("LABEL", TensorProto.INT64, 1)]),
        root / "postprocess" / "1" / "model.onnx")
    for name, text in (("preprocess", PRE_PBTXT), ("classifier", CLASSIFIER_PBTXT),
                       ("postprocess", POST_PBTXT), ("classify", CLASSIFY_PBTXT),
                       ("all_in_one", NESTED_PBTXT)):
        (root / name).mkdir(exist_ok=True)
        (root / name / "config.pbtxt").write_text(text)
    (root / "classify" / "1").mkdir()
    (root / "all_in_one" / "1").mkdir()
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return write_models(tmp_path_factory.mktemp("ensembles"))


@pytest.fixture(scope="module")
def agent(repository):
    with AgentProcess("edge", repository) as started:
        yield started
        assert started.alive(), started.log_tail()


@pytest.fixture
def client(agent):
    with grpcclient.InferenceServerClient(agent.address) as opened:
        yield opened


def images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, SIDE, SIDE), dtype=np.uint8)


def call(client, model: str, name: str, array: np.ndarray, outputs=None, module=grpcclient):
    tensor = module.InferInput(name, list(array.shape), {np.uint8: "UINT8",
                                                         np.float32: "FP32"}[array.dtype.type])
    tensor.set_data_from_numpy(array)
    wanted = None if outputs is None else [module.InferRequestedOutput(o) for o in outputs]
    return client.infer(model, [tensor], outputs=wanted)


def one_after_another(client, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pixels = call(client, "preprocess", "RAW", batch).as_numpy("PIXELS")
    logits = call(client, "classifier", "x", pixels).as_numpy("logits")
    answer = call(client, "postprocess", "LOGITS", logits)
    return answer.as_numpy("PROBS"), answer.as_numpy("LABEL")


def test_an_ensemble_answers_as_its_models_called_one_after_another(agent, client):
    batch = images(3)
    probs, labels = one_after_another(client, batch)
    answer = call(client, "classify", "IMAGE", batch)
    np.testing.assert_array_equal(answer.as_numpy("PROBS"), probs)
    np.testing.assert_array_equal(answer.as_numpy("LABEL"), labels)
    assert answer.as_numpy("PROBS").shape == (3, CLASSES)
    only = call(client, "classify", "IMAGE", batch, outputs=["LABEL"])
    assert only.get_response().outputs[0].name == "LABEL"
    np.testing.assert_array_equal(only.as_numpy("LABEL"), labels)
    with httpclient.InferenceServerClient(agent.http_address) as rest:
        over_rest = call(rest, "classify", "IMAGE", batch, module=httpclient)
        np.testing.assert_array_equal(over_rest.as_numpy("PROBS"), probs)
        assert len(rest.get_model_config("classify")["ensemble_scheduling"]["step"]) == 3


def test_an_ensemble_may_be_a_step_of_another(client):
    batch = images(2, seed=3)
    nested = call(client, "all_in_one", "PICTURE", batch).as_numpy("CLASS")
    np.testing.assert_array_equal(nested, one_after_another(client, batch)[1])


def test_an_ensemble_reads_and_writes_shared_memory(client):
    batch = images(2, seed=6)
    labels = one_after_another(client, batch)[1]
    name = f"tiered-ensemble-{uuid.uuid4().hex[:8]}"
    region = shm.create_shared_memory_region(name, f"/{name}", batch.nbytes + labels.nbytes)
    try:
        shm.set_shared_memory_region(region, [batch])
        client.register_system_shared_memory(name, f"/{name}", batch.nbytes + labels.nbytes)
        image = grpcclient.InferInput("IMAGE", list(batch.shape), "UINT8")
        image.set_shared_memory(name, batch.nbytes)
        label = grpcclient.InferRequestedOutput("LABEL")
        label.set_shared_memory(name, labels.nbytes, offset=batch.nbytes)
        client.infer("classify", [image], outputs=[label])
        written = shm.get_contents_as_numpy(region, np.int64, list(labels.shape),
                                            offset=batch.nbytes)
        np.testing.assert_array_equal(written, labels)
    finally:
        client.unregister_system_shared_memory(name)
        shm.destroy_shared_memory_region(region)


def test_an_ensemble_answers_on_a_stream(client):
    batch = images(2, seed=1)
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    try:
        tensor = grpcclient.InferInput("IMAGE", [2, SIDE, SIDE], "UINT8")
        tensor.set_data_from_numpy(batch)
        client.async_stream_infer("classify", [tensor])
    finally:
        client.stop_stream()  # waits for the answers
    [(result, error)] = answers
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("LABEL"), one_after_another(client, batch)[1])


def test_config_metadata_and_readiness_say_ensemble(client):
    config = client.get_model_config("classify").config
    assert config.platform == "ensemble" and not config.backend
    assert not config.instance_group
    steps = config.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["preprocess", "classifier", "postprocess"]
    assert [s.model_version for s in steps] == [-1, -1, -1]
    assert dict(steps[1].input_map) == {"x": "pixels"}
    assert dict(steps[2].output_map) == {"PROBS": "PROBS", "LABEL": "LABEL"}
    metadata = client.get_model_metadata("classify")
    assert metadata.platform == "ensemble"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == \
        [("IMAGE", "UINT8", [-1, SIDE, SIDE])]
    assert client.is_model_ready("classify")


def statistics(client, model: str):
    return client.get_inference_statistics(model).model_stats[0]


def step_calls(agent, step: str) -> float:
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    found = re.search(r'tiered_ensemble_step_duration_seconds_count\{[^}]*model="classify"'
                      rf'[^}}]*step="{step}"[^}}]*\}} (\S+)', text)
    assert found, text[-3000:]
    return float(found[1])


def test_statistics_count_the_ensemble_and_each_step_model(agent, client):
    names = ("classify", "preprocess", "classifier", "postprocess")
    before = {name: statistics(client, name) for name in names}
    steps_before = [step_calls(agent, str(i)) for i in range(3)]
    for seed in range(4):
        call(client, "classify", "IMAGE", images(2, seed))
    after = {name: statistics(client, name) for name in names}
    ensemble, was = after["classify"], before["classify"]
    assert ensemble.inference_stats.success.count - was.inference_stats.success.count == 4
    assert ensemble.inference_count - was.inference_count == 8  # images
    assert ensemble.execution_count - was.execution_count == 4  # one a request, as Triton
    # Its compute is its steps': at least the classifier's share of it.
    infer_ns = ensemble.inference_stats.compute_infer.ns - was.inference_stats.compute_infer.ns
    step_ns = (after["classifier"].inference_stats.compute_infer.ns
               - before["classifier"].inference_stats.compute_infer.ns)
    assert infer_ns >= step_ns > 0
    for name in names[1:]:  # each step model counts the calls the ensemble made
        assert (after[name].inference_stats.success.count
                - before[name].inference_stats.success.count) == 4, name
    assert [step_calls(agent, str(i)) - steps_before[i] for i in range(3)] == [4, 4, 4]
    with grpc.insecure_channel(agent.address) as channel:
        telemetry = tpb_grpc.TelemetryStub(channel).Stats(
            tpb.StatsRequest(model_name="classify"), timeout=10)
    [version] = telemetry.versions
    assert not version.has_energy  # it owns no device: its steps' models hold the energy


def test_a_wrong_input_is_refused_naming_it(client):
    with pytest.raises(InferenceServerException,
                       match="inference input 'IMAGE' data-type is 'FP32', but model "
                             "'classify' expects 'UINT8'"):
        call(client, "classify", "IMAGE", images(1).astype(np.float32))
    with pytest.raises(InferenceServerException, match="batch-size must be <= 4"):
        call(client, "classify", "IMAGE", images(5))


def test_an_unloaded_step_model_fails_the_ensemble_by_name(tmp_path):
    repository = write_models(tmp_path / "models")
    token = tmp_path / "admin.token"
    token.write_text(f"{ADMIN_TOKEN}\n")
    with AgentProcess("edge", repository, admin_token_file=token) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        client.unload_model("classifier", headers=ADMIN)
        assert not client.is_model_ready("classify")
        with pytest.raises(InferenceServerException) as caught:
            call(client, "classify", "IMAGE", images(1))
        assert "ensemble 'classify' steps[1] (model 'classifier'): its model is not " \
               "served" in str(caught.value)
        assert caught.value.status() == "StatusCode.UNAVAILABLE"
        client.load_model("classifier", headers=ADMIN)
        assert client.is_model_ready("classify")
        assert call(client, "classify", "IMAGE", images(1)).as_numpy("LABEL").shape == (1, 1)
        # A new classifier version with 5 classes: the ensemble is checked again.
        write_classifier(repository / "classifier" / "2" / "model.onnx", 5,
                         np.random.default_rng(1))
        (repository / "classifier" / "config.pbtxt").write_text(
            CLASSIFIER_PBTXT.replace(f"dims: [ {CLASSES} ]", "dims: [ 5 ]"))
        client.load_model("classifier", headers=ADMIN)
        [row] = [m for m in client.get_model_repository_index().models if m.name == "classify"]
        assert "steps[2].inputs.LOGITS: tensor 'logits' has shape [-1, 5] (steps[1] output " \
            "'logits'), model 'postprocess' input 'LOGITS' takes [-1, 10]" in row.reason
        with pytest.raises(InferenceServerException, match=r"steps\[2\] \(model 'postprocess'\)"):
            call(client, "classify", "IMAGE", images(1))
        assert agent.alive()


def test_ensembles_that_cannot_run_are_refused_with_their_reason(tmp_path):
    root = write_models(tmp_path / "models")
    broken = {
        "missing_step": CLASSIFY_PBTXT.replace('"classifier"', '"nowhere"'),
        "wrong_type": CLASSIFY_PBTXT.replace("TYPE_UINT8", "TYPE_FP32"),
        # the classifier's output renamed: the post-processing reads nothing
        "no_producer": CLASSIFY_PBTXT.replace('value: "logits" }', 'value: "logitz" }', 1),
        "loop_a": CLASSIFY_PBTXT.replace('"preprocess"', '"loop_b"'),
        "loop_b": CLASSIFY_PBTXT.replace('"preprocess"', '"loop_a"'),
    }
    for name, text in broken.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text.replace('"classify"', f'"{name}"'))
    with AgentProcess("edge", root, extra_args=["--allow-failed-models"]) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        reasons = {m.name: m.reason for m in client.get_model_repository_index().models}
        assert client.is_model_ready("classify")
    assert "ensemble.steps[1].model: 'nowhere' is not served here; load it first" \
        in reasons["missing_step"]
    assert "tensor 'IMAGE' is FP32 (ensemble input 'IMAGE'), model 'preprocess' input " \
        "'RAW' takes UINT8" in reasons["wrong_type"]
    assert reasons["no_producer"] == "no_producer/config.pbtxt: ensemble.steps[2].inputs." \
        "LOGITS: tensor 'logits' is no ensemble input and no step's output"
    assert reasons["loop_a"] == reasons["loop_b"] == \
        "ensembles use each other in a cycle: loop_a -> loop_b -> loop_a"


def test_an_ensemble_through_front_ends(repository):
    with AgentProcess("edge", repository, extra_args=["--front-ends", "2"]) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        batch = images(3, seed=4)
        probs, labels = one_after_another(client, batch)
        answer = call(client, "classify", "IMAGE", batch)
        np.testing.assert_array_equal(answer.as_numpy("PROBS"), probs)
        np.testing.assert_array_equal(answer.as_numpy("LABEL"), labels)
        assert statistics(client, "classify").inference_stats.success.count == 1
        text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
        fed = re.search(r'tiered_front_end_requests_total\{frame="single"[^}]*\} (\S+)', text)
        assert fed and float(fed[1]) >= 1  # the ensemble's request came through a front end


def test_an_ensemble_through_a_router(agent, client, tmp_path):
    table = tmp_path / "routing.json"
    table.write_text(json.dumps({"version": 1, "models": {"classify": {"tiers": {
        "edge": {"agents": [agent.address]}}}}}))
    batch = images(2, seed=9)
    with RouterProcess(table) as router, \
            grpcclient.InferenceServerClient(router.address) as routed:
        answer = call(routed, "classify", "IMAGE", batch)
    np.testing.assert_array_equal(answer.as_numpy("LABEL"), one_after_another(client, batch)[1])


def test_a_sequence_runs_through_an_ensemble_of_a_stateful_model(tmp_path):
    from tests.integration.test_sequences import write_model

    write_model(tmp_path)  # `accumulate`: a running sum kept as implicit state
    (tmp_path / "running_sum" / "1").mkdir(parents=True)
    (tmp_path / "running_sum" / "config.yaml").write_text(
        "backend: ensemble\nmax_batch_size: 4\n"
        "inputs: [{name: VALUE, datatype: INT32, dims: [1]}]\n"
        "outputs: [{name: SUM, datatype: INT32, dims: [1]}]\n"
        "ensemble:\n  steps:\n"
        "    - {model: accumulate, inputs: {INPUT: VALUE}, outputs: {OUTPUT: SUM}}\n")
    with AgentProcess("edge", tmp_path) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        def send(value: int, **flags) -> int:
            tensor = grpcclient.InferInput("VALUE", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            return int(client.infer("running_sum", [tensor], sequence_id=42,
                                    **flags).as_numpy("SUM")[0, 0])

        assert send(5, sequence_start=True) == 5
        assert send(3) == 8
        assert send(2, sequence_end=True) == 1010  # the END adds 1000
        with pytest.raises(InferenceServerException, match="must specify the START flag"):
            send(1)
