"""What a tier build makes and how: the request (which artifact, where to) and
the settings (precision, calibration, gate thresholds) chosen from the tier
profile's `build:` mapping with command-line flags over it.

Pure data and validation; nothing here reads files or runs engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered import names
from tiered.engines import quantize
from tiered.engines.build.chain import EnsembleChain
from tiered.engines.visual_tokens import Pruning, TokenSelection
from tiered.errors import ConfigError
from tiered.profiles import TierProfile
from tiered.settings import load_dataclass

# What each backend can be built as. ONNX Runtime versions carry their
# precision in the file; torch takes FP32 ONNX and converts at load.
PRECISIONS: dict[names.Backend, tuple[names.Precision, ...]] = {
    names.Backend.ONNXRUNTIME: (names.Precision.INT8, names.Precision.FP16, names.Precision.FP32),
    names.Backend.TORCH: (names.Precision.FP32, names.Precision.FP16, names.Precision.BF16,
                          names.Precision.FP8),
}


@dataclass(frozen=True)
class BuildSettings:
    """How a tier builds a version (profile `build:` mapping, overridden by flags)."""

    backend: str = "onnxruntime"
    precision: str = "fp32"
    calibration_method: str = "minmax"  # one of quantize.CALIBRATION_METHODS (INT8 only)
    calibration_samples: int = 256  # at most this many calibration samples are used
    per_channel: bool = True  # INT8 weight scales per output channel
    eval_samples: int = 2000  # at most this many eval samples are compared
    random_samples: int = 256  # eval/calibration samples drawn when no data is given
    min_eval_samples: int = 100  # fewer compared samples make the gate inconclusive
    min_agreement: float = 0.99  # top-1 agreement with FP32 the gate asks for
    max_accuracy_drop: float | None = None  # also gate on labelled accuracy (points / 100)
    latency_batch_sizes: tuple[int, ...] = (1, 32)
    latency_runs: int = 20  # timed runs per batch size at most, after two warm-up runs
    # Timing a batch size stops early once this much time has passed and
    # LATENCY_MIN_RUNS runs are in: a heavy model's 20 runs at batch 32 took
    # 3.7 s of a 9.3 s build on a CPU.
    latency_budget_s: float = 1.0
    max_batch_size: int = 32  # written into a config.yaml the build creates
    max_queue_delay_us: int | None = None  # likewise; None: the tier profile's
    engine: Mapping[str, Any] = field(default_factory=dict)  # over the profile's backend settings
    seed: int = 0  # for random data
    # How a checkpoint artifact is built (GenerativeBuildSettings' keys);
    # choose_generative_settings reads it, the ONNX build does not.
    generative: Mapping[str, Any] = field(default_factory=dict)
    # How a vision-language checkpoint's vision stage is built and judged
    # (VisionBuildSettings' keys); choose_vision_settings reads it.
    vision: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in PRECISIONS:
            raise ConfigError(f"backend: {self.backend!r} is not one of {', '.join(PRECISIONS)}")
        if self.precision not in PRECISIONS[self.backend]:
            raise ConfigError(
                f"precision: {self.precision!r} cannot be built for backend {self.backend} "
                f"(one of {', '.join(PRECISIONS[self.backend])})"
            )
        if self.calibration_method not in quantize.CALIBRATION_METHODS:
            raise ConfigError(
                f"calibration_method: {self.calibration_method!r} is not one of "
                f"{', '.join(quantize.CALIBRATION_METHODS)}"
            )
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ConfigError(f"min_agreement: must be within 0..1, got {self.min_agreement}")
        if self.max_accuracy_drop is not None and not 0.0 <= self.max_accuracy_drop <= 1.0:
            raise ConfigError(
                f"max_accuracy_drop: must be within 0..1, got {self.max_accuracy_drop}"
            )
        for name in ("calibration_samples", "eval_samples", "random_samples",
                     "min_eval_samples", "latency_runs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.latency_budget_s <= 0:
            raise ConfigError(f"latency_budget_s: must be > 0, got {self.latency_budget_s}")
        if self.max_batch_size < 0:
            raise ConfigError(f"max_batch_size: must be >= 0, got {self.max_batch_size}")
        if self.max_queue_delay_us is not None and self.max_queue_delay_us < 0:
            raise ConfigError(f"max_queue_delay_us: must be >= 0, got {self.max_queue_delay_us}")
        if not self.latency_batch_sizes or any(b < 1 for b in self.latency_batch_sizes):
            raise ConfigError("latency_batch_sizes: give one or more sizes >= 1")


def choose_settings(
    profile: TierProfile, overrides: Mapping[str, Any], where: str = "build"
) -> BuildSettings:
    """The profile's `build:` mapping with the flags that were given laid over it.

    `overrides` holds BuildSettings keys; None means "flag not given".
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    return load_dataclass(BuildSettings, {**profile.build, **given}, where)


# Generative backends (tiered.engines.generative) and what each builds.
# onnxruntime-genai: its model builder's precisions; torch-generative: the
# checkpoint itself, run by our torch engine in this precision.
GENERATIVE_PRECISIONS: dict[str, tuple[str, ...]] = {
    "onnxruntime-genai": ("int4", "fp16", "fp32"),
    "torch-generative": ("fp32", "fp16", "bf16", "fp8"),
}


@dataclass(frozen=True)
class GenerativeBuildSettings:
    """How a tier builds a version of a checkpoint (profile `build.generative`,
    flags over it), and the accuracy gate it must pass.

    The gate generates greedily from each eval prompt with the FP32 reference
    and with the build. first-N match: the share of prompts whose first
    `first_tokens` generated tokens (fewer where the reference ends sooner)
    equal the reference's exactly. Token agreement: teacher-forced on the
    reference's tokens, the share of positions where the build's top-1 is the
    reference's token, over every generated position of every prompt.
    """

    backend: str = "onnxruntime-genai"
    precision: str = "int4"
    # Where the precision's device is absent (fp16 asks for CUDA): build this
    # for the CPU instead and say so; None refuses the build.
    cpu_precision: str | None = None
    max_new_tokens: int = 16  # greedy tokens generated per eval prompt
    first_tokens: int = 8  # N of the first-N exact match
    min_first_tokens_match: float = 0.9
    min_token_agreement: float = 0.98
    min_eval_prompts: int = 8  # fewer make the gate inconclusive, never a pass
    engine: Mapping[str, Any] = field(default_factory=dict)  # the built engine's settings

    def __post_init__(self) -> None:
        if self.backend not in GENERATIVE_PRECISIONS:
            raise ConfigError(f"backend: {self.backend!r} is not one of "
                              f"{', '.join(GENERATIVE_PRECISIONS)} (a checkpoint's backends)")
        allowed = GENERATIVE_PRECISIONS[self.backend]
        for name in ("precision", "cpu_precision"):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ConfigError(f"{name}: {value!r} cannot be built for backend "
                                  f"{self.backend} (one of {', '.join(allowed)})")
        for name in ("min_first_tokens_match", "min_token_agreement"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}: must be within 0..1, got {getattr(self, name)}")
        for name in ("max_new_tokens", "first_tokens", "min_eval_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.first_tokens > self.max_new_tokens:
            raise ConfigError(f"first_tokens: {self.first_tokens} is more than max_new_tokens "
                              f"{self.max_new_tokens}")


def choose_generative_settings(
    profile: TierProfile, overrides: Mapping[str, Any], where: str = "build.generative"
) -> GenerativeBuildSettings:
    """The profile's `build.generative` mapping with the flags given laid over it
    (None: flag not given)."""
    given = {key: value for key, value in overrides.items() if value is not None}
    return load_dataclass(GenerativeBuildSettings,
                          {**profile.build.get("generative", {}), **given}, where)


@dataclass(frozen=True)
class VisionBuildSettings:
    """How a tier builds the vision stage of a vision-language checkpoint
    (profile `build.vision`), and the gate it must pass.

    The stage's visual tokens, built against the FP32 export on the same
    images: each token's cosine similarity with its FP32 twin (the mean over
    every token of every image, and the 1st percentile, so that a few ruined
    tokens fail a build whose mean looks fine), and the relative L2 error
    ||built - fp32|| / ||fp32|| over all of them. Where the eval data has
    questions, answer match too: the share of images whose greedy answer
    (the checkpoint's FP32 decoder fed the built stage's tokens) equals the
    answer fed the FP32 stage's tokens, token for token.

    `prune` and `max_visual_tokens` (off by default; engines/visual_tokens.py
    defines them) make the build keep only some of each image's visual
    tokens: the answer match is then measured with the built stage's kept
    tokens alone (the FP32 reference keeps all), the mean kept is reported,
    and a version the gate accepts serves them (config.yaml's
    `generation.vision`). Without questions in the eval data they cannot be
    judged: the gate is inconclusive.
    """

    # The vision stage's backend and precision where they differ from the
    # tier's `build:` (None: the tier's).
    backend: str | None = None
    precision: str | None = None
    min_cosine_mean: float = 0.99
    min_cosine_p1: float = 0.95
    max_relative_l2: float = 0.15
    min_answer_match: float = 0.9
    min_eval_images: int = 8  # fewer make the gate inconclusive, never a pass
    max_new_tokens: int = 8  # greedy answer tokens per question
    max_visual_tokens: int | None = None  # kept an image, after pruning (None: all)
    prune: Pruning | None = None  # None: no pruning

    @property
    def selection(self) -> TokenSelection:
        return TokenSelection(self.max_visual_tokens, self.prune)

    def __post_init__(self) -> None:
        self.selection  # noqa: B018 (its checks name the field)
        for name in ("min_cosine_mean", "min_cosine_p1", "min_answer_match"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}: must be within 0..1, got {getattr(self, name)}")
        if self.max_relative_l2 < 0:
            raise ConfigError(f"max_relative_l2: must be >= 0, got {self.max_relative_l2}")
        for name in ("min_eval_images", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")


def choose_vision_settings(
    profile: TierProfile, overrides: Mapping[str, Any], where: str = "build"
) -> BuildSettings:
    """The tier's `build:` for a vision stage: its `vision` mapping's backend
    and precision over the tier's, the flags given over both (None: not
    given). The result's `vision` holds the gate's settings; `overrides` may
    hold a `vision` mapping of flags laid over the profile's."""
    given = {key: value for key, value in overrides.items()
             if value is not None and key != "vision"}
    vision = {**profile.build.get("vision", {}),
              **{k: v for k, v in (overrides.get("vision") or {}).items() if v is not None}}
    chosen = load_dataclass(VisionBuildSettings, vision, f"{where}.vision")
    stage = {key: getattr(chosen, key) for key in ("backend", "precision")
             if getattr(chosen, key) is not None}
    return load_dataclass(BuildSettings, {**profile.build, **stage, **given, "vision": vision},
                          where)


@dataclass(frozen=True)
class BuildRequest:
    source: Path  # the FP32 ONNX artifact, a checkpoint directory, or an ensemble's repository
    repository: Path
    model: str
    version: int
    calibration: Path | None = None  # npz; random inputs when absent
    evaluation: Path | None = None  # npz, maybe with labels; random inputs when absent
    # (a checkpoint's: a JSON object {"prompts": [...]}, required)
    force: bool = False  # replace an existing version
    allow_accuracy_drop: bool = False  # write a version the gate rejects
    # Set when `source` is a repository holding the ensemble `model` and its
    # step models (chain.py); the caller reads its config with the agent's parser.
    ensemble: EnsembleChain | None = None
    # Which stage of a vision-language checkpoint (`source` a LLaVA-style
    # directory) is built: "vision" or "decoder"; None for any other source.
    stage: str | None = None
