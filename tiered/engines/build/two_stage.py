"""A vision-language checkpoint built whole for one tier: both stages in one
version, judged on the answers they give together.

1. The vision stage is built as `vision_language.build_vision_stage` builds
   it (export, lower, its own gate on the visual tokens and on the answers
   the FP32 decoder gives from them), into a scratch repository.
2. The decoder is the checkpoint's language model as a Llama checkpoint
   (`generative.visual.decoder_checkpoint`), lowered as the tier lowers any
   (INT4 onnxruntime-genai on the edge, with the pipeline that takes visual
   tokens; torch in the datacenter).
3. The gate: the built decoder, fed the built vision stage's tokens, answers
   every eval question greedily; the answers must match the FP32 model's
   (transformers, FP32 stage) on at least the vision gate's
   `min_answer_match` of them. Where the eval data holds the expected
   answers (`answers`), both models' accuracy is reported beside it. Where
   `build.vision` sets visual-token pruning or a cap, the built decoder is
   fed only the tokens they keep (both gates judge them), and the mean kept
   is reported.
4. Installed together, or not at all: the version is the decoder's build
   with the vision stage in `vision/` (its model.onnx and the checkpoint's
   preprocessor_config.json) and a config.yaml whose `generation.vision`
   serves it (`tiered.agent.vision_language`), with the pruning and cap the
   gate judged.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiered.engines import generative as engines
from tiered.engines import open_engine
from tiered.engines.build import gate, generative, install, report, spec, vision_language
from tiered.engines.generative.base import GenerativeEngine, Sampling
from tiered.engines.generative.visual import IMAGE_TOKEN, decoder_checkpoint
from tiered.engines.images import PREPROCESSOR_FILE, Preprocessor
from tiered.errors import ConfigError
from tiered.profiles import TierProfile
from tiered.settings import load_dataclass, read_yaml

STAGE_DIR = "vision"  # the vision stage's directory in a version (agent.config.VisionStageConfig)
MAX_LISTED = 32  # mismatched questions named in the report


def build_whole(
    request: spec.BuildRequest, profile: TierProfile, settings: spec.BuildSettings,
    decoder: spec.GenerativeBuildSettings, *, now: datetime.datetime,
    clock: Callable[[], float] = time.perf_counter,
    verdict: report.VerdictOf | None = None,
) -> report.BuildOutcome:
    """Both stages for `profile`'s tier (`settings` the vision stage's, as
    spec.choose_vision_settings makes them; `decoder` the decoder's); install
    only what the gate accepts."""
    if request.evaluation is None:
        raise ConfigError("eval: a vision-language build is judged on its answers: give an "
                          "npz of `images` and `questions` (and `answers`, for accuracy)")
    gate_settings = load_dataclass(spec.VisionBuildSettings, settings.vision,
                                   f"{profile.tier} build.vision")
    generative_preflight(request, decoder)
    with tempfile.TemporaryDirectory(prefix="tiered-build-") as work_name:
        work = Path(work_name)
        stage = vision_language.build_vision_stage(
            _scratch(request, work / "stages"), profile, settings, now=now, clock=clock)
        if not stage.decision.accepted:
            record = {**stage.report, "stages": {"vision": "rejected", "decoder": "not built"}}
            return report.BuildOutcome(record, stage.decision, None)
        assert stage.installed is not None
        target = generative.choose_target(decoder)
        version = work / "version"
        decoder_checkpoint(request.source, work / "decoder")
        generative.lower(work / "decoder", target, version, work)
        engine_settings = generative.served_settings(target, decoder)
        checkpoint = vision_language.Checkpoint(request.source)
        data = eval_questions(request.evaluation, vision_language.read_preprocessor(
            request.source), settings.eval_samples)
        stage_config = read_yaml(stage.installed.parent / install.CONFIG_FILE)
        vision = open_engine(stage_config["backend"], stage.installed / install.MODEL_FILE,
                             stage_config.get("engine", {}), f"{profile.tier} vision stage")
        try:
            built_tokens = vision_language.run_stage(vision, data.pixels)
        finally:
            vision.close()
        reference = checkpoint.answers(checkpoint.image_features(data.pixels), data.questions,
                                       gate_settings.max_new_tokens)
        selection = gate_settings.selection
        kept_tokens, kept = vision_language.kept_tokens(built_tokens, selection)
        built = engines.open_generative(target.backend, version, engine_settings,
                                        f"{profile.tier} build.generative.engine")
        try:
            answers = greedy_answers(built, kept_tokens, data.questions,
                                     gate_settings.max_new_tokens)
        finally:
            built.close()
        match = gate.compare_answers(reference, answers, gate_settings.max_new_tokens)
        decision = gate.judge_answers(match, gate_settings.min_answer_match,
                                      gate_settings.min_eval_images,
                                      request.allow_accuracy_drop, kept)
        record = {
            "kind": "vision-language", "tier": profile.tier, "model": request.model,
            "version": request.version, "created": now.isoformat(),
            "decoder": {"backend": target.backend, "precision": target.precision,
                        "device": target.device, "note": target.note},
            "vision_stage": stage.report,
            "answers": {"questions": match.questions, "match": match.match,
                        "mismatched": list(match.mismatched)[:MAX_LISTED],
                        **_accuracy(data, checkpoint, reference, answers)},
            "visual_tokens": None if kept is None else dataclasses.asdict(kept),
            "gate": {"verdict": decision.verdict, "accepted": decision.accepted,
                     "reason": decision.reason},
        }
        installed = None
        if decision.accepted:
            shutil.copytree(stage.installed, version / STAGE_DIR)
            shutil.copy(request.source / PREPROCESSOR_FILE, version / STAGE_DIR)
            if verdict is not None:
                record["verdict"] = dict(verdict(decision, request.repository / request.model
                                                 / str(request.version)))
            report.write_report(version, record)
            served: dict[str, Any] = {"path": STAGE_DIR, "backend": stage_config["backend"],
                                      "engine": stage_config.get("engine", {})}
            if selection.max_visual_tokens is not None:
                served["max_visual_tokens"] = selection.max_visual_tokens
            if selection.prune is not None:
                served["prune"] = dataclasses.asdict(selection.prune)
            config: dict[str, Any] = {"backend": target.backend,
                                      "generation": {"vision": served}}
            if engine_settings:
                config["engine"] = engine_settings
            installed = install.install_version(version, request.repository, request.model,
                                                request.version, config, force=request.force)
    return report.BuildOutcome(record, decision, installed)


def greedy_answers(engine: GenerativeEngine, visual: Sequence[np.ndarray],
                   questions: Sequence[str], max_new_tokens: int) -> list[list[int]]:
    """The engine's greedy answer ids, one question an image (`visual` each
    image's tokens, as many as it kept), each prompt its image's tokens then
    the question (as the agent serves one: the image first when the question
    does not mark it)."""
    sampling = Sampling(max_tokens=max_new_tokens)
    out: list[list[int]] = []
    for question, rows in zip(questions, visual, strict=True):
        prompt = engine.encode(IMAGE_TOKEN * len(rows) + question)
        sequence = engine.start(prompt, sampling, np.ascontiguousarray(rows))
        ids: list[int] = []
        while engine.running:
            ids += [token.id for token in engine.step() if token.sequence == sequence]
        out.append(ids)
    return out


def generative_preflight(request: spec.BuildRequest,
                         decoder: spec.GenerativeBuildSettings) -> None:
    """What the decoder's build refuses before it starts (layout, backend)."""
    install.check_destination(request)
    if decoder.backend not in engines.GENERATIVE_BACKENDS:
        raise ConfigError(f"backend: {decoder.backend!r} is not a generative backend")


def _scratch(request: spec.BuildRequest, repository: Path) -> spec.BuildRequest:
    """The request for the vision stage alone, built into a scratch repository."""
    return dataclasses.replace(request, repository=repository, model="vision", version=1,
                               stage=vision_language.VISION_STAGE, force=True)


@dataclasses.dataclass(frozen=True)
class EvalQuestions:
    """Eval images as pixel values, a question each, and the expected answers
    where the data has them."""

    pixels: np.ndarray  # FP32 [n, 3, H, W]
    questions: tuple[str, ...]
    answers: tuple[str, ...] | None


def eval_questions(path: Path, preprocessor: Preprocessor, limit: int) -> EvalQuestions:
    """An eval npz as `vision_language.load_stage_data` reads it (`questions`
    one an image, maybe `answers` too), or every image asked each of
    `question` [k] with `answer` [n, k] expected (tinyvlm-eval.npz's form);
    at most `limit` questions."""
    with np.load(path, allow_pickle=False) as archive:
        asked = archive["question"] if "question" in archive.files else None
        table = archive["answer"] if "answer" in archive.files else None
        listed = archive["answers"] if "answers" in archive.files else None
    data = vision_language.load_stage_data(path, preprocessor, limit, "eval")
    if data.questions is not None:
        answers = None if listed is None else tuple(str(a) for a in listed[:len(data.pixels)])
        return EvalQuestions(data.pixels, data.questions, answers)
    if asked is None or table is None or table.shape != (len(data.pixels), len(asked)):
        raise ConfigError(f"eval: {path} holds no questions: `questions` (one an image), or "
                          "`question` [k] with `answer` [images, k]")
    count = min(limit, table.size)
    return EvalQuestions(np.repeat(data.pixels, len(asked), axis=0)[:count],
                         tuple(str(q) for q in np.tile(asked, len(data.pixels))[:count]),
                         tuple(str(a) for a in table.reshape(-1)[:count]))


def _accuracy(data: EvalQuestions, checkpoint: vision_language.Checkpoint,
              reference: Sequence[Sequence[int]], built: Sequence[Sequence[int]]
              ) -> dict[str, Any]:
    """Each model's share of the expected answers, where the eval data has them."""
    if data.answers is None:
        return {}

    def share(answers: Sequence[Sequence[int]]) -> float:
        said = [checkpoint.tokenizer.decode(ids, skip_special_tokens=True).strip()
                for ids in answers]
        return sum(a == b.strip() for a, b in zip(said, data.answers, strict=True)) / len(said)

    return {"accuracy_fp32": share(reference), "accuracy_built": share(built)}
