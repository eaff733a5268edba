"""`tiered build` of an ensemble, served: the three-step classifier of
test_ensembles (uint8 pre-processing, a small classifier, softmax/argmax
post-processing) built for the edge tier (INT8) and the regional tier (FP16,
on CPU here), judged as one model in build.json, then served by a real agent
whose tritonclient answers match the FP32 chain within the gate's figures;
and a build the gate refuses, which installs nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from tests.integration.test_ensembles import CLASSES, call, images, write_models
from tiered import cli
from tiered.files import sha256_tree
from tiered.local.processes import AgentProcess

STEPS = ("preprocess", "classifier", "postprocess")
# The small classifier's random weights leave many near-ties, which INT8 flips
# on about 4% of random images (the same with any calibration method), so
# the edge build asks for less than the profile's 0.99; FP16 meets it.
MIN_AGREEMENT = {"edge": ["--min-agreement", "0.95"], "regional": []}


def fp32_chain(source: Path, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PROBS and LABEL of the FP32 step models run one after another."""
    def session(model: str) -> ort.InferenceSession:
        return ort.InferenceSession(str(source / model / "1" / "model.onnx"),
                                    providers=["CPUExecutionProvider"])

    (pixels,) = session("preprocess").run(None, {"RAW": batch})
    (logits,) = session("classifier").run(None, {"x": pixels})
    probs, label = session("postprocess").run(None, {"LOGITS": logits})
    return probs, label


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The FP32 repository, as Triton would serve it; its nested ensemble is no step here."""
    root = write_models(tmp_path_factory.mktemp("fp32-source"))
    shutil.rmtree(root / "all_in_one")
    return root


@pytest.fixture(scope="module")
def data(source, tmp_path_factory) -> tuple[Path, Path]:
    """Calibration images, and eval images labelled with the FP32 chain's classes."""
    folder = tmp_path_factory.mktemp("ensemble-data")
    calibration, evaluation = folder / "calibration.npz", folder / "eval.npz"
    np.savez(calibration, IMAGE=images(64, seed=11))
    shown = images(200, seed=12)
    np.savez(evaluation, IMAGE=shown, labels=fp32_chain(source, shown)[1].reshape(-1))
    return calibration, evaluation


def tiered_build(source: Path, repository: Path, tier: str, data: tuple[Path, Path],
                 *flags: str) -> int:
    calibration, evaluation = data
    return cli.main(["build", str(source), "--tier", tier, "--repository", str(repository),
                     "--model", "classify", "--version", "1", "--calibration", str(calibration),
                     "--eval", str(evaluation), *flags])


@pytest.fixture(scope="module", params=["edge", "regional"])
def built(request, source, data, tmp_path_factory) -> tuple[str, Path, dict]:
    tier = request.param
    repository = tmp_path_factory.mktemp(f"{tier}-repository")
    assert tiered_build(source, repository, tier, data, *MIN_AGREEMENT[tier]) == 0
    return tier, repository, json.loads((repository / "classify" / "1" / "build.json")
                                        .read_text())


def test_the_ensemble_is_judged_as_one_model_and_says_how_each_step_was_built(built) -> None:
    tier, repository, report = built
    lowered = {"edge": "int8", "regional": "fp16"}[tier]

    assert report["kind"] == "ensemble" and report["precision"] == lowered
    assert report["gate"]["verdict"] == "pass" and report["verdict"]["built"] is True
    assert report["verdict"]["installed"] == str(repository / "classify" / "1")
    steps = report["steps"]
    assert steps["classifier"]["precision"] == lowered and not steps["classifier"]["kept_fp32"]
    assert "RAW (uint8)" in steps["preprocess"]["kept_fp32"]
    assert "LABEL (int64)" in steps["postprocess"]["kept_fp32"]
    assert (steps["classifier"]["calibration"] is not None) == (tier == "edge")
    outputs = {o["output"]: o for o in report["accuracy"]["outputs"]}
    assert outputs["LABEL"]["method"] == "exact" and outputs["PROBS"]["method"] == "top1"
    threshold = report["gate"]["min_agreement"]
    assert threshold == {"edge": 0.95, "regional": 0.99}[tier]
    assert outputs["LABEL"]["samples"] == 200 and outputs["LABEL"]["top1_agreement"] >= threshold
    assert outputs["LABEL"]["reference_accuracy"] == 1.0  # labelled with FP32's classes
    assert outputs["LABEL"]["build_accuracy"] == outputs["LABEL"]["top1_agreement"]
    assert 0 < outputs["PROBS"]["max_abs_error"] <= 1 and outputs["PROBS"]["mean_abs_error"] < 0.05
    assert "exact agreement" in report["gate"]["reason"]
    for step in STEPS:
        step_report = json.loads((repository / step / "1" / "build.json").read_text())
        assert step_report["ensemble"] == {"model": "classify", "version": 1,
                                           "report": "../../classify/1/build.json",
                                           "gate": "pass"}
        assert (repository / step / "config.yaml").is_file()
    assert sorted(p.name for p in (repository / "classify").iterdir()) == ["1", "config.pbtxt"]


def test_the_served_ensemble_answers_as_the_fp32_chain_within_the_gates_figures(
        built, source) -> None:
    tier, repository, report = built
    outputs = {o["output"]: o for o in report["accuracy"]["outputs"]}
    batch = images(4, seed=12)  # the first eval images: the gate saw these
    expected_probs, expected_labels = fp32_chain(source, batch)

    with AgentProcess(tier, repository) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        answer = call(client, "classify", "IMAGE", batch)
        parameters = client.get_model_config("classify").config.parameters
        assert agent.alive(), agent.log_tail()

    probs, labels = answer.as_numpy("PROBS"), answer.as_numpy("LABEL")
    assert probs.shape == (4, CLASSES) and labels.shape == (4, 1)
    np.testing.assert_allclose(probs, expected_probs, rtol=0,
                               atol=outputs["PROBS"]["max_abs_error"] + 1e-6)
    if outputs["LABEL"]["top1_agreement"] == 1.0:
        np.testing.assert_array_equal(labels, expected_labels)
    np.testing.assert_array_equal(labels[:, 0], probs.argmax(axis=1))
    shown = {key: parameters[key].string_value for key in parameters}
    assert shown["build_gate"] == "pass" and shown["build_precision"] == report["precision"]
    assert float(shown["build_top1_agreement"]) == pytest.approx(
        report["accuracy"]["top1_agreement"], abs=1e-5)


def test_a_build_the_gate_refuses_installs_nothing(source, data, tmp_path, capsys) -> None:
    repository = tmp_path / "repository"

    code = tiered_build(source, repository, "edge", data, "--min-agreement", "1.0")

    assert code == 1
    assert not repository.exists() or not any(repository.iterdir())
    printed = json.loads(capsys.readouterr().out)
    assert printed["gate"]["verdict"] == "fail" and printed["verdict"]["built"] is False
    assert printed["accuracy"]["outputs"][1]["output"] == "LABEL"


def test_a_model_of_the_source_that_is_no_ensemble_is_refused_naming_it(
        source, data, tmp_path, capsys) -> None:
    code = cli.main(["build", str(source), "--tier", "edge", "--repository",
                     str(tmp_path / "r"), "--model", "classifier", "--version", "1"])

    assert code == 2
    assert "model 'classifier' of backend 'onnxruntime', not an ensemble" in \
        capsys.readouterr().err
    assert not (tmp_path / "r").exists()



def test_a_source_repository_of_another_digest_is_refused_before_building(
        source, data, tmp_path, capsys) -> None:
    pinned = sha256_tree(source)
    repository = tmp_path / "repository"

    code = tiered_build(source, repository, "regional", data, "--sha256", "0" * 64)

    assert code == 2 and not repository.exists()
    assert f"has sha256 {pinned}, not the expected" in capsys.readouterr().err
