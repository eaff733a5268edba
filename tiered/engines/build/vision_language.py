"""The vision stage of a vision-language checkpoint: its ONNX export and its
tier builds, judged on visual tokens and, where the eval data asks questions,
on the answers the checkpoint's own decoder gives from them.

A LLaVA-style checkpoint (config.json `model_type: llava`, the layout
`LlavaForConditionalGeneration.save_pretrained` writes, its tokenizer and a
`preprocessor_config.json`) is served as two stages. This module makes the
first one an ordinary predictive model:

    pixel_values  FP32 [batch, 3, H, W]  (tiered.engines.images makes them)
    visual_tokens FP32 [batch, n_visual, text_hidden]

what `LlavaForConditionalGeneration.get_image_features` computes: the vision
tower's hidden state at `vision_feature_layer` (several layers concatenated
where it lists them), CLS dropped for the "default" strategy, through the
projector. The decoder stage places these tokens at the prompt's
`image_token_index` positions (tiered.engines.generative builds it).

A build exports the FP32 stage, lowers it as any ONNX artifact is lowered for
the tier (tiered.engines.quantize: edge INT8 static QDQ calibrated on images,
FP16 elsewhere), runs both on the eval images and judges the built tokens
against the FP32 ones (tiered.engines.build.gate.judge_visual); with
questions, the checkpoint's FP32 decoder (transformers, on the CPU) answers
each greedily from either stage's tokens, and the answers must match. Where
`build.vision` sets visual-token pruning or a cap (engines/visual_tokens.py),
the built stage's answers come from the tokens it keeps, and the report
says how many it kept. Only a
version the gate accepts is installed, with a config.yaml that serves it on
the agent like any other model.

torch and transformers are imported only when a function here runs. It must
never import tiered.agent or tiered.protocol, and never install a rejected
build.
"""

from __future__ import annotations

import datetime
import io
import json
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tiered import names
from tiered.engines import Engine, open_engine, quantize
from tiered.engines.build import gate, install, pipeline, report, samples, spec
from tiered.engines.images import MAX_IMAGES, PREPROCESSOR_FILE, Preprocessor, pixel_values
from tiered.engines.visual_tokens import TokenSelection, select
from tiered.errors import ConfigError, EngineError, InvalidArgument
from tiered.files import sha256_file, sha256_tree
from tiered.profiles import TierProfile
from tiered.settings import load_dataclass, read_yaml

VISION_STAGE = "vision"
STAGES = (VISION_STAGE,)  # built alone; the decoder is built with it (two_stage.py)
INPUT = "pixel_values"
OUTPUT = "visual_tokens"
BATCH_DIM = "batch"
OPSET = 17
IR_VERSION = 8
STRATEGIES = ("default", "full")  # "default" drops the CLS token, "full" keeps it
# The export must reproduce transformers' tokens to this share of their
# largest magnitude (FP32 kernels of ORT and torch differ in summation order).
EXPORT_TOLERANCE = 1e-4
EVAL_BATCH = 32  # images per engine run while comparing
CALIBRATION_BATCH = 16
IMAGE_KEYS = ("images", INPUT)  # an eval/calibration npz holds one of them
QUESTION_KEY = "questions"
MAX_QUESTION_CHARS = 2000
ANSWER_BATCH = 16  # prompts answered at once


def is_vision_language(path: Path) -> bool:
    """A checkpoint directory whose config.json says `model_type: llava`."""
    config = Path(path) / "config.json"
    if not (Path(path).is_dir() and config.is_file()):
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == "llava"
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class VisionStageShape:
    """What a checkpoint's config.json says of its vision stage."""

    image_height: int
    image_width: int
    patch_size: int
    n_visual: int  # visual tokens an image
    text_hidden: int
    image_token_index: int
    vision_feature_layer: int | tuple[int, ...]
    strategy: str

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (3, self.image_height, self.image_width)


def read_shape(checkpoint: Path) -> VisionStageShape:
    """The vision stage's shape from config.json, each field checked."""
    path = Path(checkpoint) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read the checkpoint's config: {error}") from error
    if not isinstance(config, dict) or config.get("model_type") != "llava":
        raise ConfigError(f"{path}: model_type: a vision stage is built from a llava "
                          f"checkpoint, got {config.get('model_type')!r}")
    vision = _mapping(config, "vision_config", path)
    text = _mapping(config, "text_config", path)
    image_size = _positive(vision, "image_size", path, "vision_config.")
    patch_size = _positive(vision, "patch_size", path, "vision_config.")
    if image_size % patch_size:
        raise ConfigError(f"{path}: vision_config.image_size: {image_size} is not a multiple "
                          f"of patch_size {patch_size}")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in STRATEGIES:
        raise ConfigError(f"{path}: vision_feature_select_strategy: {strategy!r} is not one of "
                          f"{', '.join(STRATEGIES)}")
    layer = config.get("vision_feature_layer", -2)
    layers = layer if isinstance(layer, list) else [layer]
    if not layers or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers):
        raise ConfigError(f"{path}: vision_feature_layer: an integer or a list of them, "
                          f"got {layer!r}")
    index = config.get("image_token_index", config.get("image_token_id"))
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigError(f"{path}: image_token_index: a token id, got {index!r}")
    patches = (image_size // patch_size) ** 2
    return VisionStageShape(
        image_height=image_size, image_width=image_size, patch_size=patch_size,
        n_visual=patches + (strategy == "full"),
        text_hidden=_positive(text, "hidden_size", path, "text_config."),
        image_token_index=index,
        vision_feature_layer=tuple(layers) if isinstance(layer, list) else layer,
        strategy=strategy)


def _mapping(config: Mapping[str, Any], key: str, path: Path) -> Mapping[str, Any]:
    value = config.get(key)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: {key}: a mapping, got {value!r}")
    return value


def _positive(config: Mapping[str, Any], key: str, path: Path, prefix: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: {prefix}{key}: a positive integer, got {value!r}")
    return value


def read_preprocessor(checkpoint: Path) -> Preprocessor:
    path = Path(checkpoint) / PREPROCESSOR_FILE
    if not path.is_file():
        raise ConfigError(f"artifact: {checkpoint} has no {PREPROCESSOR_FILE}: the vision "
                          "stage's images cannot be prepared without it")
    return Preprocessor.from_json(path)


class Checkpoint:
    """The FP32 transformers model of a vision-language checkpoint, on the
    CPU: the reference for the export and the decoder of the answer match."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlavaForConditionalGeneration

        self.shape = read_shape(path)
        try:
            self.model = LlavaForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise ConfigError(f"artifact: {path}: transformers cannot load the vision-language "
                              f"checkpoint: {error}") from error
        self._torch = torch

    def stage_module(self) -> Any:
        """The vision stage as a torch module: pixel values in, visual tokens out."""
        torch = self._torch
        shape = self.shape
        inner = self.model.model

        class VisionStage(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tower = inner.vision_tower
                self.projector = inner.multi_modal_projector

            def forward(self, pixels: Any) -> Any:
                states = self.tower(pixels, output_hidden_states=True).hidden_states
                layers = (shape.vision_feature_layer if isinstance(shape.vision_feature_layer,
                                                                   tuple)
                          else (shape.vision_feature_layer,))
                chosen = [states[layer] for layer in layers]
                if shape.strategy == "default":
                    chosen = [hidden[:, 1:] for hidden in chosen]
                return self.projector(torch.cat(chosen, dim=-1) if len(chosen) > 1
                                      else chosen[0])

        return VisionStage().eval()

    def image_features(self, pixels: np.ndarray) -> np.ndarray:
        """transformers' own `get_image_features`, [n, n_visual, text_hidden]."""
        torch = self._torch
        layer = self.shape.vision_feature_layer
        with torch.no_grad():
            out = self.model.get_image_features(
                torch.from_numpy(pixels),
                vision_feature_layer=list(layer) if isinstance(layer, tuple) else layer,
                vision_feature_select_strategy=self.shape.strategy)
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.stack(list(features)).numpy()

    def prompt_ids(self, question: str, visual: int | None = None) -> list[int]:
        """The prompt as LLaVA's processor expands it: the image token
        n_visual times (`visual` times: an image's kept tokens), then the
        question, tokenized as one text with the tokenizer's own special
        tokens; ConfigError where the tokenizer does not keep the image token
        whole."""
        count = self.shape.n_visual if visual is None else visual
        image = self.tokenizer.convert_ids_to_tokens(self.shape.image_token_index)
        ids = list(self.tokenizer(image * count + question).input_ids)
        if ids.count(self.shape.image_token_index) != count:
            raise ConfigError(f"image_token_index: the tokenizer encodes {image!r} x "
                              f"{count} as {ids.count(self.shape.image_token_index)}"
                              f" image tokens; it must be one special token")
        return ids

    def answers(self, visual_tokens: Sequence[np.ndarray], questions: Sequence[str],
                max_new_tokens: int) -> list[list[int]]:
        """Greedy answer ids, one question an image (`visual_tokens` each
        image's [tokens, hidden]: an array [images, n, hidden], or the kept
        tokens of a pruned stage, one array an image): the prompt's embeddings
        with the image tokens' rows replaced by the image's visual tokens,
        generated from `inputs_embeds` (the decoder stage's path). Prompts of
        one length run as one batch (no padding, so a batch answers what each
        prompt alone would), at most ANSWER_BATCH at once."""
        torch = self._torch
        prompts = self._prompts(visual_tokens, questions)
        out: list[list[int]] = [[] for _ in prompts]
        with torch.no_grad():
            for group in _same_length(prompts):
                ids = torch.tensor([prompts[i] for i in group])
                generated = self.model.generate(
                    inputs_embeds=self._embeddings(ids, [visual_tokens[i] for i in group],
                                                   ids.shape[1]),
                    attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                    do_sample=False, pad_token_id=self.tokenizer.eos_token_id)
                for row, index in enumerate(group):
                    out[index] = _until_end(generated[row].tolist(), self.tokenizer.eos_token_id)
        return out

    def forced_top1(self, visual_tokens: Sequence[np.ndarray], questions: Sequence[str],
                    answers: Sequence[Sequence[int]]) -> list[list[int]]:
        """The decoder's top-1 at each position of each answer, fed the prompt
        (with these visual tokens) and the answer's tokens before it."""
        torch = self._torch
        prompts = self._prompts(visual_tokens, questions)
        # The answer's last token is never an input: nothing is predicted after it.
        fed = [[*prompt, *answer[:-1]] for prompt, answer in zip(prompts, answers, strict=True)]
        out: list[list[int]] = [[] for _ in prompts]
        with torch.no_grad():
            # Batched by prompt and answer length both: the image tokens sit
            # in the prompt, whose length a batch's rows share.
            keys = [(len(prompt), len(sequence)) for prompt, sequence in zip(prompts, fed,
                                                                              strict=True)]
            for group in _same_key(keys):
                if not answers[group[0]]:
                    continue
                ids = torch.tensor([fed[i] for i in group])
                embeddings = self._embeddings(ids, [visual_tokens[i] for i in group],
                                              keys[group[0]][0])
                logits = self.model(inputs_embeds=embeddings,
                                    attention_mask=torch.ones_like(ids)).logits
                for row, index in enumerate(group):
                    first = len(prompts[index]) - 1
                    out[index] = logits[row, first:].argmax(dim=-1).tolist()
        return out

    def _prompts(self, visual_tokens: Sequence[np.ndarray], questions: Sequence[str]
                 ) -> list[list[int]]:
        if len(visual_tokens) != len(questions):
            raise EngineError(f"answers: {len(visual_tokens)} images for "
                              f"{len(questions)} questions")
        return [self.prompt_ids(question, len(rows))
                for question, rows in zip(questions, visual_tokens, strict=True)]

    def _embeddings(self, ids: Any, visual_tokens: Sequence[np.ndarray],
                    prompt_length: int) -> Any:
        """The sequences' embeddings, the image tokens' rows within their first
        `prompt_length` positions replaced by the visual tokens, each
        sequence's in turn (an answer may hold the image token's id, and
        stays a text token)."""
        torch = self._torch
        embeddings = self.model.get_input_embeddings()(ids)
        tokens = torch.from_numpy(np.ascontiguousarray(np.concatenate(
            [np.asarray(rows).reshape(-1, embeddings.shape[-1]) for rows in visual_tokens]),
            np.float32))
        in_prompt = torch.arange(ids.shape[1]) < prompt_length
        embeddings[(ids == self.shape.image_token_index) & in_prompt] = tokens.reshape(
            -1, tokens.shape[-1]).to(embeddings.dtype)
        return embeddings


def _same_length(sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of the sequences in batches of one length, ANSWER_BATCH at most."""
    return _same_key([len(sequence) for sequence in sequences])


def _same_key(keys: Sequence[Any]) -> list[list[int]]:
    """Indices in batches of one key each, ANSWER_BATCH at most, in order."""
    by_key: dict[Any, list[int]] = {}
    for index, key in enumerate(keys):
        by_key.setdefault(key, []).append(index)
    return [indices[start:start + ANSWER_BATCH] for indices in by_key.values()
            for start in range(0, len(indices), ANSWER_BATCH)]


def _until_end(ids: list[int], eos: int | None) -> list[int]:
    """An answer up to and with its end-of-sequence token (a batch pads the rest)."""
    return ids[:ids.index(eos) + 1] if eos is not None and eos in ids else ids


def export_vision_stage(checkpoint: Path, out: Path, *, max_batch_size: int = 32) -> Path:
    """Write the FP32 vision stage as ONNX at `out` (opset 17, IR 8, dynamic
    batch) and a config.yaml beside it that serves it as a predictive model;
    the export is checked against transformers' `get_image_features` on two
    random images and refused (EngineError) beyond EXPORT_TOLERANCE.

    Uses torch's TorchScript exporter (`dynamo=False`), as the digits models
    do (tiered.models.digits.export_digits says why)."""
    model = Checkpoint(checkpoint)
    _export(model, out)
    check_export(model, out, np.random.default_rng(0).standard_normal(
        (2, *model.shape.pixel_shape)).astype(np.float32))
    (out.parent / install.CONFIG_FILE).write_text(
        yaml.safe_dump(stage_config(model.shape, {"backend": str(names.Backend.ONNXRUNTIME),
                                                  "max_batch_size": max_batch_size}),
                       sort_keys=False))
    return out


def _export(model: Checkpoint, out: Path) -> None:
    import onnx
    import torch

    buffer = io.BytesIO()
    example = torch.zeros(2, *model.shape.pixel_shape)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer notices
        torch.onnx.export(model.stage_module(), (example,), buffer, input_names=[INPUT],
                          output_names=[OUTPUT], opset_version=OPSET,
                          dynamic_axes={INPUT: {0: BATCH_DIM}, OUTPUT: {0: BATCH_DIM}},
                          dynamo=False)
    exported = onnx.load_model_from_string(buffer.getvalue())
    exported.ir_version = IR_VERSION
    exported.graph.name = "vision_stage"
    exported.producer_name = "tiered.engines.build.vision_language"
    try:
        onnx.checker.check_model(exported, full_check=True)
    except Exception as error:
        raise EngineError(f"the vision stage's ONNX export is not valid: {error}") from error
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(exported, out)


def check_export(model: Checkpoint, exported: Path, pixels: np.ndarray) -> float:
    """The export's largest difference from transformers on `pixels`, relative
    to the tokens' largest magnitude; EngineError beyond EXPORT_TOLERANCE."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
    got = session.run([OUTPUT], {INPUT: pixels})[0]
    want = model.image_features(pixels)
    if got.shape != want.shape:
        raise EngineError(f"the vision stage's export answers {list(got.shape)}, transformers "
                          f"{list(want.shape)}")
    relative = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-12))
    if not relative <= EXPORT_TOLERANCE:
        raise EngineError(f"the vision stage's export differs from transformers by "
                          f"{relative:.3g} of the tokens' largest magnitude (at most "
                          f"{EXPORT_TOLERANCE})")
    return relative


def stage_config(shape: VisionStageShape, base: Mapping[str, Any]) -> dict[str, Any]:
    """A predictive model's config.yaml (tiered.agent.config) for the vision
    stage: `base` (backend, batching, engine) with its tensors declared."""
    return {**base,
            "inputs": [{"name": INPUT, "datatype": "FP32", "dims": list(shape.pixel_shape)}],
            "outputs": [{"name": OUTPUT, "datatype": "FP32",
                         "dims": [shape.n_visual, shape.text_hidden]}]}


@dataclass(frozen=True)
class StageData:
    """Images as pixel values, and a question each where the data has them."""

    pixels: np.ndarray  # FP32 [n, 3, H, W]
    questions: tuple[str, ...] | None
    origin: str  # the npz file, or "random"


def load_stage_data(path: Path, preprocessor: Preprocessor, limit: int,
                    where: str) -> StageData:
    """An npz holding `images` (what tiered.engines.images takes, prepared here)
    or `pixel_values` (FP32 [n, 3, H, W], as they are), and maybe `questions`
    (strings: one an image, or one for every image)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: cannot read {path} as an npz archive: {error}") from error
    found = [key for key in IMAGE_KEYS if key in arrays]
    if len(found) != 1:
        raise ConfigError(f"{where}: {path} needs exactly one of {' or '.join(IMAGE_KEYS)} "
                          f"(it has {', '.join(sorted(arrays)) or 'none'})")
    if found[0] == INPUT:
        pixels = arrays[INPUT][:limit]
        if pixels.dtype != np.float32 or pixels.shape[1:] != preprocessor.shape:
            raise ConfigError(f"{where}.{INPUT}: FP32 [n, {', '.join(map(str, preprocessor.shape))}]"
                              f" expected, got {pixels.dtype} {list(pixels.shape)}")
    else:
        images = arrays["images"][:limit]
        try:  # a call of pixel_values takes at most MAX_IMAGES
            pixels = np.concatenate([pixel_values(images[start:start + MAX_IMAGES], preprocessor)
                                     for start in range(0, max(len(images), 1), MAX_IMAGES)])
        except InvalidArgument as error:
            raise ConfigError(f"{where}.images: {error}") from error
    if not np.isfinite(pixels).all() or pixels.shape[0] == 0:
        raise ConfigError(f"{where}: {path} holds no images, or non-finite pixel values")
    questions = None
    if QUESTION_KEY in arrays:
        asked = arrays[QUESTION_KEY]
        if asked.dtype.kind != "U" or asked.ndim > 1:
            raise ConfigError(f"{where}.{QUESTION_KEY}: strings expected, one an image or one "
                              f"for all, got {asked.dtype} {list(asked.shape)}")
        listed = [str(q) for q in np.atleast_1d(asked)]
        if len(listed) == 1:
            listed = listed * pixels.shape[0]
        listed = listed[:limit]
        if len(listed) != pixels.shape[0] or not all(0 < len(q) <= MAX_QUESTION_CHARS
                                                     for q in listed):
            raise ConfigError(f"{where}.{QUESTION_KEY}: {len(listed)} questions for "
                              f"{pixels.shape[0]} images, each 1..{MAX_QUESTION_CHARS} characters")
        questions = tuple(listed)
    return StageData(np.ascontiguousarray(pixels, np.float32), questions, str(path))


def random_stage_data(preprocessor: Preprocessor, count: int,
                      rng: np.random.Generator) -> StageData:
    """Images of uniform random pixels, prepared as served (no questions)."""
    images = rng.integers(0, 256, (count, preprocessor.height, preprocessor.width, 3),
                          dtype=np.uint8)
    return StageData(pixel_values(images, preprocessor), None, "random")


def build_vision_stage(
    request: spec.BuildRequest, profile: TierProfile, settings: spec.BuildSettings, *,
    now: datetime.datetime, clock: Callable[[], float] = time.perf_counter,
    verdict: report.VerdictOf | None = None,
) -> report.BuildOutcome:
    """Export, lower, judge, time; install only what the gate accepts."""
    gate_settings = load_dataclass(spec.VisionBuildSettings, settings.vision,
                                   f"{profile.tier} build.vision")
    shape, preprocessor = _preflight(request, settings)
    engine_settings = pipeline.engine_settings_of(profile, settings)
    rng = np.random.default_rng(settings.seed)
    evaluation = (load_stage_data(request.evaluation, preprocessor, settings.eval_samples, "eval")
                  if request.evaluation is not None else
                  random_stage_data(preprocessor, min(settings.eval_samples,
                                                      settings.random_samples), rng))
    checkpoint = Checkpoint(request.source)
    with tempfile.TemporaryDirectory(prefix="tiered-build-") as work_name:
        work = Path(work_name)
        fp32 = work / "fp32" / install.MODEL_FILE
        artifact = work / "version" / install.MODEL_FILE
        artifact.parent.mkdir()
        _export(checkpoint, fp32)
        export_error = check_export(checkpoint, fp32, evaluation.pixels[:EVAL_BATCH])
        calibration = None
        calibrator: dict[str, Any] = {}
        if settings.precision == names.Precision.INT8:
            calibration = (load_stage_data(request.calibration, preprocessor,
                                           settings.calibration_samples, "calibration")
                           if request.calibration is not None else
                           StageData(evaluation.pixels[:settings.calibration_samples], None,
                                     f"eval ({evaluation.origin})"))
            calibrator = quantize.quantize_int8(
                fp32, artifact, [{INPUT: calibration.pixels[start:start + CALIBRATION_BATCH]}
                                 for start in range(0, len(calibration.pixels),
                                                    CALIBRATION_BATCH)],
                method=settings.calibration_method, per_channel=settings.per_channel,
                work_dir=work)
        else:
            pipeline.convert(fp32, artifact, settings)
        reference = open_engine(names.Backend.ONNXRUNTIME, fp32, dict(profile.onnxruntime),
                                f"{profile.tier} profile onnxruntime")
        built: Engine | None = None
        try:
            built = open_engine(settings.backend, artifact, engine_settings,
                                f"{profile.tier} profile {settings.backend} + build.engine")
            pipeline.check_same_interface(reference, built)
            ref_tokens = run_stage(reference, evaluation.pixels)
            built_tokens = run_stage(built, evaluation.pixels)
            timed = samples.Samples({INPUT: evaluation.pixels}, None, evaluation.origin)
            latency = pipeline.measure_latency(reference, built, timed,
                                               list(settings.latency_batch_sizes),
                                               settings.latency_runs, settings.latency_budget_s,
                                               clock)
            engine_facts = {**built.describe(), "device": built.device}
        finally:
            # Closed before the decoder answers: ONNX Runtime's idle threads
            # spin for a while and would take the CPU from torch.
            reference.close()
            if built is not None:
                built.close()
        agreement = gate.compare_visual_tokens(ref_tokens, built_tokens)
        candidate, kept = kept_tokens(built_tokens, gate_settings.selection)
        answers = None if evaluation.questions is None else answer_match(
            checkpoint, ref_tokens, candidate, evaluation.questions,
            gate_settings.max_new_tokens)
        decision = gate.judge_visual(
            agreement, answers, min_cosine_mean=gate_settings.min_cosine_mean,
            min_cosine_p1=gate_settings.min_cosine_p1,
            max_relative_l2=gate_settings.max_relative_l2,
            min_answer_match=gate_settings.min_answer_match,
            min_images=gate_settings.min_eval_images,
            allow_accuracy_drop=request.allow_accuracy_drop, kept=kept)
        record = compose_report(request, profile.tier, settings, gate_settings, shape,
                                engine_settings, fp32, artifact, engine_facts, evaluation,
                                calibration, calibrator, export_error, agreement, answers,
                                decision, latency, now, kept)
        installed = None
        if decision.accepted:
            if verdict is not None:
                target = request.repository / request.model / str(request.version)
                record["verdict"] = dict(verdict(decision, target))
            report.write_report(artifact.parent, record)
            config = stage_config(shape, install.new_config(settings, engine_settings, profile,
                                                            None))
            installed = install.install_version(artifact.parent, request.repository,
                                                request.model, request.version, config,
                                                force=request.force)
    return report.BuildOutcome(record, decision, installed)


def kept_tokens(tokens: np.ndarray, selection: TokenSelection
                ) -> tuple[Sequence[np.ndarray], gate.TokensKept | None]:
    """The tokens [images, n, hidden] a stage with `selection` gives the
    decoder (each image's kept rows), and what it kept; as they are, and
    None, without pruning or a cap."""
    if not selection.active:
        return tokens, None
    kept = select(tokens, selection)
    return kept, gate.TokensKept.of(selection.describe(), tokens.shape[1],
                                    [len(rows) for rows in kept])


def answer_match(checkpoint: Checkpoint, reference_tokens: Sequence[np.ndarray],
                 candidate_tokens: Sequence[np.ndarray], questions: Sequence[str],
                 max_new_tokens: int) -> gate.AnswerMatch:
    """The checkpoint's FP32 greedy answers to `questions` (one an image) from
    the candidate stage's visual tokens (each image's; a pruned stage's keep
    fewer) against those from the reference's, and the candidate's top-1
    teacher-forced on the reference's answers."""
    reference = checkpoint.answers(reference_tokens, questions, max_new_tokens)
    return gate.compare_answers(
        reference, checkpoint.answers(candidate_tokens, questions, max_new_tokens),
        max_new_tokens, checkpoint.forced_top1(candidate_tokens, questions, reference))


def run_stage(engine: Engine, pixels: np.ndarray) -> np.ndarray:
    """The stage's visual tokens for every image, EVAL_BATCH a run."""
    return np.concatenate([engine.run({INPUT: pixels[start:start + EVAL_BATCH]}, [OUTPUT])[OUTPUT]
                           for start in range(0, len(pixels), EVAL_BATCH)], axis=0)


def _preflight(request: spec.BuildRequest, settings: spec.BuildSettings
               ) -> tuple[VisionStageShape, Preprocessor]:
    """Everything that can refuse the build before the export runs."""
    if not is_vision_language(request.source):
        raise ConfigError(f"artifact: {request.source} is not a vision-language checkpoint "
                          "(a directory whose config.json says model_type: llava)")
    if settings.backend != names.Backend.ONNXRUNTIME:
        raise ConfigError(f"backend: the vision stage is built for onnxruntime (the torch "
                          f"engine's ONNX reader lacks its operators), got {settings.backend!r}; "
                          "set build.vision.backend or pass --backend onnxruntime")
    install.check_destination(request)
    config_path = request.repository / request.model / install.CONFIG_FILE
    if config_path.is_file():
        served = read_yaml(config_path).get("backend")
        if served not in (None, settings.backend):
            raise ConfigError(f"backend: {config_path} serves this model on {served!r}, the "
                              f"build makes a {settings.backend!r} version; give the model "
                              "another name")
    return read_shape(request.source), read_preprocessor(request.source)


def compose_report(
    request: spec.BuildRequest, tier: str, settings: spec.BuildSettings,
    gate_settings: spec.VisionBuildSettings, shape: VisionStageShape,
    engine_settings: Mapping[str, Any], fp32: Path, artifact: Path,
    engine_facts: Mapping[str, str],
    evaluation: StageData, calibration: StageData | None, calibrator: Mapping[str, Any],
    export_error: float, agreement: gate.VisualAgreement, answers: gate.AnswerMatch | None,
    decision: gate.GateDecision, latency: Mapping[str, Sequence[gate.LatencySummary]],
    now: datetime.datetime, kept: gate.TokensKept | None = None,
) -> dict[str, Any]:
    """build.json of a vision stage, whatever the gate decided; the keys of the
    other builds' reports where they mean the same."""
    fp32_bytes, artifact_bytes = fp32.stat().st_size, artifact.stat().st_size
    notes = []
    if evaluation.origin == "random":
        notes.append("eval on random-pixel images without questions: token agreement only; "
                     "pass --eval with images and questions for a meaningful gate")
    if calibration is not None and calibration.origin.startswith("eval"):
        notes.append("INT8 ranges calibrated on the eval images (no --calibration given)")
    if kept is not None:
        notes.append("answers judged on the visual tokens pruning and the cap keep; the stage "
                     "installed alone (a predictive model) answers every token: they apply "
                     "where generation.vision serves it (a whole vision-language build)")
    if settings.precision == names.Precision.FP16 and engine_facts.get("device") == "cpu":
        notes.append("FP16 measured on CPU: ONNX Runtime runs FP16 nodes it lacks CPU kernels "
                     "for through inserted casts, so this latency says nothing of GPU FP16")
    return {
        "model": request.model, "version": request.version, "tier": tier,
        "backend": settings.backend, "precision": settings.precision,
        "kind": "vision-stage",
        "source": {"path": str(request.source), "kind": "vision-language checkpoint",
                   "sha256": sha256_tree(request.source)},
        "stage": {"name": VISION_STAGE, "input": INPUT, "output": OUTPUT,
                  "pixel_shape": list(shape.pixel_shape), "n_visual": shape.n_visual,
                  "text_hidden": shape.text_hidden,
                  "image_token_index": shape.image_token_index,
                  "vision_feature_layer": (list(shape.vision_feature_layer)
                                           if isinstance(shape.vision_feature_layer, tuple)
                                           else shape.vision_feature_layer),
                  "vision_feature_select_strategy": shape.strategy,
                  "export": {"opset": OPSET, "sha256": sha256_file(fp32),
                             "size_bytes": fp32_bytes,
                             "max_error_vs_transformers": export_error,
                             "what": "largest |ONNX - transformers get_image_features| over "
                                     "the first eval images, relative to the tokens' largest "
                                     "magnitude"}},
        "artifact": {"file": install.MODEL_FILE, "sha256": sha256_file(artifact),
                     "size_bytes": artifact_bytes,
                     "size_vs_source": round(artifact_bytes / fp32_bytes, 4)},
        "calibration": None if calibration is None else {
            **calibrator, "samples": int(calibration.pixels.shape[0]),
            "data": calibration.origin, "per_channel": settings.per_channel, "format": "QDQ",
            "activations": "int8", "weights": "int8"},
        "eval": {"data": evaluation.origin, "images": int(evaluation.pixels.shape[0]),
                 "questions": 0 if evaluation.questions is None else len(evaluation.questions)},
        "accuracy": report.finite({**asdict(agreement),
                                   "answer_match": None if answers is None else answers.match,
                                   "answers": None if answers is None else asdict(answers)}),
        "visual_tokens": None if kept is None else asdict(kept),
        "gate": {"verdict": decision.verdict, "accepted": decision.accepted,
                 "reason": decision.reason,
                 "method": "visual tokens of the build against the FP32 export on the same "
                           "images (per-token cosine, relative L2); answers of the checkpoint's "
                           "FP32 decoder (transformers, greedy) fed either stage's tokens",
                 **asdict(gate_settings),
                 "allow_accuracy_drop": request.allow_accuracy_drop},
        "latency": {name: [report.finite(asdict(s)) for s in rows]
                    for name, rows in latency.items()},
        "engine": {**engine_facts,
                   "settings": report.finite(dict(engine_settings))},
        "versions": report.library_versions(),
        "created": now.isoformat(),
        "notes": notes,
    }
