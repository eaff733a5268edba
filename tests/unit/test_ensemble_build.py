"""The pure parts of an ensemble's build: the chain's order and run, the
ensemble's inputs, each step's lowering, integer outputs compared by
equality, one verdict over several outputs, and versions installed all
together or not at all."""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pytest

from tests.unit.test_build import snapshot
from tiered.engines import TensorSpec
from tiered.engines.build import BuildRequest, ChainStep, EnsembleChain, choose_settings
from tiered.engines.build import build as tier_build
from tiered.engines.build.chain import (
    choose_step_lowering,
    input_specs,
    rows_per_run,
    run_chain,
)
from tiered.engines.build.gate import Agreement, compare_outputs, judge_outputs
from tiered.engines.build.install import Placement, install_versions
from tiered.errors import ConfigError
from tiered.profiles import load_profile

F32, U8, I64 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int64)

# Written out of order: the classifier reads what pre-processing writes.
CHAIN = EnsembleChain(
    name="classify", config_file="config.pbtxt", inputs=("IMAGE",), outputs=("PROBS", "LABEL"),
    max_batch_size=4,
    steps=(ChainStep("classifier", -1, {"x": "pixels"}, {"logits": "logits"}),
           ChainStep("postprocess", -1, {"LOGITS": "logits"},
                     {"PROBS": "PROBS", "LABEL": "LABEL"}),
           ChainStep("preprocess", -1, {"RAW": "IMAGE"}, {"PIXELS": "pixels"})))
STEP_INPUTS = ([TensorSpec("x", F32, (-1, 4))], [TensorSpec("LOGITS", F32, (-1, 3))],
               [TensorSpec("RAW", U8, (-1, 2, 2))])


def test_steps_run_after_the_steps_they_read_from() -> None:
    assert CHAIN.order == (2, 0, 1)


def test_a_chain_run_hands_each_steps_outputs_to_the_next() -> None:
    def run_step(index, inputs):
        if index == 2:
            return {"PIXELS": inputs["RAW"].reshape(-1, 4).astype(np.float32) / 255}
        if index == 0:
            return {"logits": inputs["x"][:, :3] * 2}
        return {"PROBS": inputs["LOGITS"], "LABEL": inputs["LOGITS"].argmax(1)[:, None]}

    image = np.array([[[255, 0], [0, 0]], [[0, 0], [255, 0]]], dtype=np.uint8)
    tensors = run_chain(CHAIN, {"IMAGE": image}, run_step)

    np.testing.assert_array_equal(tensors["LABEL"], [[0], [2]])
    assert set(tensors) == {"IMAGE", "pixels", "logits", "PROBS", "LABEL"}


@pytest.mark.parametrize("steps, message", [
    ((ChainStep("a", -1, {"x": "t2"}, {"y": "t1"}), ChainStep("b", -1, {"x": "t1"}, {"y": "t2"})),
     "cycle"),
    ((ChainStep("a", -1, {"x": "IN"}, {"y": "t1"}), ChainStep("a", -1, {"x": "t1"}, {"y": "OUT"})),
     "names one model twice"),
])
def test_a_chain_that_cannot_be_built_is_refused(steps, message) -> None:
    with pytest.raises(ConfigError, match=message):
        EnsembleChain("e", "config.yaml", ("IN",), ("OUT",), 0, steps).order  # noqa: B018


def test_the_ensembles_inputs_are_typed_by_the_step_that_reads_them() -> None:
    assert input_specs(CHAIN, STEP_INPUTS) == (TensorSpec("IMAGE", U8, (-1, 2, 2)),)
    with pytest.raises(ConfigError, match="model 'classifier' has no input 'x'"):
        input_specs(CHAIN, ([TensorSpec("z", F32, (-1, 4))], *STEP_INPUTS[1:]))


@pytest.mark.parametrize("leading, rows", [((-1, -1), None), ((-1, 1), 1), ((1, 1), 1)])
def test_rows_per_run_follow_the_step_models_batch_dimensions(leading, rows) -> None:
    inputs = [[TensorSpec(f"x{i}", F32, (d, 3))] for i, d in enumerate(leading)]
    assert rows_per_run(inputs) == rows


def test_rows_per_run_refuse_a_fixed_batch_of_several() -> None:
    with pytest.raises(ConfigError, match="leading dimension"):
        rows_per_run([[TensorSpec("x", F32, (8, 3))]])


@pytest.mark.parametrize("backend, precision, tensors, expected", [
    ("onnxruntime", "int8", [("x", F32), ("logits", F32)], ("onnxruntime", "int8", None)),
    ("onnxruntime", "int8", [("RAW", U8), ("PIXELS", F32)],
     ("onnxruntime", "fp32", "kept FP32: not floating point: RAW (uint8)")),
    ("onnxruntime", "fp16", [("LOGITS", F32), ("LABEL", I64)],
     ("onnxruntime", "fp32", "kept FP32: not floating point: LABEL (int64)")),
    ("torch", "fp16", [("RAW", U8), ("PIXELS", F32)],
     ("onnxruntime", "fp32", "kept FP32: not floating point: RAW (uint8)")),
    ("torch", "fp16", [("x", F32)], ("torch", "fp16", None)),
    ("onnxruntime", "fp32", [("RAW", U8)], ("onnxruntime", "fp32", None)),
])
def test_steps_with_tensors_that_are_not_floating_point_stay_fp32(
        backend, precision, tensors, expected) -> None:
    specs = [TensorSpec(name, dtype, (-1, 1)) for name, dtype in tensors]
    lowering = choose_step_lowering(backend, precision, specs)
    assert (lowering.backend, lowering.precision, lowering.kept_fp32) == expected


def test_an_integer_label_output_is_compared_by_equality_and_scored_against_labels() -> None:
    reference = np.array([[1], [2], [3], [4]], dtype=np.int64)
    candidate = np.array([[1], [2], [0], [4]], dtype=np.int64)

    agreement = compare_outputs("LABEL", reference, candidate, np.array([1, 2, 3, 0]))

    assert agreement.method == "exact"
    assert agreement.top1_agreement == 0.75  # not argmax over one value, which always agrees
    assert (agreement.reference_accuracy, agreement.build_accuracy) == (0.75, 0.5)
    assert agreement.max_abs_error == 3.0


def test_integer_outputs_of_several_values_agree_only_where_all_are_equal() -> None:
    reference = np.array([[1, 2], [3, 4]], dtype=np.int32)
    agreement = compare_outputs("boxes", reference, np.array([[1, 2], [3, 5]], dtype=np.int32))
    assert agreement.top1_agreement == 0.5 and agreement.reference_accuracy is None


def _agreement(output: str, top1: float | None, method: str = "top1") -> Agreement:
    return Agreement(output, 200, top1, 0.01, 0.001, 0, method=method)


@pytest.mark.parametrize("agreements, verdict, words", [
    ([_agreement("PROBS", 1.0), _agreement("LABEL", 1.0, "exact")], "pass",
     ["exact agreement 1.0000", "top-1 agreement 1.0000"]),
    ([_agreement("PROBS", 1.0), _agreement("LABEL", 0.9, "exact")], "fail",
     ["'LABEL': exact agreement below the threshold"]),
    ([_agreement("PROBS", 1.0), _agreement("score", None)], "pass",
     ["'score': max abs error 0.01", "not gated"]),
    ([_agreement("score", None)], "inconclusive", ["no top-1 to compare"]),
    ([_agreement("PROBS", 0.5), Agreement("LABEL", 20, 1.0, 0, 0, 0, method="exact")], "fail",
     ["top-1 agreement below"]),
])
def test_one_verdict_over_the_ensembles_outputs_is_the_worst(agreements, verdict, words) -> None:
    decision = judge_outputs(agreements, min_agreement=0.99, min_samples=100)

    assert decision.verdict == verdict and decision.accepted == (verdict == "pass")
    assert decision.reason.startswith(f"{verdict}: ")
    for word in words:
        assert word in decision.reason


# -- installing an ensemble and its steps -------------------------------------------------------


def _finished(root: Path, name: str, content: bytes) -> Path:
    path = root / "work" / name
    path.mkdir(parents=True)
    (path / "model.onnx").write_bytes(content)
    return path


def test_an_ensemble_and_its_steps_are_installed_together_with_configs_only_where_absent(
        tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    (repository / "b").mkdir(parents=True)
    (repository / "b" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    placements = [Placement(_finished(tmp_path, name, name.encode()), name, "config.yaml",
                            f"backend: {name}\n") for name in ("a", "b")]

    placed = install_versions(placements, repository, 2, force=False)

    assert placed == [repository / "a" / "2", repository / "b" / "2"]
    assert (repository / "b" / "2" / "model.onnx").read_bytes() == b"b"
    assert sorted(p.name for p in (repository / "b").iterdir()) == ["2", "config.pbtxt"]
    assert (repository / "a" / "config.yaml").read_text() == "backend: a\n"


def test_when_one_version_cannot_go_in_none_does(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    (repository / "b" / "2").mkdir(parents=True)
    (repository / "b" / "2" / "model.onnx").write_bytes(b"old")
    before = snapshot(repository)
    placements = [Placement(_finished(tmp_path, name, b"new"), name, "config.yaml", "x: 1\n")
                  for name in ("a", "b")]

    with pytest.raises(ConfigError, match="b/2 already exists"):
        install_versions(placements, repository, 2, force=False)

    assert snapshot(repository) == before and not (repository / "a").exists()
    assert sorted(p.name for p in (repository / "b").iterdir()) == ["2"]


# -- refusals before any step is built --------------------------------------------------------


def _source(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    (source / "classify").mkdir(parents=True)
    (source / "classify" / "config.pbtxt").write_text('platform: "ensemble"\n')
    return source


@pytest.mark.parametrize("chain, existing, message", [
    (CHAIN, "classifier/3", "step model 'classifier' already has version 3"),
    (CHAIN, "classify/2", "classify/2 already exists; pass --force"),
    (EnsembleChain("classify", "config.pbtxt", ("IMAGE",), ("PROBS",), 4,
                   (ChainStep("classifier", 1, {"x": "IMAGE"}, {"logits": "PROBS"}),)),
     None, r"ensemble.steps\[0\].model_version: 1 of 'classifier'.*give -1"),
])
def test_an_ensemble_build_that_would_serve_an_unjudged_chain_is_refused_first(
        tmp_path: Path, chain, existing, message) -> None:
    repository = tmp_path / "repo"
    if existing:
        (repository / existing).mkdir(parents=True)
    before = snapshot(repository) if repository.exists() else {}
    profile = load_profile("edge")
    request = BuildRequest(source=_source(tmp_path), repository=repository, model="classify",
                           version=2, ensemble=chain)

    with pytest.raises(ConfigError, match=message):
        tier_build(request, profile, choose_settings(profile, {}),
                   now=datetime.datetime.now(datetime.timezone.utc))

    assert (snapshot(repository) if repository.exists() else {}) == before
