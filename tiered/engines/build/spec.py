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
    latency_runs: int = 20  # timed runs per batch size, after two warm-up runs
    max_batch_size: int = 32  # written into a config.yaml the build creates
    max_queue_delay_us: int | None = None  # likewise; None: the tier profile's
    engine: Mapping[str, Any] = field(default_factory=dict)  # over the profile's backend settings
    seed: int = 0  # for random data

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


@dataclass(frozen=True)
class BuildRequest:
    source: Path  # the FP32 ONNX artifact
    repository: Path
    model: str
    version: int
    calibration: Path | None = None  # npz; random inputs when absent
    evaluation: Path | None = None  # npz, maybe with labels; random inputs when absent
    force: bool = False  # replace an existing version
    allow_accuracy_drop: bool = False  # write a version the gate rejects
