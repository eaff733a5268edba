"""Tier builds: the pure parts as tables, and real builds of the trained digits
model through ONNX Runtime's quantizer, its FP16 converter and the torch engine."""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto

from tiered import cli
from tiered.engines import TensorSpec
from tiered.engines import build as tier_build
from tiered.engines.build import BuildRequest, choose_settings, version_facts
from tiered.engines.build.gate import (
    Agreement,
    LatencySummary,
    compare_outputs,
    judge,
    summarize_latency,
)
from tiered.engines.build.install import install_version
from tiered.engines.build.samples import load_samples, random_samples
from tiered.errors import ConfigError, EngineError
from tiered.files import sha256_file
from tiered.models import zoo
from tiered.profiles import load_profile

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
FAST = {"latency_runs": 3}  # the builds here are checked for accuracy, not timed


def trained_digits(digits_models: Path) -> tuple[Path, Path, Path]:
    """digits v1 (ONNX, calibration npz, eval npz) from the session's trained
    digits models (`digits_models`, trained once for every worker)."""
    from tiered.models import digits

    return (digits_models / "digits-v1.onnx", digits_models / digits.CALIBRATION_FILE,
            digits_models / digits.EVAL_FILE)


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with its content digest: equal snapshots, untouched tree."""
    return {
        str(p.relative_to(root)): sha256_file(p) if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def run_build(source: Path, tier: str, repository: Path, version: int, *, model: str = "digits",
              calibration: Path | None = None, evaluation: Path | None = None,
              allow_accuracy_drop: bool = False, force: bool = False, **overrides):
    profile = load_profile(tier)
    settings = choose_settings(profile, {**FAST, **overrides})
    request = BuildRequest(source, repository, model, version, calibration, evaluation,
                           force=force, allow_accuracy_drop=allow_accuracy_drop)
    return tier_build.build(request, profile, settings, now=NOW)


# -- choosing settings: profile defaults, flags over them ------------------------------------


@pytest.mark.parametrize(
    "tier, flags, expected",
    [
        ("edge", {}, {"backend": "onnxruntime", "precision": "int8",
                      "calibration_method": "minmax", "min_agreement": 0.99,
                      "per_channel": True, "latency_batch_sizes": (1, 32)}),
        ("edge", {"calibration_method": "entropy", "min_agreement": None},
         {"calibration_method": "entropy", "min_agreement": 0.99}),
        ("edge", {"min_agreement": 0.9, "calibration_samples": 64},
         {"min_agreement": 0.9, "calibration_samples": 64}),
        ("regional", {}, {"backend": "onnxruntime", "precision": "fp16", "max_batch_size": 64}),
        ("regional", {"precision": "fp32", "max_batch_size": 8},
         {"precision": "fp32", "max_batch_size": 8}),
        ("datacenter", {}, {"backend": "torch", "precision": "fp16"}),
        ("datacenter", {"precision": "bf16"}, {"backend": "torch", "precision": "bf16"}),
        ("datacenter", {"backend": "onnxruntime", "precision": "int8"},
         {"backend": "onnxruntime", "precision": "int8"}),
    ],
)
def test_flags_given_override_the_tier_profiles_build_defaults(tier, flags, expected) -> None:
    settings = choose_settings(load_profile(tier), flags)

    assert {key: getattr(settings, key) for key in expected} == expected


@pytest.mark.parametrize(
    "tier, flags, message",
    [
        ("edge", {"precision": "bf16"}, "build.precision: 'bf16' cannot be built for backend "
                                        "onnxruntime"),
        ("datacenter", {"precision": "int8"}, "build.precision: 'int8' cannot be built for "
                                              "backend torch"),
        ("edge", {"calibration_method": "kl"}, "build.calibration_method: 'kl' is not one of "
                                               "minmax, entropy, percentile"),
        ("edge", {"min_agreement": 1.5}, "build.min_agreement: must be within 0..1, got 1.5"),
        ("edge", {"calibration_sampels": 3}, "build: unknown key 'calibration_sampels'"),
        ("edge", {"backend": "tflite"}, "build.backend: 'tflite' is not one of"),
        ("edge", {"max_batch_size": -1}, "build.max_batch_size: must be >= 0"),
        ("edge", {"latency_batch_sizes": [0]}, "build.latency_batch_sizes: give one or more"),
    ],
)
def test_bad_build_settings_are_refused_naming_the_field(tier, flags, message) -> None:
    with pytest.raises(ConfigError) as caught:
        choose_settings(load_profile(tier), flags)

    assert message in str(caught.value)


# -- metrics -----------------------------------------------------------------------------------

REFERENCE = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)
ONE_FLIPPED = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]], np.float32)
WITH_NAN = np.array([[np.nan, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)


@pytest.mark.parametrize(
    "candidate, labels, expected",
    [
        pytest.param(REFERENCE, None, dict(samples=4, top1_agreement=1.0, max_abs_error=0.0,
                                           mean_abs_error=0.0, nonfinite=0), id="identical"),
        pytest.param(ONE_FLIPPED, None, dict(top1_agreement=0.75, max_abs_error=0.2,
                                             mean_abs_error=0.05), id="one-sample-flipped"),
        pytest.param(ONE_FLIPPED, np.array([1, 0, 1, 1]),
                     dict(reference_accuracy=0.75, build_accuracy=1.0), id="labels"),
        pytest.param(WITH_NAN, None, dict(nonfinite=1, max_abs_error=0.0, top1_agreement=1.0),
                     id="nan-counted-not-averaged"),
        pytest.param(REFERENCE[:, :1] + 0.5, None,
                     dict(top1_agreement=None, max_abs_error=0.5), id="one-value-per-sample"),
    ],
)
def test_compare_outputs_measures_agreement_errors_and_accuracy(candidate, labels, expected):
    reference = REFERENCE[:, : candidate.shape[1]]
    result = compare_outputs("logits", reference, candidate, labels)

    actual = {key: getattr(result, key) for key in expected}
    assert actual == pytest.approx(expected, abs=1e-6)


def test_accuracy_drop_is_fp32_accuracy_minus_the_builds() -> None:
    result = compare_outputs("logits", REFERENCE, ONE_FLIPPED, np.array([1, 0, 1, 0]))

    assert (result.reference_accuracy, result.build_accuracy) == (1.0, 0.75)
    assert result.accuracy_drop == pytest.approx(0.25)
    assert compare_outputs("logits", REFERENCE, REFERENCE).accuracy_drop is None


def test_outputs_of_different_shapes_cannot_be_compared() -> None:
    with pytest.raises(EngineError, match=r"output 'logits': the build answers shape \[4, 1\]"):
        compare_outputs("logits", REFERENCE, REFERENCE[:, :1])
    with pytest.raises(ConfigError, match="labels: 3 labels for 4 eval samples"):
        compare_outputs("logits", REFERENCE, REFERENCE, np.array([0, 1, 1]))


# -- the gate ----------------------------------------------------------------------------------

GOOD = Agreement("logits", samples=500, top1_agreement=0.995, max_abs_error=0.5,
                 mean_abs_error=0.01, nonfinite=0)
LABELLED = replace(GOOD, reference_accuracy=0.98, build_accuracy=0.95)


@pytest.mark.parametrize(
    "agreement, options, verdict, accepted, phrase",
    [
        (GOOD, {}, "pass", True, "within the threshold"),
        (replace(GOOD, top1_agreement=0.99), {}, "pass", True, "agreement 0.9900"),
        (replace(GOOD, top1_agreement=0.98), {}, "fail", False,
         "top-1 agreement 0.9800 (threshold 0.9900) over 500 samples"),
        (replace(GOOD, top1_agreement=0.98), {"allow_accuracy_drop": True}, "fail", True,
         "accepted anyway (--allow-accuracy-drop)"),
        (replace(GOOD, samples=50), {}, "inconclusive", False,
         "only 50 samples (the gate needs 100)"),
        (replace(GOOD, samples=50), {"allow_accuracy_drop": True}, "inconclusive", True,
         "accepted anyway"),
        (replace(GOOD, top1_agreement=None), {}, "inconclusive", False, "no top-1 to compare"),
        (replace(GOOD, nonfinite=3), {}, "fail", False, "3 NaN/inf values"),
        (LABELLED, {"max_accuracy_drop": 0.01}, "fail", False,
         "accuracy FP32 0.9800, build 0.9500 (drop +0.0300)"),
        (LABELLED, {"max_accuracy_drop": 0.05}, "pass", True, "drop +0.0300"),
        (LABELLED, {}, "pass", True, "accuracy FP32 0.9800"),
    ],
)
def test_gate_decides_and_says_why_with_its_numbers(agreement, options, verdict, accepted,
                                                    phrase) -> None:
    decision = judge(agreement, min_agreement=0.99, min_samples=100, **options)

    assert (decision.verdict, decision.accepted) == (verdict, accepted)
    assert phrase in decision.reason
    assert decision.reason.startswith(verdict)
    assert "max abs error" in decision.reason


# -- digests, latency, facts -------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"ab", b"abcdefgh" * 5])
def test_sha256_of_a_file_read_in_chunks_equals_hashlib(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "blob"
    path.write_bytes(content)

    assert sha256_file(path, chunk_bytes=3) == hashlib.sha256(content).hexdigest()


@pytest.mark.parametrize(
    "batch, seconds, expected",
    [
        (1, [0.010], LatencySummary(1, 1, 10.0, 10.0, 10.0, 10.0, 10.0, 100.0)),
        (4, [0.004, 0.001, 0.003, 0.002], LatencySummary(4, 4, 2.5, 2.0, 4.0, 1.0, 4.0, 1600.0)),
        (32, [i / 1000 for i in range(10, 0, -1)],
         LatencySummary(32, 10, 5.5, 5.0, 9.0, 1.0, 10.0, 32 / 0.0055)),
    ],
)
def test_latency_summary_uses_nearest_rank_percentiles(batch, seconds, expected) -> None:
    summary = summarize_latency(batch, seconds)

    assert summary.batch_size == expected.batch_size and summary.runs == expected.runs
    for key in ("mean_ms", "p50_ms", "p90_ms", "min_ms", "max_ms", "items_per_s"):
        assert getattr(summary, key) == pytest.approx(getattr(expected, key)), key


def test_latency_summary_of_no_runs_is_an_error() -> None:
    with pytest.raises(ValueError, match="no timed runs"):
        summarize_latency(1, [])


class _Ticking:
    """An engine whose every run advances a shared fake clock by `run_s`."""

    def __init__(self, clock: list[float], run_s: float) -> None:
        self.clock, self.run_s = clock, run_s

    def run(self, feeds, outputs=None):
        self.clock[0] += self.run_s
        return {}


@pytest.mark.parametrize(
    "run_s, runs, budget_s, expected_runs",
    [
        (0.001, 20, 1.0, 20),  # a light model: every run, well within the budget
        (0.3, 20, 1.0, 5),  # a heavy one: stopped at the budget, at LATENCY_MIN_RUNS
        (0.04, 20, 1.0, 13),  # 13 pairs of 40 ms are the first past 1 s
        (0.3, 3, 1.0, 3),  # fewer runs asked than the minimum: those
    ],
)
def test_latency_timing_stops_at_its_budget_after_a_minimum_of_runs(
        run_s, runs, budget_s, expected_runs) -> None:
    from tiered.engines.build import pipeline, samples

    clock = [0.0]
    data = samples.Samples({"x": np.zeros((4, 2), np.float32)}, None, "random")
    measured = pipeline.measure_latency(_Ticking(clock, run_s), _Ticking(clock, run_s), data,
                                         [1, 32], runs, budget_s, lambda: clock[0])
    for name in ("build", "fp32_reference"):
        assert [s.runs for s in measured[name]] == [expected_runs, expected_runs]


@pytest.mark.parametrize(
    "report, expected",
    [
        ({}, {}),
        ({"tier": "edge", "precision": "int8", "created": "2026-01-02T03:04:05+00:00",
          "source": {"sha256": "ab12"}, "eval": {"data": "eval.npz"},
          "gate": {"verdict": "pass"},
          "accuracy": {"top1_agreement": 0.9933333, "max_abs_error": 3.15, "build_accuracy": None}},
         {"build_tier": "edge", "build_precision": "int8", "build_top1_agreement": "0.993333",
          "build_max_abs_error": "3.15", "build_eval_data": "eval.npz", "build_gate": "pass",
          "build_source_sha256": "ab12", "build_created": "2026-01-02T03:04:05+00:00"}),
        ({"precision": "fp16", "accuracy": {"top1_agreement": 1.0, "build_accuracy": 0.98}},
         {"build_precision": "fp16", "build_top1_agreement": "1", "build_accuracy": "0.98"}),
    ],
)
def test_version_facts_are_the_reports_key_figures_as_text(report, expected) -> None:
    assert version_facts(report) == expected


# -- data --------------------------------------------------------------------------------------

IMAGE = TensorSpec("input", np.dtype(np.float32), (-1, 1, 8, 8))
TWO_INPUTS = (TensorSpec("a", np.dtype(np.float32), (-1, 4)),
              TensorSpec("b", np.dtype(np.int64), (-1, 2)))


def npz(tmp_path: Path, **arrays) -> Path:
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return path


def test_samples_load_by_input_name_with_labels_and_a_limit(tmp_path: Path) -> None:
    images = np.ones((10, 1, 8, 8), np.float32)
    samples = load_samples(npz(tmp_path, input=images, label=np.arange(10)), [IMAGE], 6, "eval")

    assert samples.count == 6
    assert samples.labels.tolist() == list(range(6))
    assert [b["input"].shape[0] for b in samples.batches(4)] == [4, 2]


def test_a_single_input_model_takes_an_array_of_any_name(tmp_path: Path) -> None:
    samples = load_samples(npz(tmp_path, x=np.zeros((3, 1, 8, 8), np.float32)), [IMAGE], 99, "e")

    assert list(samples.feeds) == ["input"] and samples.labels is None


@pytest.mark.parametrize(
    "inputs, arrays, message",
    [
        (TWO_INPUTS, {"a": np.zeros((2, 4), np.float32)}, "has no array 'b' for model input 'b'"),
        ([IMAGE], {"input": np.zeros((2, 1, 8, 8), np.float64)},
         "eval.input: dtype float64, the model takes float32"),
        ([IMAGE], {"input": np.zeros((2, 8, 8), np.float32)},
         "eval.input: shape [2, 8, 8] does not fit the model's [-1, 1, 8, 8]"),
        (TWO_INPUTS, {"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 2), np.int64)},
         "different or zero sample counts: [2, 3]"),
        ([IMAGE], {"input": np.zeros((2, 1, 8, 8), np.float32), "label": np.zeros(2)},
         "eval.label: expected one integer class label per sample"),
        ([IMAGE], {"input": np.zeros((2, 1, 8, 8), np.float32), "label": np.zeros(2, int),
                   "labels": np.zeros(2, int)}, "has both label and labels"),
    ],
)
def test_data_that_does_not_fit_the_model_is_refused_naming_the_input(
    tmp_path: Path, inputs, arrays, message
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_samples(npz(tmp_path, **arrays), inputs, 100, "eval")

    assert message in str(caught.value)


def test_random_samples_follow_the_models_shapes_and_types() -> None:
    samples = random_samples(TWO_INPUTS, 5, np.random.default_rng(0))

    assert samples.origin == "random" and samples.labels is None
    assert samples.feeds["a"].shape == (5, 4) and samples.feeds["a"].dtype == np.float32
    assert samples.feeds["b"].shape == (5, 2) and samples.feeds["b"].dtype == np.int64


def test_random_samples_cannot_guess_variable_inner_dimensions() -> None:
    text = TensorSpec("tokens", np.dtype(np.int64), (-1, -1))

    with pytest.raises(ConfigError, match="input 'tokens'.*pass --eval and --calibration"):
        random_samples([text], 5, np.random.default_rng(0))


# -- placing a version into a repository -------------------------------------------------------


@pytest.fixture()
def finished(tmp_path: Path) -> Path:
    version = tmp_path / "work" / "version"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"new model")
    (version / "build.json").write_text("{}")
    return version


def test_installing_creates_the_version_and_a_config_when_absent(tmp_path, finished) -> None:
    repository = tmp_path / "repo"
    repository.mkdir()

    target = install_version(finished, repository, "m", 3, {"backend": "onnxruntime"}, force=False)

    assert target == repository / "m" / "3"
    assert (target / "model.onnx").read_bytes() == b"new model"
    assert yaml.safe_load((repository / "m" / "config.yaml").read_text()) == {
        "backend": "onnxruntime"}
    assert sorted(p.name for p in (repository / "m").iterdir()) == ["3", "config.yaml"]


def test_an_existing_version_is_replaced_only_with_force(tmp_path, finished) -> None:
    repository = tmp_path / "repo"
    (repository / "m" / "3").mkdir(parents=True)
    (repository / "m" / "3" / "model.onnx").write_bytes(b"old model")
    (repository / "m" / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 4\n")
    before = snapshot(repository)

    with pytest.raises(ConfigError, match="version: .* already exists; pass --force"):
        install_version(finished, repository, "m", 3, {"backend": "x"}, force=False)
    assert snapshot(repository) == before

    install_version(finished, repository, "m", 3, {"backend": "x"}, force=True)
    assert (repository / "m" / "3" / "model.onnx").read_bytes() == b"new model"
    assert "max_batch_size: 4" in (repository / "m" / "config.yaml").read_text()  # kept
    assert sorted(p.name for p in (repository / "m").iterdir()) == ["3", "config.yaml"]


@pytest.mark.parametrize("name, version", [("../m", 1), (".hidden", 1), ("a/b", 1), ("m", 0)])
def test_versions_go_only_into_plain_model_directories(tmp_path, finished, name, version):
    with pytest.raises(ConfigError):
        install_version(finished, tmp_path, name, version, {}, force=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


# -- real builds of the trained digits model ------------------------------------------------


@pytest.fixture(scope="module")
def digits(digits_models) -> tuple[Path, Path, Path]:
    return trained_digits(digits_models)


@pytest.fixture(scope="module")
def edge_repository(tmp_path_factory, digits):
    """An INT8 edge build of digits v1 as version 1, calibrated and scored on real data."""
    model, calibration, evaluation = digits
    repository = tmp_path_factory.mktemp("edge-repository")
    outcome = run_build(model, "edge", repository, 1, calibration=calibration,
                        evaluation=evaluation)
    return repository, outcome


def test_edge_int8_build_stays_within_one_accuracy_point_and_is_smaller(
    digits, edge_repository
) -> None:
    model, _, evaluation = digits
    repository, outcome = edge_repository
    report = outcome.report

    assert outcome.decision.verdict == "pass" and outcome.installed == repository / "digits" / "1"
    accuracy = report["accuracy"]
    assert accuracy["build_accuracy"] >= accuracy["reference_accuracy"] - 0.01
    assert accuracy["top1_agreement"] >= 0.99
    # Smaller on disk: INT8 weights are a quarter of FP32 (plus scales). On
    # this tiny network INT8 is not reliably faster on CPU, so size is what we assert.
    built = repository / "digits" / "1" / "model.onnx"
    assert built.stat().st_size < 0.5 * model.stat().st_size
    assert report["artifact"]["size_bytes"] == built.stat().st_size
    assert report["artifact"]["size_vs_source"] < 0.5
    # The report's accuracy is the file's: score the written model independently.
    data = np.load(evaluation)
    session = ort.InferenceSession(str(built), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": data["input"]})
    assert np.mean(logits.argmax(1) == data["label"]) == pytest.approx(accuracy["build_accuracy"])


def test_edge_build_is_static_int8_qdq_with_per_channel_weights(digits, edge_repository):
    _, calibration, _ = digits
    repository, outcome = edge_repository
    graph = onnx.load(repository / "digits" / "1" / "model.onnx").graph
    ops = {node.op_type for node in graph.node}
    int8_weights = [t for t in graph.initializer if t.data_type == TensorProto.INT8 and t.dims]
    per_channel_scales = [t for t in graph.initializer
                          if t.name.endswith("weight_scale") and t.dims and t.dims[0] > 1]

    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert int8_weights and per_channel_scales
    assert [i.type.tensor_type.elem_type for i in (*graph.input, *graph.output)] == [
        TensorProto.FLOAT, TensorProto.FLOAT]
    assert outcome.report["calibration"] == {
        "method": "minmax", "preprocessed": True, "samples": 256,
        "data": str(calibration), "per_channel": True, "format": "QDQ",
        "activations": "int8", "weights": "int8",
    }


def test_symbolic_shape_inference_runs_only_where_onnx_leaves_a_shape_unknown(
        digits, tmp_path) -> None:
    """The pre-processing's symbolic shape inference (seconds: its module
    imports torch) adds nothing to a CNN whose shapes ONNX infers, and runs
    for a graph ONNX cannot shape (an operator it does not know, a subgraph)."""
    from onnx import helper

    from tiered.engines.quantize import needs_symbolic_shapes

    model, _, _ = digits
    assert not needs_symbolic_shapes(model)

    def saved(node: onnx.NodeProto, name: str, domain: str | None = None) -> Path:
        graph = helper.make_graph(
            [node], name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=opsets), path)
        return path

    assert not needs_symbolic_shapes(saved(helper.make_node("Relu", ["x"], ["y"]), "relu"))
    assert needs_symbolic_shapes(saved(helper.make_node("Unknown", ["x"], ["y"], domain="custom"),
                                       "custom", "custom"))
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "branch", [],
                               [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    condition = helper.make_node("If", ["x"], ["y"], then_branch=branch, else_branch=branch)
    assert needs_symbolic_shapes(saved(condition, "if"))


def test_edge_build_report_records_where_what_and_when(digits, edge_repository) -> None:
    model, _, evaluation = digits
    repository, outcome = edge_repository
    report = outcome.report
    on_disk = json.loads((repository / "digits" / "1" / "build.json").read_text())

    assert on_disk == report
    assert (report["tier"], report["backend"], report["precision"]) == ("edge", "onnxruntime",
                                                                        "int8")
    assert report["source"]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert report["eval"] == {"data": str(evaluation), "samples": 450, "labels": True}
    assert report["created"] == "2026-01-02T03:04:05+00:00"
    assert report["versions"]["onnxruntime"] == ort.__version__
    assert [row["batch_size"] for row in report["latency"]["build"]] == [1, 32]
    assert [row["batch_size"] for row in report["latency"]["fp32_reference"]] == [1, 32]
    assert all(row["runs"] == FAST["latency_runs"] and row["p50_ms"] > 0
               for rows in report["latency"].values() for row in rows)
    assert report["engine"]["providers"] == "CPUExecutionProvider"
    assert yaml.safe_load((repository / "digits" / "config.yaml").read_text()) == {
        "backend": "onnxruntime", "max_batch_size": 32, "dynamic_batching": {}}


def test_regional_fp16_build_agrees_with_fp32_and_keeps_fp32_io(digits, tmp_path) -> None:
    model, _, evaluation = digits

    outcome = run_build(model, "regional", tmp_path, 1, evaluation=evaluation)

    accuracy = outcome.report["accuracy"]
    assert outcome.decision.verdict == "pass"
    assert accuracy["top1_agreement"] >= 0.99
    assert accuracy["max_abs_error"] < 0.05
    graph = onnx.load(tmp_path / "digits" / "1" / "model.onnx").graph
    assert any(t.data_type == TensorProto.FLOAT16 for t in graph.initializer)
    assert [i.type.tensor_type.elem_type for i in (*graph.input, *graph.output)] == [
        TensorProto.FLOAT, TensorProto.FLOAT]
    # No GPU here: the regional profile's CUDA provider falls back to the CPU,
    # which runs the FP16 graph (through casts) and says so in the report.
    assert outcome.report["engine"]["device"] == "cpu"
    assert any("FP16 measured on CPU" in note for note in outcome.report["notes"])
    assert outcome.report["calibration"] is None


def test_gate_rejects_a_badly_calibrated_int8_build_and_writes_nothing(
    digits, edge_repository, tmp_path, capsys
) -> None:
    model, _, evaluation = digits
    repository, _ = edge_repository
    # Calibrated on blank images, the activation ranges are far too narrow
    # and real digits saturate them.
    blank = npz(tmp_path, input=np.zeros((64, 1, 8, 8), np.float32))
    before = snapshot(repository)

    code = cli.main([
        "build", str(model), "--tier", "edge", "--repository", str(repository),
        "--model", "digits", "--version", "2", "--calibration", str(blank),
        "--eval", str(evaluation),
    ])

    out, err = capsys.readouterr()
    report = json.loads(out)
    assert code == 1
    assert snapshot(repository) == before
    assert report["gate"]["verdict"] == "fail" and not report["gate"]["accepted"]
    assert report["accuracy"]["top1_agreement"] < 0.99
    assert "rejected, nothing written" in err
    assert f"top-1 agreement {report['accuracy']['top1_agreement']:.4f} (threshold 0.9900) " \
           "over 450 samples" in err


def test_allow_accuracy_drop_writes_the_rejected_build_and_records_the_drop(
    digits, tmp_path
) -> None:
    model, _, evaluation = digits
    blank = npz(tmp_path, input=np.zeros((64, 1, 8, 8), np.float32))
    repository = tmp_path / "repo"
    repository.mkdir()

    outcome = run_build(model, "edge", repository, 1, calibration=blank, evaluation=evaluation,
                        allow_accuracy_drop=True)

    gate = json.loads((repository / "digits" / "1" / "build.json").read_text())["gate"]
    assert (gate["verdict"], gate["accepted"], gate["allow_accuracy_drop"]) == ("fail", True, True)
    assert "accepted anyway" in gate["reason"]
    assert outcome.report["accuracy"]["accuracy_drop"] > 0.01


def test_a_version_that_exists_is_refused_before_any_work_unless_forced(
    digits, edge_repository
) -> None:
    model, _, _ = digits
    repository, _ = edge_repository

    with pytest.raises(ConfigError, match=r"version: .*digits/1 already exists; pass --force"):
        run_build(model, "edge", repository, 1)


def test_a_build_for_another_backend_than_the_models_config_is_refused(
    digits, edge_repository
) -> None:
    model, _, _ = digits
    repository, _ = edge_repository  # digits/config.yaml says onnxruntime
    before = snapshot(repository)

    with pytest.raises(ConfigError) as caught:
        run_build(model, "datacenter", repository, 5)

    assert "serves this model on 'onnxruntime', the build makes a 'torch' version" in str(
        caught.value)
    assert snapshot(repository) == before


def test_datacenter_build_keeps_fp32_onnx_and_measures_the_torch_engine(digits, tmp_path):
    pytest.importorskip("torch", reason="the datacenter build runs the torch engine")
    model, _, evaluation = digits

    # The tier's default is fp16 on a GPU; on this CPU the torch engine runs fp32 or bf16.
    outcome = run_build(model, "datacenter", tmp_path, 1, evaluation=evaluation,
                        precision="fp32")

    assert outcome.decision.verdict == "pass"
    assert outcome.report["accuracy"]["top1_agreement"] >= 0.99
    assert outcome.report["engine"]["engine"] == "torch"
    assert (tmp_path / "digits" / "1" / "model.onnx").read_bytes() == model.read_bytes()
    config = yaml.safe_load((tmp_path / "digits" / "config.yaml").read_text())
    assert config["backend"] == "torch" and config["engine"]["precision"] == "fp32"


def test_without_data_the_build_uses_random_inputs_and_says_so(tmp_path) -> None:
    source = zoo.mlp(tmp_path / "mlp.onnx", in_features=16, out_features=4)

    outcome = run_build(source, "regional", tmp_path, 1, model="mlp")

    report = outcome.report
    assert report["eval"] == {"data": "random", "samples": 256, "labels": False}
    assert report["accuracy"]["reference_accuracy"] is None
    assert any(note.startswith("eval on random inputs") for note in report["notes"])
