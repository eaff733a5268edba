"""Ensembles' configs: Triton's ensemble_scheduling read as config.yaml's
`ensemble`, the flow of tensors checked on its own, the steps checked
against their models' configs, and the order models load in. Pure."""

from __future__ import annotations

from typing import Any

import pytest

from tiered.agent import triton_config
from tiered.agent.config import ModelConfig, parse_model_config
from tiered.agent.ensemble import check_steps, load_order
from tiered.errors import ConfigError
from tiered.profiles import TierProfile, load_profile

PIPELINE_PBTXT = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IMAGE" data_type: TYPE_UINT8 dims: [ 8, 8 ] } ]
output [ { name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "RAW" value: "IMAGE" }
      output_map { key: "PIXELS" value: "pixels" }
    },
    {
      model_name: "classifier"
      model_version: 2
      input_map { key: "x" value: "pixels" }
      output_map { key: "logits" value: "logits" }
    },
    {
      model_name: "postprocess"
      input_map { key: "LOGITS" value: "logits" }
      output_map { key: "LABEL" value: "LABEL" }
    }
  ]
}
"""


@pytest.fixture(scope="module")
def edge() -> TierProfile:
    return load_profile("edge")


def tensor(name: str, datatype: str = "FP32", dims=(4,)) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "dims": list(dims)}


def step(model: str, inputs: dict, outputs: dict, **more) -> dict[str, Any]:
    return {"model": model, "inputs": inputs, "outputs": outputs, **more}


def ensemble(edge: TierProfile, steps: list, inputs=None, outputs=None, **more) -> ModelConfig:
    data = {"backend": "ensemble", "max_batch_size": 4,
            "inputs": inputs if inputs is not None else [tensor("IN")],
            "outputs": outputs if outputs is not None else [tensor("OUT")],
            "ensemble": {"steps": steps}, **more}
    return parse_model_config("ens", data, edge, "ens/config.yaml")


def model(edge: TierProfile, name: str, inputs, outputs, **more) -> ModelConfig:
    return parse_model_config(name, {"max_batch_size": 8, "inputs": inputs,
                                     "outputs": outputs, **more}, edge, f"{name}/config.yaml")


def test_triton_ensemble_scheduling_reads_as_config_yaml_steps(edge):
    data = triton_config.parse(PIPELINE_PBTXT, "pipeline/config.pbtxt")
    assert data["backend"] == "ensemble"
    assert data["ensemble"] == {"steps": [
        {"model": "preprocess", "version": -1, "inputs": {"RAW": "IMAGE"},
         "outputs": {"PIXELS": "pixels"}},
        {"model": "classifier", "version": 2, "inputs": {"x": "pixels"},
         "outputs": {"logits": "logits"}},
        {"model": "postprocess", "version": -1, "inputs": {"LOGITS": "logits"},
         "outputs": {"LABEL": "LABEL"}}]}
    config = parse_model_config("pipeline", data, edge, "pipeline/config.pbtxt")
    assert [s.model for s in config.ensemble.steps] == ["preprocess", "classifier",
                                                        "postprocess"]
    assert config.ensemble.steps[1].version == 2


def test_an_ensemble_needs_its_steps_and_only_an_ensemble_has_them(edge):
    with pytest.raises(ConfigError, match="ensemble: required for backend 'ensemble'"):
        parse_model_config("m", {"backend": "ensemble", "inputs": [tensor("IN")],
                                 "outputs": [tensor("OUT")]}, edge, "m/config.yaml")
    with pytest.raises(ConfigError, match="ensemble: only for backend 'ensemble', not 'onnx"):
        parse_model_config("m", {"ensemble": {"steps": [step("a", {}, {"y": "OUT"})]}},
                           edge, "m/config.yaml")


@pytest.mark.parametrize("steps, more, words", [
    ([], {}, "steps: an ensemble runs at least one step"),
    ([step("a", {"x": "IN"}, {"y": "OUT"})], {"inputs": []},
     "inputs, outputs: an ensemble declares both"),
    ([step("a", {"x": "IN"}, {"y": "OUT"})], {"dynamic_batching": {}},
     "has no scheduler of its own"),
    ([step("a", {"x": "IN"}, {})], {}, "steps[0].outputs: a step keeps at least one"),
    ([step("a", {"x": "IN"}, {"y": "OUT"}, version=0)], {},
     "version: -1 (the newest) or a version >= 1, got 0"),
    ([step("a", {"x": "nowhere"}, {"y": "OUT"})], {},
     "ensemble.steps[0].inputs.x: tensor 'nowhere' is no ensemble input and no step's output"),
    ([step("a", {"x": "IN"}, {"y": "t"})], {}, "ensemble output 'OUT' is produced by no step"),
    ([step("a", {"x": "IN"}, {"y": "OUT"}), step("b", {"x": "IN"}, {"z": "OUT"})], {},
     "steps[1].outputs.z: tensor 'OUT' is already produced by steps[0] (model 'a')"),
    ([step("a", {"x": "IN"}, {"y": "IN"})], {},
     "steps[0].outputs.y: tensor 'IN' is already produced by an ensemble input"),
    ([step("a", {"x": "IN"}, {"y": "OUT"})], {"inputs": [tensor("IN"), tensor("UNUSED")]},
     "ensemble input 'UNUSED' is read by no step"),
    ([step("ens", {"x": "IN"}, {"y": "OUT"})], {}, "an ensemble cannot be its own step"),
    ([step("a", {"x": "IN", "w": "u"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "u"}),
      step("c", {"x": "t"}, {"y": "OUT"})], {},
     "steps wait on each other in a cycle: steps[0] (a) -> steps[1] (b) -> steps[0] (a)"),
])
def test_a_tensor_flow_that_cannot_run_is_refused_by_field(edge, steps, more, words):
    with pytest.raises(ConfigError) as caught:
        ensemble(edge, steps, **more)
    assert words in str(caught.value)
    assert str(caught.value).startswith("ens/config.yaml")


@pytest.fixture
def models(edge):
    """pre (UINT8 [8] -> FP32 [4]), net (FP32 [4] -> FP32 [3]), post (FP32 [3] -> INT64 [1])."""
    return {
        "pre": model(edge, "pre", [tensor("RAW", "UINT8", (8,))], [tensor("PIXELS")]),
        "net": model(edge, "net", [tensor("x")], [tensor("logits", dims=(3,)),
                                                   tensor("hidden", dims=(2,))]),
        "post": model(edge, "post", [tensor("LOGITS", dims=(3,))],
                      [tensor("LABEL", "INT64", (1,))]),
    }


def pipeline(edge, **changes) -> ModelConfig:
    steps = {"pre": step("pre", {"RAW": "IMAGE"}, {"PIXELS": "pixels"}),
             "net": step("net", {"x": "pixels"}, {"logits": "logits"}),
             "post": step("post", {"LOGITS": "logits"}, {"LABEL": "LABEL"})}
    steps.update(changes.pop("steps", {}))
    return ensemble(edge, list(steps.values()),
                    inputs=changes.pop("inputs", [tensor("IMAGE", "UINT8", (8,))]),
                    outputs=changes.pop("outputs", [tensor("LABEL", "INT64", (1,))]), **changes)


def check(config: ModelConfig, models: dict) -> None:
    check_steps(config, [models[s.model] for s in config.ensemble.steps], "ens/config.yaml")


def test_steps_that_fit_their_models_pass(edge, models):
    check(pipeline(edge), models)


@pytest.mark.parametrize("changes, words", [
    ({"steps": {"pre": step("pre", {"RAW": "IMAGE", "EXTRA": "IMAGE"}, {"PIXELS": "pixels"})}},
     "steps[0].inputs.EXTRA: model 'pre' has no input 'EXTRA' (it has RAW)"),
    ({"steps": {"net": step("net", {}, {"logits": "logits"})}},
     "steps[1].inputs: model 'net' also needs 'x'"),
    ({"steps": {"net": step("net", {"x": "pixels"}, {"probs": "logits"})}},
     "steps[1].outputs.probs: model 'net' has no output 'probs' (it has logits, hidden)"),
    ({"inputs": [tensor("IMAGE", "FP32", (8,))]},
     "steps[0].inputs.RAW: tensor 'IMAGE' is FP32 (ensemble input 'IMAGE'), model 'pre' "
     "input 'RAW' takes UINT8"),
    ({"inputs": [tensor("IMAGE", "UINT8", (9,))]},
     "steps[0].inputs.RAW: tensor 'IMAGE' has shape [-1, 9] (ensemble input 'IMAGE'), "
     "model 'pre' input 'RAW' takes [-1, 8]"),
    ({"steps": {"net": step("net", {"x": "pixels"}, {"hidden": "logits"})}},
     "steps[2].inputs.LOGITS: tensor 'logits' has shape [-1, 2] (steps[1] output 'hidden')"),
    ({"outputs": [tensor("LABEL", "INT32", (1,))]},
     "ens/config.yaml.outputs: tensor 'LABEL' is INT64 (steps[2] output 'LABEL'), "
     "ensemble output 'LABEL' takes INT32"),
    ({"max_batch_size": 16}, "max_batch_size: 16 exceeds steps[0] model 'pre''s 8"),
])
def test_steps_that_do_not_fit_their_models_are_refused_by_field(edge, models, changes, words):
    with pytest.raises(ConfigError) as caught:
        check(pipeline(edge, **changes), models)
    assert words in str(caught.value)


def test_a_decoupled_step_is_refused(edge, models):
    models["net"] = parse_model_config(
        "net", {"backend": "onnxruntime-genai"}, edge, "net/config.yaml")
    with pytest.raises(ConfigError, match=r"steps\[1\].model: 'net' is decoupled .* not served"):
        check(pipeline(edge), models)
    with pytest.raises(ConfigError, match="decoupled: an ensemble answers each request once"):
        pipeline(edge, decoupled=True)


def test_an_ensemble_may_be_a_step_of_another(edge, models):
    inner = pipeline(edge)
    models["ens"] = inner
    outer = parse_model_config("outer", {
        "backend": "ensemble", "max_batch_size": 4,
        "inputs": [tensor("IMAGE", "UINT8", (8,))], "outputs": [tensor("L", "INT64", (1,))],
        "ensemble": {"steps": [step("ens", {"IMAGE": "IMAGE"}, {"LABEL": "L"})]}},
        edge, "outer/config.yaml")
    check(outer, models)


def test_models_load_after_the_models_their_steps_use():
    order, refused = load_order({"pipeline": {"pre", "net"}, "net": set(), "pre": set(),
                                 "outer": {"pipeline"}, "zeta": set(), "gone": {"missing"}})
    assert order.index("pipeline") > max(order.index("pre"), order.index("net"))
    assert order.index("outer") > order.index("pipeline")
    assert sorted(order) == ["gone", "net", "outer", "pipeline", "pre", "zeta"]
    assert refused == {}


def test_ensembles_that_use_each_other_are_refused_with_the_cycle():
    order, refused = load_order({"a": {"b"}, "b": {"a"}, "c": set(), "d": {"a"}})
    assert refused == {"a": "ensembles use each other in a cycle: a -> b -> a",
                       "b": "ensembles use each other in a cycle: a -> b -> a"}
    assert order == ["c", "d"]  # d loads, and fails there: its step model is not served
