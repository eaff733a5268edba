"""Canary vs stable, per metric: the statistics a rollout stage is judged by.

Each metric is judged per tier (agreement over all tiers), ends Successful,
Failed, Inconclusive or Error and carries every number it was decided from;
a run's verdict is the worst of them (Failed > Error > Inconclusive >
Successful). Missing data, or fewer samples than the spec's minimum, is
Inconclusive: never a pass.

- latency_p95: one-sided Mann-Whitney U of canary/max_ratio against stable
  (the effect-size margin: the canary regresses only if it is slower than
  stable by more than max_ratio), plus an absolute bound on the canary's p95
  judged by a distribution-free lower confidence bound of that quantile.
- error_rate: one-sided two-proportion z-test (Agresti-Caffo adjusted) of
  canary against max_ratio x stable, plus an absolute bound judged by the
  Wilson lower bound of the canary's rate.
- energy_per_inference: Mann-Whitney U on per-window J/inference samples,
  with the max_ratio margin.
- agreement: the Wilson lower bound of the shadow agreement rate must reach
  the minimum (Failed when even the upper bound is below it).

Relative tests fail on evidence of regression and otherwise pass; absolute
bounds fail on evidence and are Inconclusive when only the point estimate
crosses them. Pure: numbers in, a frozen AnalysisRun out; no I/O, no clock.
The normal approximation of U is used at every sample size (see the tests
for how it compares with the exact distribution's use in scipy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from tiered.rollout.spec import (
    AgreementBound,
    AnalysisRun,
    AnalysisSpec,
    EnergyBound,
    ErrorRateBound,
    LatencyBound,
    MetricResult,
)

SUCCESSFUL, FAILED, INCONCLUSIVE, ERROR = "Successful", "Failed", "Inconclusive", "Error"
_SEVERITY = {SUCCESSFUL: 0, INCONCLUSIVE: 1, ERROR: 2, FAILED: 3}
_NORMAL = NormalDist()


def worst(outcomes: Sequence[str]) -> str:
    """The run's verdict: Failed > Error > Inconclusive > Successful."""
    return max(outcomes, key=_SEVERITY.__getitem__, default=INCONCLUSIVE)


# --- measurements -----------------------------------------------------------


@dataclass(frozen=True)
class VersionSamples:
    """What one version (stable or canary) did over the analysis window."""

    latencies_ms: Sequence[float] = ()  # raw per-request samples (a bounded reservoir)
    requests: int = 0
    errors: int = 0
    joules_per_inference: Sequence[float] = ()  # one per telemetry window


@dataclass(frozen=True)
class TierSamples:
    """Stable and canary on one tier."""

    stable: VersionSamples = VersionSamples()
    canary: VersionSamples = VersionSamples()

    @property
    def served(self) -> bool:
        return self.stable.requests > 0 or self.canary.requests > 0


@dataclass(frozen=True)
class Measurements:
    """Canary and stable over the current stage, per tier the stage sends canary
    traffic to, as the adapter collected them.

    `window` numbers the analyses: the same window judged twice counts once
    toward the consecutive-failure limit. `stage` is the stage index the
    samples belong to; samples of another stage are never judged.
    """

    window: int
    stage: int
    tiers: Mapping[str, TierSamples]
    shadow_compared: int = 0  # shadowed requests whose outputs were compared, every tier
    shadow_agreed: int = 0

    def pooled(self, version: str) -> VersionSamples:
        """One version ("stable" or "canary") over every tier, for headline figures."""
        parts = [getattr(samples, version) for samples in self.tiers.values()]
        return VersionSamples(
            latencies_ms=tuple(v for p in parts for v in p.latencies_ms),
            requests=sum(p.requests for p in parts),
            errors=sum(p.errors for p in parts),
            joules_per_inference=tuple(v for p in parts for v in p.joules_per_inference))


# --- statistics -------------------------------------------------------------


@dataclass(frozen=True)
class MannWhitney:
    """One-sided test that x tends to be larger than y."""

    u: float  # U of x: pairs (x_i, y_j) with x_i > y_j, ties counted half
    z: float
    p_value: float
    n_x: int
    n_y: int


def average_ranks(values: np.ndarray) -> tuple[np.ndarray, float]:
    """Ranks 1..n with ties sharing their average rank, and sum(t^3 - t) over tie groups."""
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    n = len(values)
    # Start of each run of equal values, and one past the end of the last.
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1], True])
    counts = np.diff(starts)
    average = starts[:-1] + (counts + 1) / 2.0  # 1-based average rank of each run
    ranks = np.empty(n)
    ranks[order] = np.repeat(average, counts)
    tie_term = float(np.sum(counts.astype(float) ** 3 - counts))
    return ranks, tie_term


def mann_whitney_greater(x: Sequence[float], y: Sequence[float],
                         continuity: bool = True) -> MannWhitney:
    """Mann-Whitney U, alternative "x is stochastically greater than y": the
    normal approximation with tie correction (and, by default, the 0.5
    continuity correction, as scipy's asymptotic method does)."""
    a = np.asarray(x, dtype=float)
    b = np.asarray(y, dtype=float)
    n_x, n_y = len(a), len(b)
    if n_x == 0 or n_y == 0:
        raise ValueError("mann_whitney_greater: both samples need at least one value")
    ranks, tie_term = average_ranks(np.concatenate([a, b]))
    n = n_x + n_y
    u = float(ranks[:n_x].sum() - n_x * (n_x + 1) / 2.0)
    mean = n_x * n_y / 2.0
    variance = n_x * n_y / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0:  # every value equal: no evidence either way
        return MannWhitney(u, 0.0, 0.5, n_x, n_y)
    z = (u - mean - (0.5 if continuity else 0.0)) / math.sqrt(variance)
    return MannWhitney(u, z, _NORMAL.cdf(-z), n_x, n_y)


def wilson_interval(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """One-sided Wilson bounds: (lower, upper), each holding with `confidence`."""
    if trials <= 0:
        return 0.0, 1.0
    z = _NORMAL.inv_cdf(confidence)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def quantile_lower_bound(values: np.ndarray, q: float, confidence: float) -> float:
    """A distribution-free lower confidence bound of the q-quantile: the order
    statistic X_(k) with P(Binomial(n, q) >= k) >= confidence (normal approx)."""
    ordered = np.sort(values)
    n = len(ordered)
    z = _NORMAL.inv_cdf(confidence)
    k = math.floor(n * q - z * math.sqrt(n * q * (1 - q)))  # 1-based
    return float(ordered[max(k, 1) - 1])


def two_proportion_greater(x1: int, n1: int, x2: int, n2: int,
                           ratio: float) -> tuple[float, float]:
    """z and one-sided p for "p1 > ratio * p2", Agresti-Caffo adjusted (one
    success and one failure added to each sample) so that zero counts work."""
    p1 = (x1 + 1) / (n1 + 2)
    p2 = (x2 + 1) / (n2 + 2)
    difference = p1 - ratio * p2
    sd = math.sqrt(p1 * (1 - p1) / (n1 + 2) + ratio * ratio * p2 * (1 - p2) / (n2 + 2))
    z = difference / sd
    return z, _NORMAL.cdf(-z)


# --- metrics ----------------------------------------------------------------


def _finite_nonnegative(values: Sequence[float]) -> np.ndarray | None:
    array = np.asarray(values, dtype=float).ravel()
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        return None
    return array


def judge_latency(bound: LatencyBound, stable: Sequence[float], canary: Sequence[float],
                  confidence: float, min_samples: int) -> MetricResult:
    name = "latency_p95"
    s, c = _finite_nonnegative(stable), _finite_nonnegative(canary)
    if s is None or c is None:
        return MetricResult(name, ERROR, "latency samples hold a negative or non-finite value",
                            {"n_stable": len(stable), "n_canary": len(canary)})
    numbers = {"n_stable": float(len(s)), "n_canary": float(len(c)),
               "min_samples": float(min_samples), "max_ratio": bound.max_ratio,
               "confidence": confidence}
    if len(s) < min_samples or len(c) < min_samples:
        return MetricResult(name, INCONCLUSIVE, f"too few samples: canary {len(c)}, stable "
                            f"{len(s)}, need {min_samples} each", numbers)
    alpha = 1 - confidence
    test = mann_whitney_greater(c / bound.max_ratio, s)
    p95_s, p95_c = float(np.quantile(s, 0.95)), float(np.quantile(c, 0.95))
    numbers.update(
        median_stable_ms=float(np.median(s)), median_canary_ms=float(np.median(c)),
        p95_stable_ms=p95_s, p95_canary_ms=p95_c,
        p95_ratio=p95_c / p95_s if p95_s > 0 else math.inf,
        u=test.u, z=test.z, p_value=test.p_value, alpha=alpha)
    outcomes, reasons = [], []
    if test.p_value < alpha:
        outcomes.append(FAILED)
        reasons.append(f"canary slower than {bound.max_ratio:g}x stable (Mann-Whitney "
                       f"p={test.p_value:.3g} < {alpha:.3g}; p95 {p95_c:.3g} vs {p95_s:.3g} ms)")
    else:
        outcomes.append(SUCCESSFUL)
        reasons.append(f"no regression beyond {bound.max_ratio:g}x (p={test.p_value:.3g}; "
                       f"p95 {p95_c:.3g} vs {p95_s:.3g} ms)")
    if bound.max_ms is not None:
        lower = quantile_lower_bound(c, 0.95, confidence)
        numbers.update(max_ms=bound.max_ms, p95_canary_lower_bound_ms=lower)
        if lower > bound.max_ms:
            outcomes.append(FAILED)
            reasons.append(f"canary p95 above {bound.max_ms:g} ms (lower bound {lower:.3g} ms)")
        elif p95_c > bound.max_ms:
            outcomes.append(INCONCLUSIVE)
            reasons.append(f"canary p95 {p95_c:.3g} ms is above {bound.max_ms:g} ms "
                           f"but not yet significantly (lower bound {lower:.3g} ms)")
    return _combine(name, outcomes, reasons, numbers)


def judge_error_rate(bound: ErrorRateBound, stable_errors: int, stable_requests: int,
                     canary_errors: int, canary_requests: int, confidence: float,
                     min_samples: int) -> MetricResult:
    name = "error_rate"
    numbers = {"n_stable": float(stable_requests), "n_canary": float(canary_requests),
               "errors_stable": float(stable_errors), "errors_canary": float(canary_errors),
               "min_samples": float(min_samples), "max_ratio": bound.max_ratio,
               "confidence": confidence}
    if not (0 <= stable_errors <= stable_requests and 0 <= canary_errors <= canary_requests):
        return MetricResult(name, ERROR, "error counts are negative or exceed the requests",
                            numbers)
    if stable_requests < min_samples or canary_requests < min_samples:
        return MetricResult(name, INCONCLUSIVE, f"too few requests: canary {canary_requests}, "
                            f"stable {stable_requests}, need {min_samples} each", numbers)
    alpha = 1 - confidence
    rate_s, rate_c = stable_errors / stable_requests, canary_errors / canary_requests
    z, p_value = two_proportion_greater(canary_errors, canary_requests, stable_errors,
                                        stable_requests, bound.max_ratio)
    numbers.update(rate_stable=rate_s, rate_canary=rate_c, z=z, p_value=p_value, alpha=alpha)
    outcomes, reasons = [], []
    if p_value < alpha:
        outcomes.append(FAILED)
        reasons.append(f"canary error rate {rate_c:.3g} above {bound.max_ratio:g}x stable's "
                       f"{rate_s:.3g} (z={z:.3g}, p={p_value:.3g})")
    else:
        outcomes.append(SUCCESSFUL)
        reasons.append(f"error rate {rate_c:.3g} vs {rate_s:.3g} (p={p_value:.3g})")
    if bound.max is not None:
        lower, _ = wilson_interval(canary_errors, canary_requests, confidence)
        numbers.update(max=bound.max, rate_canary_lower_bound=lower)
        if lower > bound.max:
            outcomes.append(FAILED)
            reasons.append(f"canary error rate above {bound.max:g} (lower bound {lower:.3g})")
        elif rate_c > bound.max:
            outcomes.append(INCONCLUSIVE)
            reasons.append(f"canary error rate {rate_c:.3g} above {bound.max:g} but not yet "
                           f"significantly (lower bound {lower:.3g})")
    return _combine(name, outcomes, reasons, numbers)


def judge_energy(bound: EnergyBound, stable: Sequence[float], canary: Sequence[float],
                 confidence: float) -> MetricResult:
    name = "energy_per_inference"
    s, c = _finite_nonnegative(stable), _finite_nonnegative(canary)
    if s is None or c is None:
        return MetricResult(name, ERROR, "J/inference samples hold a negative or non-finite "
                            "value", {"n_stable": len(stable), "n_canary": len(canary)})
    numbers = {"n_stable": float(len(s)), "n_canary": float(len(c)),
               "min_windows": float(bound.min_windows), "max_ratio": bound.max_ratio,
               "confidence": confidence}
    if len(s) < bound.min_windows or len(c) < bound.min_windows:
        return MetricResult(name, INCONCLUSIVE, f"too few J/inference windows: canary {len(c)}, "
                            f"stable {len(s)}, need {bound.min_windows} each", numbers)
    alpha = 1 - confidence
    test = mann_whitney_greater(c / bound.max_ratio, s)
    mean_s, mean_c = float(np.mean(s)), float(np.mean(c))
    numbers.update(mean_stable_j=mean_s, mean_canary_j=mean_c,
                   median_stable_j=float(np.median(s)), median_canary_j=float(np.median(c)),
                   ratio=mean_c / mean_s if mean_s > 0 else math.inf,
                   u=test.u, z=test.z, p_value=test.p_value, alpha=alpha)
    if test.p_value < alpha:
        return MetricResult(name, FAILED, f"canary uses more than {bound.max_ratio:g}x stable's "
                            f"energy ({mean_c:.4g} vs {mean_s:.4g} J/inference, "
                            f"p={test.p_value:.3g})", numbers)
    return MetricResult(name, SUCCESSFUL, f"{mean_c:.4g} vs {mean_s:.4g} J/inference "
                        f"(p={test.p_value:.3g})", numbers)


def judge_agreement(bound: AgreementBound, agreed: int, compared: int, confidence: float,
                    min_samples: int) -> MetricResult:
    name = "agreement"
    numbers = {"compared": float(compared), "agreed": float(agreed), "min": bound.min,
               "min_samples": float(min_samples), "confidence": confidence}
    if not 0 <= agreed <= compared:
        return MetricResult(name, ERROR, "agreed count is negative or exceeds compared", numbers)
    if compared < min_samples:
        return MetricResult(name, INCONCLUSIVE, f"too few shadowed requests: {compared}, need "
                            f"{min_samples}", numbers)
    rate = agreed / compared
    lower, upper = wilson_interval(agreed, compared, confidence)
    numbers.update(rate=rate, lower_bound=lower, upper_bound=upper)
    if lower >= bound.min:
        return MetricResult(name, SUCCESSFUL, f"agreement {rate:.4g} (lower bound {lower:.4g} "
                            f">= {bound.min:g})", numbers)
    if upper < bound.min:
        return MetricResult(name, FAILED, f"agreement {rate:.4g} below {bound.min:g} (upper "
                            f"bound {upper:.4g})", numbers)
    return MetricResult(name, INCONCLUSIVE, f"agreement {rate:.4g}: lower bound {lower:.4g} "
                        f"not yet >= {bound.min:g}", numbers)


def _combine(name: str, outcomes: list[str], reasons: list[str],
             numbers: dict[str, float]) -> MetricResult:
    outcome = worst(outcomes)
    # Lead with the reason that decided the outcome.
    ordered = [r for o, r in zip(outcomes, reasons) if o == outcome] + \
              [r for o, r in zip(outcomes, reasons) if o != outcome]
    return MetricResult(name, outcome, "; ".join(ordered), numbers)


def analyze(spec: AnalysisSpec, measurements: Measurements) -> AnalysisRun:
    """Judge every configured metric of canary vs stable on each tier, and
    agreement over all of them; the worst outcome wins.

    Each tier is judged on its own samples, so a tier's regression is not
    diluted by another tier's traffic and stable is compared on the tier the
    canary ran on. A tier where neither version served a request this stage
    has nothing at stake and is left out (unless no tier served any). The
    per-tier tests share the spec's false-alarm rate (Bonferroni): with k
    tiers each is judged at confidence 1 - (1 - confidence) / k.
    """
    tiers = ({tier: s for tier, s in measurements.tiers.items() if s.served}
             or dict(measurements.tiers) or {None: TierSamples()})
    confidence = 1 - (1 - spec.confidence) / len(tiers)
    metrics: list[MetricResult] = []
    for tier, samples in tiers.items():
        metrics.extend(replace(m, tier=tier)
                       for m in _judge_tier(spec, samples.stable, samples.canary, confidence))
    if spec.agreement is not None:
        metrics.append(judge_agreement(spec.agreement, measurements.shadow_agreed,
                                       measurements.shadow_compared, spec.confidence,
                                       spec.min_samples))
    return AnalysisRun(measurements.window, worst([m.outcome for m in metrics]),
                       tuple(metrics))


def _judge_tier(spec: AnalysisSpec, stable: VersionSamples, canary: VersionSamples,
                confidence: float) -> list[MetricResult]:
    metrics: list[MetricResult] = []
    if spec.latency_p95 is not None:
        metrics.append(judge_latency(spec.latency_p95, stable.latencies_ms, canary.latencies_ms,
                                     confidence, spec.min_samples))
    if spec.error_rate is not None:
        metrics.append(judge_error_rate(spec.error_rate, stable.errors, stable.requests,
                                        canary.errors, canary.requests, confidence,
                                        spec.min_samples))
    if spec.energy_per_inference is not None:
        metrics.append(judge_energy(spec.energy_per_inference, stable.joules_per_inference,
                                    canary.joules_per_inference, confidence))
    return metrics
