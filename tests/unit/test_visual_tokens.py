"""Visual-token pruning and the cap (engines/visual_tokens.py): the
criterion's scores on crafted tokens, which tokens each setting keeps and in
what order, the settings' errors, and the vision stage serving them on the
trained tinyvlm v1 (real ONNX Runtime): off by default it serves what it
served before, byte for byte."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import yaml

from tiered.agent.config import VisionStageConfig
from tiered.agent.generation import GenerationRequest
from tiered.agent.repository import read_model_config
from tiered.engines.build import spec
from tiered.engines.generative.base import Sampling
from tiered.engines.visual_tokens import (
    Pruning,
    TokenSelection,
    kept_indices,
    padded,
    scores,
    select,
    unpadded,
)
from tiered.errors import ConfigError, InvalidArgument
from tiered.profiles import load_profile
from tiered.settings import load_dataclass

HIDDEN = 4


def tokens(*norms: float) -> np.ndarray:
    """One image's tokens [n, HIDDEN] of these L2 norms, each along another axis."""
    out = np.zeros((len(norms), HIDDEN), np.float32)
    for index, norm in enumerate(norms):
        out[index, index % HIDDEN] = norm
    return out


def test_relative_norm_scores_each_token_by_its_images_strongest():
    image = tokens(3.0, 6.0, 0.6, 1.5)
    np.testing.assert_allclose(scores(image), [0.5, 1.0, 0.1, 0.25])
    # Per image, whatever the scale; an image of zero tokens scores 1 throughout.
    both = np.stack([image, image * 1000, np.zeros_like(image)])
    np.testing.assert_allclose(scores(both), [[0.5, 1.0, 0.1, 0.25]] * 2 + [[1.0] * 4])


@pytest.mark.parametrize(("selection", "kept"), [
    (TokenSelection(), [0, 1, 2, 3, 4]),  # off: every token
    (TokenSelection(prune=Pruning(threshold=0.15)), [0, 1, 3, 4]),  # 0.1 dropped
    (TokenSelection(prune=Pruning(threshold=0.5)), [0, 1, 4]),  # 0.25 dropped, 0.5 kept
    (TokenSelection(prune=Pruning(threshold=0.99)), [1]),  # the strongest always stays
    (TokenSelection(prune=Pruning(threshold=0.0)), [0, 1, 2, 3, 4]),
    (TokenSelection(max_visual_tokens=2), [1, 4]),  # the top two, in original order
    (TokenSelection(max_visual_tokens=3), [0, 1, 4]),
    (TokenSelection(max_visual_tokens=9), [0, 1, 2, 3, 4]),
    # The cap after pruning: of 0, 1, 3, 4 the top three.
    (TokenSelection(max_visual_tokens=3, prune=Pruning(threshold=0.15)), [0, 1, 4]),
])
def test_each_setting_keeps_its_tokens_in_original_order(selection, kept):
    image = tokens(3.0, 6.0, 0.6, 1.5, 4.8)  # scores 0.5, 1, 0.1, 0.25, 0.8
    assert kept_indices(image, selection).tolist() == kept
    np.testing.assert_array_equal(select(image[None], selection)[0], image[kept])


def test_the_cap_keeps_the_earlier_of_equal_scores():
    image = tokens(2.0, 1.0, 2.0, 2.0)
    assert kept_indices(image, TokenSelection(max_visual_tokens=2)).tolist() == [0, 2]


def test_padded_tokens_round_trip_and_a_gap_is_refused():
    per_image = [tokens(1.0, 2.0, 3.0), tokens(4.0)]
    array = padded(per_image, HIDDEN)
    assert array.shape == (2, 3, HIDDEN) and np.isnan(array[1, 1:]).all()
    rows, counts = unpadded(array)
    assert counts == [3, 1]
    np.testing.assert_array_equal(rows, np.concatenate(per_image))
    array[0, 1] = np.nan  # a NaN row between tokens
    with pytest.raises(ValueError, match="must end an image's tokens"):
        unpadded(array)
    with pytest.raises(ValueError, match="holds no token"):
        unpadded(np.full((1, 2, HIDDEN), np.nan, np.float32))


@pytest.mark.parametrize(("vision", "message"), [
    ({"max_visual_tokens": 0}, r"generation\.vision\.max_visual_tokens: must be an integer >= 1"),
    ({"max_visual_tokens": "all"}, r"generation\.vision\.max_visual_tokens: expected an integer"),
    ({"prune": {"threshold": 1.0}}, r"generation\.vision\.prune\.threshold: must be within "
                                    r"\[0, 1\)"),
    ({"prune": {"threshold": -0.1}}, r"generation\.vision\.prune\.threshold"),
    ({"prune": {"criterion": "attention"}}, r"generation\.vision\.prune\.criterion: "
                                            r"'attention' is not one of relative_norm"),
    ({"prune": {"threshold": 0.2, "top": 3}}, r"generation\.vision\.prune: unknown key 'top'"),
])
def test_a_bad_setting_is_a_config_error_naming_the_field(tmp_path, vision, message):
    (tmp_path / "vlm" / "1").mkdir(parents=True)
    (tmp_path / "vlm" / "config.yaml").write_text(yaml.safe_dump({
        "backend": "torch-generative", "generation": {"vision": vision}}))
    with pytest.raises(ConfigError, match=message):
        read_model_config(tmp_path, "vlm", load_profile("edge", None))
    # The build's settings name them the same way.
    with pytest.raises(ConfigError, match=message.replace(r"generation\.vision", "b")):
        load_dataclass(spec.VisionBuildSettings, vision, "b")


def test_the_settings_are_off_by_default_and_read_as_written(tmp_path):
    assert not VisionStageConfig().selection.active
    assert not spec.VisionBuildSettings().selection.active
    (tmp_path / "vlm" / "1").mkdir(parents=True)
    (tmp_path / "vlm" / "config.yaml").write_text(yaml.safe_dump({
        "backend": "torch-generative", "generation": {"vision": {
            "max_visual_tokens": 64, "prune": {"criterion": "relative_norm",
                                               "threshold": 0.15}}}}))
    vision = read_model_config(tmp_path, "vlm", load_profile("edge", None)).generation.vision
    assert vision.selection == TokenSelection(64, Pruning("relative_norm", 0.15))
    assert vision.selection.describe() == "pruned by relative_norm < 0.15, at most 64 an image"


# The vision stage on tinyvlm v1 (4 visual tokens an image), run by ONNX Runtime.

@pytest.fixture(scope="module")
def version(tinyvlm_models, tmp_path_factory):
    """A version directory: the decoder's visual.json, the exported stage."""
    import json
    import shutil

    from tiered.engines.build.vision_language import export_vision_stage
    from tiered.engines.generative.visual import VisualFacts
    from tiered.engines.images import PREPROCESSOR_FILE

    checkpoint = tinyvlm_models / "tinyvlm-v1"
    out = tmp_path_factory.mktemp("version")
    VisualFacts.of_llava(json.loads((checkpoint / "config.json").read_text()),
                         "config.json").write(out)
    export_vision_stage(checkpoint, out / "vision" / "model.onnx")
    shutil.copy(checkpoint / PREPROCESSOR_FILE, out / "vision" / PREPROCESSOR_FILE)
    return out


@pytest.fixture(scope="module")
def images(tinyvlm_models):
    with np.load(tinyvlm_models / "tinyvlm-eval.npz") as archive:
        return archive["image"][:3]


def stage(version, **settings):
    from tiered.agent.vision_language import VisionStage

    config = load_dataclass(VisionStageConfig, settings, "vision")
    return VisionStage.open(version, config, "vision")


def served(vision, image: np.ndarray, prompt: str) -> GenerationRequest:
    request = vision.take(GenerationRequest(prompt, Sampling()), {"image": image})
    return vision.with_visual(request, asyncio.run(vision.encode(request.images)))


def test_off_by_default_the_stage_serves_every_token_as_made(version, images):
    vision = stage(version)
    try:
        request = served(vision, images[:2], "<image> and <image> ?")
        made = vision.engine.run({"pixel_values": vision_pixels(vision, images[:2])},
                                 ["visual_tokens"])["visual_tokens"]
        # What the stage served before pruning existed: every row, marks x 4.
        assert request.prompt == "<image>" * 4 + " and " + "<image>" * 4 + " ?"
        assert request.visual.tobytes() == np.ascontiguousarray(
            made.reshape(-1, made.shape[-1]), np.float32).tobytes()
        assert (vision.kept, vision.dropped) == (8, 0)
    finally:
        vision.close()


def test_a_cap_keeps_each_images_strongest_tokens_and_counts_the_rest(version, images):
    vision = stage(version, max_visual_tokens=2)
    try:
        request = served(vision, images, "what digit is this?")
        made = vision.engine.run({"pixel_values": vision_pixels(vision, images)},
                                 ["visual_tokens"])["visual_tokens"]
        want = np.concatenate([image[np.sort(np.argsort(-scores(image))[:2])]
                               for image in made])
        assert request.prompt == "<image>" * 6 + "what digit is this?"  # 2 an image, in front
        np.testing.assert_array_equal(request.visual, want)
        assert (vision.kept, vision.dropped) == (6, 6)
        # Answered for a split: one row an image, each of its two kept tokens.
        output = vision.as_output(select(made, vision.selection))
        assert output.shape == (3, 2, made.shape[-1]) and np.isfinite(output).all()
        with pytest.raises(InvalidArgument, match="marks 2 images"):
            vision.take(GenerationRequest("<image><image>", Sampling()), {"image": images[0]})
    finally:
        vision.close()


def vision_pixels(vision, images: np.ndarray) -> np.ndarray:
    from tiered.engines.images import pixel_values

    return pixel_values(images, vision.preprocessor)


# The build's gate on tinyvlm v1's vision stage: the FP32 decoder's answers
# from the kept tokens against those from every FP32 token.

@pytest.fixture(scope="module")
def digit_questions(tinyvlm_models, tmp_path_factory):
    """24 held-out images, each asked which digit it shows (`questions`, as
    the vision stage's build reads them)."""
    with np.load(tinyvlm_models / "tinyvlm-eval.npz") as archive:
        pixels, asked = archive["pixel_values"][:24], str(archive["question"][0])
    path = tmp_path_factory.mktemp("eval") / "eval.npz"
    np.savez(path, pixel_values=pixels, questions=np.array([asked] * len(pixels)))
    return path


def build_stage(tinyvlm_models, digit_questions, tmp_path, vision):
    import datetime

    from tiered.engines.build import pipeline

    profile = load_profile("regional", None)
    settings = spec.choose_vision_settings(profile, {
        "latency_batch_sizes": (1,), "latency_runs": 2, "latency_budget_s": 0.01,
        "vision": vision})
    request = spec.BuildRequest(source=tinyvlm_models / "tinyvlm-v1",
                                repository=tmp_path / "repo", model="vision", version=1,
                                evaluation=digit_questions, stage="vision")
    return pipeline.build(request, profile, settings,
                          now=datetime.datetime(2026, 12, 5, tzinfo=datetime.timezone.utc))


def test_the_gate_fails_a_threshold_that_drops_almost_every_token(tinyvlm_models,
                                                                   digit_questions, tmp_path):
    outcome = build_stage(tinyvlm_models, digit_questions, tmp_path,
                          {"prune": {"threshold": 0.99}})
    decision = outcome.decision
    assert decision.verdict == "fail" and not decision.accepted and outcome.installed is None
    assert "answer match below the threshold with the visual tokens pruned by " \
           "relative_norm < 0.99" in decision.reason
    assert "lower the prune threshold or raise max_visual_tokens" in decision.reason
    kept = outcome.report["visual_tokens"]
    assert kept["tokens_per_image"] == 4 and kept["images"] == 24
    assert kept["mean_kept"] < 1.5 and kept["min_kept"] == 1
    assert f"{kept['mean_kept']:.2f} of 4 kept an image on average" in decision.reason
    assert outcome.report["accuracy"]["answer_match"] < 0.9


def test_the_gate_passes_a_threshold_that_keeps_the_answers_and_reports_tokens_kept(
        tinyvlm_models, digit_questions, tmp_path):
    outcome = build_stage(tinyvlm_models, digit_questions, tmp_path,
                          {"prune": {"threshold": 0.5}, "max_visual_tokens": 4})
    assert outcome.decision.verdict == "pass", outcome.decision.reason
    kept = outcome.report["visual_tokens"]
    assert 3.0 <= kept["mean_kept"] <= 4.0 and kept["max_kept"] <= 4
    assert f"{kept['mean_kept']:.2f} of 4 kept an image" in outcome.decision.reason
    # Off by default: nothing said of kept tokens.
    plain = build_stage(tinyvlm_models, digit_questions, tmp_path / "plain", {})
    assert plain.report["visual_tokens"] is None and "kept" not in plain.decision.reason


def test_pruning_without_questions_is_inconclusive_never_a_pass():
    from tiered.engines.build import gate

    same = np.ones((8, 4, HIDDEN), np.float32)
    kept = gate.TokensKept.of("at most 2 an image", 4, [2] * 8)
    decision = gate.judge_visual(gate.compare_visual_tokens(same, same), None,
                                 min_cosine_mean=0.99, min_cosine_p1=0.95, max_relative_l2=0.15,
                                 min_answer_match=0.9, min_images=8, kept=kept)
    assert decision.verdict == "inconclusive" and not decision.accepted
    assert "only answers can judge it" in decision.reason
    assert "2.00 of 4 kept an image on average" in decision.reason
