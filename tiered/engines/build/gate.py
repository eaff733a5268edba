"""The accuracy gate and the measurements it and the report rest on: how a
build's outputs compare with the FP32 artifact's, the verdict over those
numbers, and summaries of timed runs.

All pure: arrays and numbers in, frozen values out. Missing evidence (too
few samples, no top-1 to compare) is inconclusive, never a pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiered.errors import ConfigError, EngineError


@dataclass(frozen=True)
class Agreement:
    """How a build's output compares with the FP32 artifact's on the same inputs."""

    output: str
    samples: int
    top1_agreement: float | None  # None where an output has one value per sample
    max_abs_error: float
    mean_abs_error: float
    nonfinite: int  # NaN/inf values in the build's output
    reference_accuracy: float | None = None  # with labels only
    build_accuracy: float | None = None

    @property
    def accuracy_drop(self) -> float | None:
        if self.reference_accuracy is None or self.build_accuracy is None:
            return None
        return self.reference_accuracy - self.build_accuracy


def compare_outputs(
    output: str,
    reference: np.ndarray,
    candidate: np.ndarray,
    labels: np.ndarray | None = None,
) -> Agreement:
    """Top-1 agreement, absolute errors and (with labels) accuracy of both.

    Samples run along axis 0; top-1 is the argmax over each sample's values.
    """
    if reference.shape != candidate.shape:
        raise EngineError(
            f"output {output!r}: the build answers shape {list(candidate.shape)}, "
            f"the FP32 artifact {list(reference.shape)}"
        )
    samples = reference.shape[0] if reference.ndim else 1
    ref = reference.reshape(samples, -1).astype(np.float64)
    got = candidate.reshape(samples, -1).astype(np.float64)
    finite = np.isfinite(got)
    error = np.abs(ref - got)[finite]
    top1 = None
    build_accuracy = reference_accuracy = None
    if ref.shape[1] > 1 and samples:
        ref_top = ref.argmax(axis=1)
        got_top = np.where(finite, got, -np.inf).argmax(axis=1)
        top1 = float(np.mean(ref_top == got_top))
        if labels is not None:
            labels = np.asarray(labels).reshape(-1)
            if labels.shape[0] != samples:
                raise ConfigError(f"labels: {labels.shape[0]} labels for {samples} eval samples")
            reference_accuracy = float(np.mean(ref_top == labels))
            build_accuracy = float(np.mean(got_top == labels))
    return Agreement(
        output=output,
        samples=int(samples),
        top1_agreement=top1,
        max_abs_error=float(error.max()) if error.size else 0.0,
        mean_abs_error=float(error.mean()) if error.size else 0.0,
        nonfinite=int(finite.size - finite.sum()),
        reference_accuracy=reference_accuracy,
        build_accuracy=build_accuracy,
    )


@dataclass(frozen=True)
class GateDecision:
    """The accuracy gate's verdict and the numbers it used.

    verdict: "pass", "fail" or "inconclusive" (too few samples, or no top-1 to
    compare: never a pass). `accepted` is whether the version may be written:
    a pass, or anything the user let through with --allow-accuracy-drop.
    """

    verdict: str
    accepted: bool
    reason: str


def judge(
    agreement: Agreement,
    *,
    min_agreement: float,
    min_samples: int,
    max_accuracy_drop: float | None = None,
    allow_accuracy_drop: bool = False,
) -> GateDecision:
    a = agreement
    numbers = (
        f"top-1 agreement {_fmt(a.top1_agreement)} (threshold {min_agreement:.4f}) over "
        f"{a.samples} samples of {a.output!r}; max abs error {a.max_abs_error:.4g}, "
        f"mean {a.mean_abs_error:.4g}"
    )
    if a.accuracy_drop is not None:
        numbers += (f"; accuracy FP32 {a.reference_accuracy:.4f}, build {a.build_accuracy:.4f}"
                    f" (drop {a.accuracy_drop:+.4f})")
    if a.samples < min_samples:
        verdict, why = "inconclusive", f"only {a.samples} samples (the gate needs {min_samples})"
    elif a.top1_agreement is None:
        verdict, why = "inconclusive", "the output has one value per sample, so no top-1 to compare"
    elif a.nonfinite:
        verdict, why = "fail", f"{a.nonfinite} NaN/inf values in the build's output"
    elif a.top1_agreement < min_agreement:
        verdict, why = "fail", "top-1 agreement below the threshold"
    elif (max_accuracy_drop is not None and a.accuracy_drop is not None
          and a.accuracy_drop > max_accuracy_drop):
        verdict, why = "fail", f"accuracy drops more than {max_accuracy_drop:.4f}"
    else:
        verdict, why = "pass", "within the threshold"
    accepted = verdict == "pass" or allow_accuracy_drop
    if verdict != "pass" and allow_accuracy_drop:
        why += "; accepted anyway (--allow-accuracy-drop)"
    return GateDecision(verdict, accepted, f"{verdict}: {why}: {numbers}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


@dataclass(frozen=True)
class LatencySummary:
    """Wall time of `engine.run` for one batch size, in milliseconds."""

    batch_size: int
    runs: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    items_per_s: float  # batch_size / mean: sustained rate, outliers included


def summarize_latency(batch_size: int, seconds: Sequence[float]) -> LatencySummary:
    """Nearest-rank percentiles of the timed runs."""
    if not seconds:
        raise ValueError("summarize_latency: no timed runs")
    ordered = sorted(seconds)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3

    mean = sum(ordered) / len(ordered)
    return LatencySummary(
        batch_size=batch_size,
        runs=len(ordered),
        mean_ms=mean * 1e3,
        p50_ms=rank(0.50),
        p90_ms=rank(0.90),
        min_ms=ordered[0] * 1e3,
        max_ms=ordered[-1] * 1e3,
        items_per_s=batch_size / mean if mean > 0 else math.inf,
    )
