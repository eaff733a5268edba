"""Tier builds of a checkpoint artifact, for real: onnxruntime-genai's builder
(edge INT4, regional on the CPU), the torch engine (datacenter), the
greedy-generation gate against FP32, installation, and the engines opened
from the repository the way the agent opens them."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

import torch  # noqa: E402

from tiered.engines import build  # noqa: E402
from tiered.engines.build import generative  # noqa: E402
from tiered.engines.generative import open_generative  # noqa: E402
from tiered.engines.generative.base import Sampling  # noqa: E402
from tiered.files import sha256_tree  # noqa: E402
from tiered.models import tinyllama  # noqa: E402
from tiered.profiles import load_profile  # noqa: E402
from tiered.settings import read_yaml  # noqa: E402

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matrices on a shared 2-core machine: one thread is many times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(source: Path, tier: str, repository: Path, model: str, **request):
    profile = load_profile(tier)
    return build.build(
        build.BuildRequest(source=source, repository=repository, model=model, version=1,
                           evaluation=source.parent / tinyllama.EVAL_FILE, **request),
        profile, build.choose_settings(profile, {}), now=NOW)


def _generate(engine, text: str) -> str:
    engine.start(engine.encode(text), Sampling(max_tokens=16))
    ids = []
    while engine.running:
        ids += [token.id for token in engine.step()]
    return engine.decode(ids)


@pytest.fixture(scope="module")
def built(tinyllama_models, tmp_path_factory):
    """v1 built for every tier into one repository, once."""
    repository = tmp_path_factory.mktemp("repository")
    source = tinyllama_models / "tinyllama-v1"
    return repository, {tier: _build(source, tier, repository, f"tiny-{tier}")
                        for tier in ("edge", "regional", "datacenter")}


@pytest.mark.parametrize(("tier", "backend", "precision"), [
    ("edge", "onnxruntime-genai", "int4"),
    ("regional", "onnxruntime-genai", "fp32"),  # no CUDA here: the report says so
    ("datacenter", "torch-generative", "fp32"),
])
def test_each_tier_builds_an_engine_that_generates(built, tinyllama_models, tier, backend,
                                                   precision):
    repository, outcomes = built
    outcome = outcomes[tier]
    report = outcome.report
    assert outcome.decision.verdict == "pass", outcome.decision.reason
    assert (report["backend"], report["precision"]) == (backend, precision)
    assert report["source"]["sha256"] == sha256_tree(tinyllama_models / "tinyllama-v1")
    assert report["accuracy"]["first_tokens_match"] >= 0.9
    assert report["accuracy"]["token_agreement"] >= 0.98
    assert report["eval"]["prompts"] == len(tinyllama.eval_prompts())
    assert report["latency"]["build"]["tokens_per_s"] > 0
    if tier != "edge":
        assert any("built fp32 for the CPU instead" in note for note in report["notes"])
    version = repository / f"tiny-{tier}" / "1"
    assert outcome.installed == version
    assert json.loads((version / "build.json").read_text())["gate"]["verdict"] == "pass"
    config = read_yaml(repository / f"tiny-{tier}" / "config.yaml")
    assert config["backend"] == backend
    engine = open_generative(config["backend"], version, config.get("engine", {}))
    try:
        assert _generate(engine, "the quick brown") == " fox jumps over the lazy dog"
        assert engine.describe()["device"] == "cpu"
    finally:
        engine.close()
    if tier == "edge":  # INT4 weights: a third of the FP32 checkpoint or less
        assert report["artifact"]["size_vs_source"] < 0.4
    if tier == "datacenter":
        assert config["engine"] == {"precision": "fp32", "device": "cpu"}


def test_int4_build_of_an_untrained_model_is_refused(tinyllama_models, tmp_path):
    """Random weights: near-tied logits that INT4 weights reorder; the gate
    sees it and nothing is written."""
    source = tmp_path / "untrained"
    tinyllama.write_checkpoint(source, tinyllama.TinyLlama(train_steps=0))
    shutil.copy(tinyllama_models / tinyllama.EVAL_FILE, tmp_path)
    outcome = _build(source, "edge", tmp_path / "repository", "untrained")
    assert outcome.decision.verdict == "fail"
    assert not outcome.decision.accepted and outcome.installed is None
    assert not (tmp_path / "repository" / "untrained").exists()
    assert outcome.report["accuracy"]["token_agreement"] < 0.98
    assert "below the threshold" in outcome.decision.reason


def test_a_build_that_damages_the_weights_is_refused(tinyllama_models, tmp_path,
                                                     monkeypatch):
    """The lowering step breaks the model after the reference has been read
    from the intact checkpoint: the build's rows of lm_head are shuffled."""
    from safetensors.torch import load_file, save_file

    lower = generative.lower

    def damaging(source, target, out, work):
        lower(source, target, out, work)
        tensors = load_file(str(out / "model.safetensors"))
        generator = torch.Generator().manual_seed(0)
        head = tensors["lm_head.weight"]
        tensors["lm_head.weight"] = head[torch.randperm(head.shape[0], generator=generator)]
        save_file(tensors, str(out / "model.safetensors"))

    monkeypatch.setattr(generative, "lower", damaging)
    source = tinyllama_models / "tinyllama-v1"
    outcome = _build(source, "datacenter", tmp_path / "repository", "damaged")
    assert outcome.decision.verdict == "fail" and outcome.installed is None
    assert outcome.report["accuracy"]["first_tokens_match"] < 0.5
    assert outcome.report["source"]["sha256"] == sha256_tree(source)  # the intact one
    allowed = _build(source, "datacenter", tmp_path / "repository", "damaged",
                     allow_accuracy_drop=True)
    assert allowed.installed is not None
    assert allowed.report["gate"] | {"verdict": "fail", "accepted": True} == allowed.report["gate"]


def test_fp8_ships_only_when_the_gate_passes_it(tinyllama_models, tmp_path, monkeypatch):
    """An FP8 build that passes is FP8; one whose FP8 weights the gate
    rejects (damaged here after lowering) is built again wider, and its
    report says why. FP8 on the CPU widens its weights: the numerics are
    real, the speed is not."""
    from safetensors.torch import load_file, save_file

    lower = generative.lower

    def damaging_fp8(source, target, out, work):
        lower(source, target, out, work)
        if target.precision == "fp8":
            tensors = load_file(str(out / "model.safetensors"))
            head = tensors["lm_head.weight"]
            tensors["lm_head.weight"] = head.flip(0)
            save_file(tensors, str(out / "model.safetensors"))

    monkeypatch.setattr(generative, "choose_target",
                        lambda settings: generative.Target(settings.backend, "fp8", "cpu"))
    source = tinyllama_models / "tinyllama-v1"
    passed = _build(source, "datacenter", tmp_path / "repository", "fp8")
    assert passed.decision.verdict == "pass"
    assert passed.report["engine"]["precision"] == "fp8"
    assert read_yaml(passed.installed.parent / "config.yaml")["engine"]["precision"] == "fp8"
    monkeypatch.setattr(generative, "lower", damaging_fp8)
    refused = _build(source, "datacenter", tmp_path / "repository", "fp8-refused")
    assert refused.decision.verdict == "pass"
    assert refused.report["engine"]["precision"] == "fp32"
    assert any("fp8 was built and rejected by the gate" in note
               for note in refused.report["notes"])


def test_cli_builds_a_checkpoint_pinned_by_its_sha256(tinyllama_models, tmp_path, capsys):
    from tiered.cli import main

    source = tinyllama_models / "tinyllama-v2"
    common = [str(source), "--tier", "datacenter", "--repository", str(tmp_path / "repo"),
              "--model", "tiny", "--version", "2", "--eval",
              str(tinyllama_models / tinyllama.EVAL_FILE)]
    assert main(["build", *common, "--sha256", "0" * 64]) == 2
    assert "refusing to build it" in capsys.readouterr().err
    assert main(["build", *common, "--sha256", sha256_tree(source),
                 "--precision", "bf16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["backend"], report["precision"]) == ("torch-generative", "bf16")
    assert report["verdict"]["built"] is True
    assert (tmp_path / "repo" / "tiny" / "2" / "model.safetensors").is_file()


def test_an_agent_serves_every_tier_build_over_grpc(built):
    """The repository the builds installed, served by a real agent: the torch
    checkpoint (datacenter) and the onnxruntime-genai builds (edge, regional)
    answer the same greedy continuation over ModelInfer."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from tiered.local.processes import AgentProcess

    repository, _ = built
    with AgentProcess("datacenter", repository) as agent, \
            grpcclient.InferenceServerClient(agent.address) as client:
        for tier in ("edge", "regional", "datacenter"):
            prompt = grpcclient.InferInput("text_input", [1], "BYTES")
            prompt.set_data_from_numpy(np.array([b"the quick brown"], dtype=object))
            result = client.infer(f"tiny-{tier}", [prompt], parameters={"max_tokens": 16})
            assert result.as_numpy("text_output")[0].decode() == \
                " fox jumps over the lazy dog", tier
            assert client.get_model_config(f"tiny-{tier}").config.model_transaction_policy \
                .decoupled
