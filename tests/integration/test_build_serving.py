"""A tier build served by a real agent: `tiered build` writes an edge INT8
version of the trained digits model, an agent process serves it, tritonclient's
answers equal ONNX Runtime's on the built file, and ModelConfig carries the
build's figures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from tests.unit.test_build import trained_digits
from tiered import cli
from tiered.agent.repository import ModelRepository, model_file, write_config
from tiered.local.processes import AgentProcess
from tiered.models import zoo
from tiered.profiles import load_profile


@pytest.fixture(scope="module")
def built(tmp_path_factory, digits_models) -> tuple[Path, Path]:
    model, calibration, evaluation = trained_digits(digits_models)
    repository = tmp_path_factory.mktemp("built-repository")
    code = cli.main([
        "build", str(model), "--tier", "edge", "--repository", str(repository),
        "--model", "digits", "--version", "1", "--calibration", str(calibration),
        "--eval", str(evaluation),
    ])
    assert code == 0
    return repository, evaluation


@pytest.fixture(scope="module")
def client(built):
    repository, _ = built
    with AgentProcess("edge", repository) as agent:
        with grpcclient.InferenceServerClient(agent.address) as c:
            yield c
        assert agent.alive(), f"the agent died:\n{agent.log_tail()}"


def test_the_agent_answers_the_int8_build_as_onnxruntime_does(client, built) -> None:
    repository, evaluation = built
    images = np.load(evaluation)["input"][:16]
    session = ort.InferenceSession(str(repository / "digits" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    (expected,) = session.run(["logits"], {"input": images})
    tensor = grpcclient.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)

    result = client.infer("digits", [tensor], model_version="1")

    np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-5, atol=1e-5)


def test_model_config_shows_the_builds_precision_agreement_and_source(client, built) -> None:
    repository, _ = built
    report = json.loads((repository / "digits" / "1" / "build.json").read_text())

    config = client.get_model_config("digits", as_json=True)["config"]

    parameters = {key: value["string_value"] for key, value in config["parameters"].items()}
    assert parameters["build_precision"] == "int8"
    assert parameters["build_tier"] == "edge"
    assert float(parameters["build_top1_agreement"]) == pytest.approx(
        report["accuracy"]["top1_agreement"], abs=1e-6)
    assert float(parameters["build_top1_agreement"]) >= 0.99
    assert parameters["build_source_sha256"] == report["source"]["sha256"]
    assert parameters["build_gate"] == "pass"
    assert parameters["engine"] == "onnxruntime"  # the engine's own facts stay beside them


def test_an_unreadable_build_report_costs_its_facts_not_the_version(tmp_path: Path) -> None:
    zoo.mlp(model_file(tmp_path, "mlp", 1))
    write_config(tmp_path, "mlp", {"max_batch_size": 4})
    (tmp_path / "mlp" / "1" / "build.json").write_text("{not json")

    async def load() -> dict:
        repository = ModelRepository(tmp_path, load_profile("edge"))
        await repository.load("mlp")
        try:
            return dict(repository.get("mlp").build)
        finally:
            await repository.close()

    assert asyncio.run(load()) == {}
