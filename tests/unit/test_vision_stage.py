"""The vision stage of a vision-language checkpoint: its export against
transformers, its edge INT8 and regional FP16 builds through `tiered build`'s
pipeline and their gate, and the built stage served by `open_engine`.

One random-weight LLaVA checkpoint (tests/vlm_fixtures.py) serves the module;
a second differs only by noise in its projector, the stage a build must
reject."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tests.vlm_fixtures import eval_images, n_visual, write_eval_npz, write_tiny_llava  # noqa: E402
from tiered import names  # noqa: E402
from tiered.engines import open_engine  # noqa: E402
from tiered.engines.build import gate, pipeline, spec, vision_language  # noqa: E402
from tiered.engines.build.report import version_facts  # noqa: E402
from tiered.engines.images import Preprocessor, pixel_values  # noqa: E402
from tiered.errors import ConfigError, EngineError  # noqa: E402
from tiered.profiles import load_profile  # noqa: E402

NOW = datetime.datetime(2026, 12, 5, tzinfo=datetime.timezone.utc)
HIDDEN = 128  # the fixture's text hidden size
QUICK = {"latency_batch_sizes": (1, 4), "latency_runs": 5, "latency_budget_s": 0.05}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {"checkpoint": write_tiny_llava(root / "llava"),
            "noisy": write_tiny_llava(root / "llava-noisy", projector_noise=1.0),
            "eval": write_eval_npz(root / "eval.npz", 16),
            "root": root}


@pytest.fixture(scope="module")
def checkpoint(made) -> vision_language.Checkpoint:
    return vision_language.Checkpoint(made["checkpoint"])


def build(made, tmp_path, tier: str, model: str, vision: dict | None = None,
          source: Path | None = None, **overrides) -> object:
    profile = load_profile(tier, None)
    settings = spec.choose_vision_settings(profile, {**QUICK, **overrides,
                                                     "vision": vision or {}})
    request = spec.BuildRequest(source=source or made["checkpoint"],
                                repository=tmp_path / "repo", model=model, version=1,
                                evaluation=made["eval"], stage="vision")
    return pipeline.build(request, profile, settings, now=NOW)


def test_a_llava_checkpoint_is_told_from_other_sources(made, tmp_path):
    assert vision_language.is_vision_language(made["checkpoint"])
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not vision_language.is_vision_language(llama)
    assert not vision_language.is_vision_language(made["eval"])
    shape = vision_language.read_shape(made["checkpoint"])
    assert (shape.pixel_shape, shape.n_visual, shape.text_hidden) == ((3, 8, 8), n_visual(),
                                                                      HIDDEN)
    assert shape.vision_feature_layer == -2 and shape.strategy == "default"


@pytest.mark.parametrize(("change", "field"), [
    ({"image_token_index": None}, "image_token_index"),
    ({"vision_feature_select_strategy": "pooled"}, "vision_feature_select_strategy"),
    ({"vision_feature_layer": "last"}, "vision_feature_layer"),
    ({"text_config": {"hidden_size": 0}}, "text_config.hidden_size"),
    ({"vision_config": {"image_size": 9, "patch_size": 2}}, "vision_config.image_size"),
])
def test_a_bad_checkpoint_config_names_the_field(made, tmp_path, change, field):
    config = json.loads((made["checkpoint"] / "config.json").read_text())
    config.pop("image_token_id", None)
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"{field}:"):
        vision_language.read_shape(tmp_path)


def test_the_export_gives_transformers_visual_tokens(made, checkpoint, tmp_path):
    exported = vision_language.export_vision_stage(made["checkpoint"], tmp_path / "model.onnx")
    pixels = pixel_values(eval_images(5), vision_language.read_preprocessor(made["checkpoint"]))
    engine = open_engine(names.Backend.ONNXRUNTIME, exported, {}, "test")
    try:
        assert [s.name for s in engine.inputs] == ["pixel_values"]
        assert list(engine.inputs[0].shape) == [-1, 3, 8, 8]
        got = engine.run({"pixel_values": pixels})["visual_tokens"]
    finally:
        engine.close()
    want = checkpoint.image_features(pixels)
    assert got.shape == (5, n_visual(), HIDDEN)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # The tokens are what the checkpoint's own image path puts in the prompt:
    # generating from pixels and from the exported tokens gives one answer.
    import torch

    ids = torch.tensor([checkpoint.prompt_ids("what is in the picture ?")])
    with torch.no_grad():
        from_pixels = checkpoint.model.generate(
            input_ids=ids, pixel_values=torch.from_numpy(pixels[:1]),
            attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    answer = checkpoint.answers(got[:1], ["what is in the picture ?"], 6)[0]
    assert from_pixels[0, ids.shape[1]:].tolist()[:len(answer)] == answer
    # Teacher-forced on its own greedy answers, the decoder's top-1 is each answer.
    questions = ["what is in the picture ?", "is it a cat ?", "what colour is it ?", "no"] * 2
    answers = checkpoint.answers(got[:4].repeat(2, axis=0), questions, 6)
    assert checkpoint.forced_top1(got[:4].repeat(2, axis=0), questions, answers) == answers
    config = (tmp_path / "config.yaml").read_text()
    assert "visual_tokens" in config and f"- {n_visual()}" in config


def test_the_stage_config_is_served_by_the_agent_as_written(made, tmp_path):
    from tiered.agent.repository import read_model_config

    model_dir = tmp_path / "repo" / "vision"
    vision_language.export_vision_stage(made["checkpoint"], model_dir / "1" / "model.onnx")
    shutil.move(model_dir / "1" / "config.yaml", model_dir / "config.yaml")
    config = read_model_config(tmp_path / "repo", "vision", load_profile("edge", None))
    assert config.max_batch_size == 32
    assert [(t.name, t.datatype, tuple(t.dims)) for t in (*config.inputs, *config.outputs)] == [
        ("pixel_values", "FP32", (3, 8, 8)), ("visual_tokens", "FP32", (n_visual(), HIDDEN))]


def test_regional_fp16_build_passes_and_is_served_by_open_engine(made, tmp_path):
    outcome = build(made, tmp_path, "regional", "vision-fp16")
    assert outcome.decision.verdict == "pass", outcome.decision.reason
    accuracy = outcome.report["accuracy"]
    assert accuracy["cosine_mean"] > 0.9999 and accuracy["relative_l2"] < 0.01
    assert accuracy["answer_match"] == 1.0 and accuracy["answers"]["questions"] == 16
    assert accuracy["answers"]["token_agreement"] == 1.0
    assert outcome.report["stage"]["export"]["max_error_vs_transformers"] < 1e-5
    assert outcome.installed == tmp_path / "repo" / "vision-fp16" / "1"
    written = json.loads((outcome.installed / "build.json").read_text())
    assert written["gate"]["verdict"] == "pass" and written["precision"] == "fp16"
    from tiered.agent.repository import read_model_config

    served = read_model_config(tmp_path / "repo", "vision-fp16", load_profile("regional", None))
    assert served.max_batch_size == 64 and served.backend == "onnxruntime"
    assert tuple(served.outputs[0].dims) == (n_visual(), HIDDEN)
    facts = version_facts(written)
    assert float(facts["build_visual_cosine_mean"]) > 0.9999
    assert float(facts["build_answer_match"]) == 1.0
    preprocessor = Preprocessor.from_json(made["checkpoint"] / "preprocessor_config.json")
    engine = open_engine(names.Backend.ONNXRUNTIME, outcome.installed / "model.onnx", {}, "test")
    try:
        batch = pixel_values(eval_images(6, seed=9), preprocessor)
        tokens = engine.run({"pixel_values": batch})["visual_tokens"]
    finally:
        engine.close()
    assert tokens.shape == (6, n_visual(), HIDDEN) and np.isfinite(tokens).all()


def test_edge_int8_build_keeps_tokens_close_and_the_answer_match_decides(made, tmp_path):
    """INT8 keeps the tokens within the thresholds, but the random decoder's
    greedy answers have small margins: some flip, and at the default 0.9 the
    build is rejected on answer match alone, nothing written. A looser answer
    threshold lets the same build in."""
    strict = build(made, tmp_path, "edge", "vision-int8")
    accuracy = strict.report["accuracy"]
    assert strict.report["calibration"]["format"] == "QDQ"
    assert accuracy["cosine_mean"] >= 0.99 and accuracy["cosine_p1"] >= 0.95
    assert accuracy["relative_l2"] <= 0.15
    assert 0.5 <= accuracy["answer_match"] < 0.9
    assert strict.decision.verdict == "fail" and "answer match below" in strict.decision.reason
    assert strict.installed is None and not (tmp_path / "repo" / "vision-int8").exists()
    loose = build(made, tmp_path, "edge", "vision-int8", {"min_answer_match": 0.5})
    assert loose.decision.verdict == "pass", loose.decision.reason
    config = (tmp_path / "repo" / "vision-int8" / "config.yaml").read_text()
    assert "backend: onnxruntime" in config and "pixel_values" in config
    engine = open_engine(names.Backend.ONNXRUNTIME, loose.installed / "model.onnx", {}, "test")
    try:
        assert engine.run({"pixel_values": np.zeros((3, 3, 8, 8), np.float32)}
                          )["visual_tokens"].shape == (3, n_visual(), HIDDEN)
    finally:
        engine.close()


def test_a_noisy_projector_fails_the_gate(made, checkpoint, tmp_path):
    """The stage of a checkpoint whose projector differs by noise, judged as a
    build of the original: its tokens and its answers are off."""
    pixels = pixel_values(eval_images(16), vision_language.read_preprocessor(made["checkpoint"]))
    tokens = {}
    for name in ("checkpoint", "noisy"):
        exported = vision_language.export_vision_stage(made[name], tmp_path / name / "m.onnx")
        engine = open_engine(names.Backend.ONNXRUNTIME, exported, {}, "test")
        try:
            tokens[name] = engine.run({"pixel_values": pixels})["visual_tokens"]
        finally:
            engine.close()
    agreement = gate.compare_visual_tokens(tokens["checkpoint"], tokens["noisy"])
    questions = ["what is in the picture ?"] * 16
    answers = vision_language.answer_match(checkpoint, tokens["checkpoint"], tokens["noisy"],
                                           questions, 8)
    defaults = spec.VisionBuildSettings()
    decision = gate.judge_visual(
        agreement, answers, min_cosine_mean=defaults.min_cosine_mean,
        min_cosine_p1=defaults.min_cosine_p1, max_relative_l2=defaults.max_relative_l2,
        min_answer_match=defaults.min_answer_match, min_images=defaults.min_eval_images)
    assert decision.verdict == "fail" and not decision.accepted
    assert agreement.cosine_mean < 0.99 and agreement.relative_l2 > 0.15
    assert answers.match is not None and answers.match < 0.9
    assert answers.token_agreement is not None and answers.token_agreement < 0.9
    assert answers.positions >= 16
    # Judged on answers alone, it fails too.
    lenient = gate.judge_visual(agreement, answers, min_cosine_mean=0.0, min_cosine_p1=0.0,
                                max_relative_l2=10.0, min_answer_match=0.9, min_images=8)
    assert lenient.verdict == "fail" and "answer match" in lenient.reason


def test_the_pipeline_refuses_what_it_cannot_build_of_a_llava_checkpoint(made, tmp_path):
    profile = load_profile("edge", None)
    settings = spec.choose_vision_settings(profile, {})
    for stage, source, problem in ((None, made["checkpoint"], "judged on its answers: give"),
                                   ("vision", made["eval"], "not a vision-language"),
                                   ("audio", made["checkpoint"], "'audio' is not one of")):
        request = spec.BuildRequest(source=source, repository=tmp_path / "repo", model="m",
                                    version=1, stage=stage)
        with pytest.raises(ConfigError, match=problem):
            pipeline.build(request, profile, settings, now=NOW)
    torch_settings = spec.choose_vision_settings(load_profile("datacenter", None),
                                                 {"backend": "torch"})
    request = spec.BuildRequest(source=made["checkpoint"], repository=tmp_path / "repo",
                                model="m", version=1, stage="vision")
    with pytest.raises(ConfigError, match="backend: the vision stage is built for onnxruntime"):
        pipeline.build(request, load_profile("datacenter", None), torch_settings, now=NOW)


def test_tiered_build_cli_builds_the_datacenter_vision_stage(made, tmp_path, capsys):
    from tiered.cli import main

    code = main(["build", str(made["checkpoint"]), "--stage", "vision", "--tier", "datacenter",
                 "--repository", str(tmp_path / "repo"), "--model", "vision", "--version", "1",
                 "--eval", str(made["eval"])])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out["gate"]["reason"]
    assert (out["backend"], out["precision"], out["kind"]) == ("onnxruntime", "fp16",
                                                               "vision-stage")
    assert out["stage"]["n_visual"] == n_visual() and out["stage"]["image_token_index"] == 3
    assert (tmp_path / "repo" / "vision" / "1" / "model.onnx").is_file()


def test_stage_data_takes_images_or_pixel_values_and_questions(made, tmp_path):
    preprocessor = vision_language.read_preprocessor(made["checkpoint"])
    data = vision_language.load_stage_data(made["eval"], preprocessor, 10, "eval")
    assert data.pixels.shape == (10, 3, 8, 8) and data.questions is not None
    assert len(data.questions) == 10 and data.questions[1] == "what colour is it ?"
    path = tmp_path / "pixels.npz"
    np.savez(path, pixel_values=data.pixels, questions=np.array("is it a cat ?"))
    again = vision_language.load_stage_data(path, preprocessor, 100, "calibration")
    np.testing.assert_array_equal(again.pixels, data.pixels)
    assert again.questions == ("is it a cat ?",) * 10
    for arrays, problem in (
            ({"pictures": data.pixels}, "exactly one of images or pixel_values"),
            ({"pixel_values": data.pixels[:, :, :4]}, r"eval.pixel_values: FP32 \[n, 3, 8, 8\]"),
            ({"images": np.zeros((2, 4, 4, 2), np.uint8)}, "eval.images: .*C of 1, 3 or 4"),
            ({"images": eval_images(3), "questions": np.array(["a", "b"])}, "2 questions for 3"),
            ({"images": eval_images(2), "questions": np.array([1, 2])}, "strings expected")):
        np.savez(path, **arrays)
        with pytest.raises(ConfigError, match=problem):
            vision_language.load_stage_data(path, preprocessor, 100, "eval")


@pytest.mark.parametrize(("candidate", "verdict", "why"), [
    ("same", "pass", "within the thresholds"),
    ("nan", "fail", "NaN/inf"),
    ("one token flipped", "fail", "1st percentile"),
    ("scaled", "fail", "relative L2"),
    ("few", "inconclusive", "only 4 images"),
])
def test_visual_gate_table(candidate, verdict, why):
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((10, 16, 8))
    got = {"same": reference.copy(), "nan": reference.copy(), "scaled": reference * 1.3,
           "one token flipped": reference.copy(), "few": reference[:4].copy()}[candidate]
    if candidate == "nan":
        got[0, 0, 0] = np.nan
    if candidate == "one token flipped":
        got[:, 0] = -got[:, 0]  # 10 of 160 tokens: the 1st percentile sees them
    ref = reference[:4] if candidate == "few" else reference
    agreement = gate.compare_visual_tokens(ref, got)
    decision = gate.judge_visual(agreement, None, min_cosine_mean=0.8, min_cosine_p1=0.95,
                                 max_relative_l2=0.15, min_answer_match=0.9, min_images=8)
    assert decision.verdict == verdict and why in decision.reason
    assert "answer match not measured" in decision.reason
    if candidate == "scaled":  # scaling keeps every direction
        assert agreement.cosine_min == pytest.approx(1.0)
        assert agreement.relative_l2 == pytest.approx(0.3)


def test_compare_visual_tokens_refuses_mismatched_shapes():
    with pytest.raises(EngineError, match="images, tokens, hidden"):
        gate.compare_visual_tokens(np.zeros((2, 3, 4)), np.zeros((2, 3, 5)))
