"""Ensembles' configs: Triton's ensemble_scheduling read as config.yaml's
`ensemble`, the flow of tensors checked on its own, the steps checked
against their models' configs, and the order models load in. Pure."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
import yaml

from tiered.agent import triton_config
from tiered.agent.config import ModelConfig, parse_model_config
from tiered.agent.ensemble import EnsembleVersion, check_steps, load_order
from tiered.agent.model import Answer
from tiered.errors import ConfigError, DeadlineExceeded, NotFound, Unavailable
from tiered.profiles import TierProfile, load_profile
from tiered.telemetry.inference_stats import BatchTiming

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


def test_config_yaml_spells_an_ensemble_directly(edge):
    data = yaml.safe_load("""
backend: ensemble
max_batch_size: 4
inputs:  [{name: IMAGE, datatype: UINT8, dims: [8, 8]}]
outputs: [{name: LABEL, datatype: INT64, dims: [1]}]
ensemble:
  steps:
    - {model: preprocess, inputs: {RAW: IMAGE}, outputs: {PIXELS: pixels}}
    - {model: classifier, version: -1, inputs: {x: pixels}, outputs: {logits: logits}}
    - {model: postprocess, inputs: {LOGITS: logits}, outputs: {LABEL: LABEL}}
""")
    from_yaml = parse_model_config("pipeline", data, edge, "pipeline/config.yaml")
    from_pbtxt = parse_model_config("pipeline", triton_config.parse(
        PIPELINE_PBTXT.replace("model_version: 2", "model_version: -1"),
        "pipeline/config.pbtxt"), edge, "pipeline/config.pbtxt")
    assert from_yaml.ensemble == from_pbtxt.ensemble
    with pytest.raises(ConfigError, match=r"ensemble.steps\[0\]: unknown key 'input'"):
        parse_model_config("pipeline", {**data, "ensemble": {"steps": [
            {"model": "preprocess", "input": {}, "outputs": {"PIXELS": "pixels"}}]}},
            edge, "pipeline/config.yaml")


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


# --- EnsembleVersion with step models standing in for served versions ------------


class StepModel:
    """A served version's interface: answers `out = in + 1` after `delay_s`,
    and remembers what it was handed."""

    def __init__(self, config: ModelConfig, delay_s: float = 0.0, error=None) -> None:
        self.config, self.ready = config, True
        self.delay_s, self.error = delay_s, error
        self.calls: list[tuple[dict, float]] = []
        self.running = 0
        self.most_running = 0
        self.cancelled = False

    async def infer_timed(self, inputs, requested=(), deadline=math.inf, tracer=None,
                          requests=(), sequence=None) -> Answer:
        self.calls.append((dict(inputs), deadline))
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.error is not None:
            raise self.error
        [array] = inputs.values()
        return Answer({name: array + 1 for name in requested}, 1000,
                      BatchTiming(10, 100, 1))


def run(coroutine):
    return asyncio.run(coroutine)


def test_steps_run_side_by_side_and_hand_on_their_arrays(edge):
    config = ensemble(edge, [step("left", {"x": "IN"}, {"y": "l"}),
                             step("right", {"x": "IN"}, {"y": "OUT2"}),
                             step("join", {"x": "l"}, {"y": "OUT"})],
                      outputs=[tensor("OUT"), tensor("OUT2")])
    simple = {name: model(edge, name, [tensor("x")], [tensor("y")])
              for name in ("left", "right", "join")}
    served = {name: StepModel(c, delay_s=0.05) for name, c in simple.items()}
    started = []

    async def main():
        version = EnsembleVersion(config, 1, lambda name, v: served[name])
        image = np.zeros((2, 4), np.float32)
        task = asyncio.ensure_future(version.infer({"IN": image}, deadline=123.0))
        await asyncio.sleep(0.02)
        started.extend(name for name, s in served.items() if s.calls)
        return image, await task, version

    image, answer, version = run(main())
    assert sorted(started) == ["left", "right"]  # both read IN: both started at once
    assert served["left"].calls[0][0]["x"] is image  # the request's array, not a copy
    [(join_inputs, deadline)] = served["join"].calls
    assert deadline == 123.0
    np.testing.assert_array_equal(answer["OUT"], image + 2)
    np.testing.assert_array_equal(answer["OUT2"], image + 1)
    stats = version.stats
    assert (stats.success.count, stats.inference_count, stats.execution_count) == (1, 2, 1)
    assert stats.compute_infer.ns == 300  # its three steps' compute
    assert [s.seconds.count for s in version.step_stats] == [1, 1, 1]


def test_only_the_steps_the_requested_outputs_need_run(edge):
    config = ensemble(edge, [step("left", {"x": "IN"}, {"y": "OUT"}),
                             step("right", {"x": "IN"}, {"y": "OUT2"})],
                      outputs=[tensor("OUT"), tensor("OUT2")])
    simple = model(edge, "m", [tensor("x")], [tensor("y")])
    served = {"left": StepModel(simple), "right": StepModel(simple)}
    version = None

    async def main():
        nonlocal version
        version = EnsembleVersion(config, 1, lambda name, v: served[name])
        return await version.infer({"IN": np.zeros((1, 4), np.float32)}, ["OUT2"])

    assert list(run(main())) == ["OUT2"]
    assert not served["left"].calls and served["right"].calls


def test_a_failed_step_fails_the_ensemble_by_name_and_stops_the_others(edge):
    config = ensemble(edge, [step("left", {"x": "IN"}, {"y": "OUT"}),
                             step("right", {"x": "IN"}, {"y": "OUT2"})],
                      outputs=[tensor("OUT"), tensor("OUT2")])
    simple = model(edge, "m", [tensor("x")], [tensor("y")])
    served = {"left": StepModel(simple, error=DeadlineExceeded("too late")),
              "right": StepModel(simple, delay_s=10)}
    version = None

    async def main():
        nonlocal version
        version = EnsembleVersion(config, 1, lambda name, v: served[name])
        await version.infer({"IN": np.zeros((1, 4), np.float32)})

    with pytest.raises(DeadlineExceeded, match=r"ensemble 'ens' steps\[0\] \(model 'left'\): "
                                               "too late"):
        run(main())
    assert served["right"].cancelled
    assert version.stats.fail.count == 1 and version.step_stats[0].failures == 1


def test_a_step_model_gone_fails_the_ensemble_as_unavailable(edge):
    config = ensemble(edge, [step("left", {"x": "IN"}, {"y": "OUT"})])

    def lookup(name, version):
        raise NotFound(f"Request for unknown model: '{name}' is not found")

    async def main():
        version = EnsembleVersion(config, 1, lookup)
        assert not version.ready
        await version.infer({"IN": np.zeros((1, 4), np.float32)})

    with pytest.raises(Unavailable, match=r"steps\[0\] \(model 'left'\): its model is not "
                                          "served"):
        run(main())
