"""Canary vs stable, per metric: the sequential tests a rollout stage is judged by.

Each metric is judged per tier (agreement over all tiers), ends Successful,
Failed, Inconclusive or Error and carries every number it was decided from;
a run's verdict is the worst of them (Failed > Error > Inconclusive >
Successful). Missing data, or fewer samples than the spec's minimum, is
Inconclusive: never a pass. A metric shown but not judged (an energy figure
that is not a measurement, below) is NotJudged, which neither holds nor
fails a stage. Reasons give the numbers a test lacks and name spec fields
as the YAML writes them.

The false-rollback budget. `confidence` holds per rollout: a canary with no
regression is rolled back with probability at most alpha = 1 - confidence,
however often it is looked at. alpha is split evenly (a union bound) over
every test the rollout can run (`rollout_tests`): each stage x each tier the
stage sends canary traffic to x each test of a tier, plus one agreement test
per stage. Each test is anytime-valid: its evidence is an e-value E_t, a
nonnegative supermartingale while the canary has no regression, so by
Ville's inequality P(E_t ever reaches 1/a) <= a; the test fails when its
always-valid p-value 1/E_t reaches its share a. A look may come after every
request and the guarantee stands. Nothing crosses looks: E_t is a function
of the stage's cumulative samples, so the same samples give the same verdict
after a controller restart.

- latency_p95, latency_p99 (tail tests, after Howard & Ramdas, "Sequential
  estimation of quantiles", Bernoulli 2022, arXiv 1906.09712): stable's pNN
  gets an anytime upper confidence bound U, an order statistic whose rank the
  binomial mixture sets (a/2). If the canary's pNN is within max_ratio x
  stable's, at most (100 - NN)% of canary requests lie above max_ratio x U;
  the binomial mixture tests the canary's count above it against that share
  (a/2). Distribution-free, ties included; a slower tail is seen with an
  unchanged median. max_ms: the canary's count above max_ms against the same
  share.
- latency_shift (a location test): Mann-Whitney U of canary/max_ratio against
  stable; its z is made anytime-valid by the normal mixture (an asymptotic
  confidence sequence: Waudby-Smith et al., "Time-uniform central limit
  theory and asymptotic confidence sequences", arXiv 2103.06476).
- error_rate: errors are rare, so each version's errors form a Poisson
  stream and each error is the canary's with probability n_c p_c / (n_c p_c +
  n_s p_s); with no regression (p_c <= max_ratio x p_s) that is at most
  theta0 = max_ratio n_c / (max_ratio n_c + n_s). The binomial mixture tests the
  canary's share of the errors against theta0. max: the canary's error count
  against max.
- energy_per_inference: Mann-Whitney on per-window J/inference with the
  max_ratio margin, normal mixture; judged only when both versions' figures
  are measurements of one source (nvml or rapl). A modeled figure (the
  CPU-time model: an estimate) or one of unknown source is reported with its
  comparison, NotJudged, unless allow_modeled; figures of different sources
  (nvml vs model) do not compare and are NotJudged always. Why: on
  a CPU the model makes canary/stable a ratio of CPU time, which the latency
  tests judge already, and a figure that is not energy must not roll back a
  version for its energy.
- agreement: the binomial mixture both ways: Failed on evidence that the
  agreement rate is below min, Successful on evidence that it is above,
  Inconclusive in between.

A generative model (spec kind generative) is judged on the same tests of
other quantities (`METRICS_OF_KIND`; the request-latency and J/inference
metrics are not judged): ttft_p95 and ttft_shift are the tail and shift
tests of each request's time to first token; tpot_p95 the tail test of the
time between two output tokens; energy_per_token the energy test, with its
source rules, of per-window J per output token; error_rate and agreement
(greedy requests whose token ids equal stable's) as above. The controller
draws TPOT samples from each poll's histogram, as many as the poll's
requests: one token a request, on average, so the tokens of one sequence
(not independent of each other) do not count as that many requests' worth
of evidence.

Relative tests and absolute bounds fail on evidence; otherwise a relative
test passes (a stage's min_requests and min_duration_s decide how much data a
pass stands on) and an absolute bound is Inconclusive while its point
estimate is beyond it.

The e-values. Binomial mixture: the likelihood ratio of Bernoulli(theta1)
against Bernoulli(theta0) averaged over 24 alternatives theta1 (odds ratios
1.1 to 100 away from theta0); each ratio is a supermartingale under any rate
on theta0's side, so their average is. Normal mixture (Robbins 1970; one-sided,
Howard, Ramdas, McAuliffe, Sekhon, Annals of Statistics 2021): for a
standardized statistic z after V effective samples,
E = 2 sqrt(rho / (V + rho)) exp(z^2 V / (2 (V + rho))) Phi(z sqrt(V / (V + rho))),
tightest for V from 5 to 100 x rho: rho = 100 requests for latency, 4
windows for energy.

Assumptions. Within a stage each version's requests are independent draws,
and the router's choice of version does not depend on a request's outcome.
The canary's share of a tier's traffic is constant within a stage (the error
test takes it from the request counts). Each look's samples contain the
previous look's: counts are cumulative and a latency reservoir is nested
until full. Past that a look sees a uniform subsample, valid on its own but
renewed about once per doubling of the stage's traffic, so in the worst case
a test's error grows to (1 + doublings) x its share; the simulated rates stay
far below (cumulative latency histograms would restore nesting). The tail
test's threshold stands on stable's upper bound, about 10% above its p95 at
4000 samples, so a tail regression must clear that too. Conditions that
change over time (a noisy neighbour)
hit both versions alike, because both are sampled over the same time; a
test conditioned on the pooled sample (Mann-Whitney) stays valid, and the
tail test's threshold moves with stable's tail. Mann-Whitney's normal
approximation holds from min_samples on.

Against the reference (Lindon, Sanden, Shirikian, "Rapid Regression
Detection in Software Deployments through Sequential Testing", KDD 2022,
arXiv 2205.14762: anytime-valid tests of stochastic order and of equality in
distribution from sequential quantile confidence bands): a band uniform over
every quantile pays for its width at the one quantile a metric names; here
each metric tests its own quantile (or shift, or rate), the margin max_ratio
makes a regression a size the user chose rather than any difference, and the
budget spans stages and tiers as well as looks.

Cost: a sort and a few binary searches per version's sample, about 0.3 ms a
tier with 4000 latency samples a version. Pure: numbers in, a frozen AnalysisRun out;
no I/O, no clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from tiered import names
from tiered.rollout.spec import (
    AgreementBound,
    AnalysisSpec,
    EnergyBound,
    ErrorRateBound,
    LatencyBound,
    ShiftBound,
    Stage,
)
from tiered.rollout.status import AnalysisRun, MetricResult
from tiered.rollout.wire import wire_key, wire_path

SUCCESSFUL, FAILED, INCONCLUSIVE, ERROR, NOT_JUDGED = (
    names.Outcome.SUCCESSFUL, names.Outcome.FAILED, names.Outcome.INCONCLUSIVE,
    names.Outcome.ERROR, names.Outcome.NOT_JUDGED)
_SEVERITY = {SUCCESSFUL: 0, INCONCLUSIVE: 1, ERROR: 2, FAILED: 3}
_NORMAL = NormalDist()

# The binomial mixtures' alternatives: odds ratios against the null rate. Not
# knowing which one holds costs log(24) nats of evidence, what a fixed-size
# test pays for a Bonferroni split in 24.
_ODDS_RATIOS = np.geomspace(1.1, 100.0, 24)
# The normal mixture's spread, in effective samples: its boundary is within a
# few percent of its lowest from about 5 x to 100 x this, so it is set where
# stages decide: hundreds to thousands of requests, tens of energy windows.
RHO_REQUESTS = 100.0
RHO_WINDOWS = 4.0
# A rate of exactly 0 or 1 leaves no alternative on one side; stay just inside.
_EDGE = 1e-12


def worst(outcomes: Sequence[str]) -> str:
    """The run's verdict: Failed > Error > Inconclusive > Successful; a
    metric not judged holds nothing, so it counts as Successful."""
    return max((SUCCESSFUL if o == NOT_JUDGED else o for o in outcomes),
               key=_SEVERITY.__getitem__, default=INCONCLUSIVE)


# --- measurements -----------------------------------------------------------


@dataclass(frozen=True)
class VersionSamples:
    """What one version (stable or canary) did over the stage so far."""

    latencies_ms: Sequence[float] = ()  # raw per-request samples (a bounded reservoir)
    requests: int = 0  # answered or failed by the server
    errors: int = 0  # failures the server caused
    joules_per_inference: Sequence[float] = ()  # one per telemetry window
    energy_source: str = ""  # of the energy figures: nvml, rapl or model; "" unknown
    # A generative version's: time to first token a request, time per output
    # token (a reservoir each), output tokens, J per output token a window.
    ttft_ms: Sequence[float] = ()
    tpot_ms: Sequence[float] = ()
    output_tokens: int = 0
    joules_per_token: Sequence[float] = ()
    client_errors: int = 0  # requests refused for what the client sent: shown, not judged


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
    traffic to, as the adapter collected them: cumulative since the stage began.

    `window` numbers the analyses: the same window judged twice counts once
    toward the consecutive-failure limit. `stage` is the stage index the
    samples belong to; samples of another stage are never judged.
    """

    window: int
    stage: int
    tiers: Mapping[str, TierSamples]
    shadow_compared: int = 0  # shadowed requests whose outputs were compared, every tier
    shadow_agreed: int = 0

    def requests(self, version: str) -> int:
        """Requests one version ("stable" or "canary") served on every tier."""
        return sum(getattr(samples, version).requests for samples in self.tiers.values())

    def pooled(self, version: str) -> VersionSamples:
        """One version ("stable" or "canary") over every tier, for headline figures."""
        parts = [getattr(samples, version) for samples in self.tiers.values()]
        sources = {p.energy_source for p in parts
                   if len(p.joules_per_inference) or len(p.joules_per_token)}
        return VersionSamples(
            latencies_ms=tuple(v for p in parts for v in p.latencies_ms),
            requests=sum(p.requests for p in parts),
            errors=sum(p.errors for p in parts),
            client_errors=sum(p.client_errors for p in parts),
            joules_per_inference=tuple(v for p in parts for v in p.joules_per_inference),
            energy_source=sources.pop() if len(sources) == 1 else "",  # "": unknown or mixed
            ttft_ms=tuple(v for p in parts for v in p.ttft_ms),
            tpot_ms=tuple(v for p in parts for v in p.tpot_ms),
            output_tokens=sum(p.output_tokens for p in parts),
            joules_per_token=tuple(v for p in parts for v in p.joules_per_token))


# --- the false-rollback budget ----------------------------------------------


PREDICTIVE = names.ModelKind.PREDICTIVE


def _tests_of(bound: object) -> int:
    """A metric's tests: its relative test, and its absolute bound when set."""
    if isinstance(bound, LatencyBound):
        return 1 + (bound.max_ms is not None)
    if isinstance(bound, ErrorRateBound):
        return 1 + (bound.max is not None)
    return 1


def tests_per_tier(spec: AnalysisSpec, kind: str = PREDICTIVE) -> int:
    """Sequential tests judged on each tier a stage sends canary traffic to,
    for a model of `kind`."""
    return sum(_tests_of(bound) for metric, bound in spec.judged(kind).items()
               if metric != "agreement")


def stage_tests(spec: AnalysisSpec, tiers: int, kind: str = PREDICTIVE) -> int:
    """Tests of one stage on `tiers` tiers: each tier's, and agreement once."""
    return tiers * tests_per_tier(spec, kind) + (spec.agreement is not None)


def rollout_tests(spec: AnalysisSpec, stages: Sequence[Stage], kind: str = PREDICTIVE) -> int:
    """Every test a rollout through `stages` can run: what alpha is shared by.
    Fixed by the spec before any data, as the union bound needs."""
    return max(1, sum(stage_tests(spec, sum(1 for w in stage.weights.values() if w > 0), kind)
                      for stage in stages))


# --- sequential evidence ----------------------------------------------------


def binomial_log_e(successes: int | np.ndarray, trials: int, rate: float,
                   above: bool = True) -> float | np.ndarray:
    """log of the mixture e-value against "the success rate is at most `rate`"
    (above=True; at least `rate` when above=False) from `successes` of
    `trials`: the likelihood ratios of the alternatives on the other side,
    averaged. Vectorized over `successes`."""
    x = np.asarray(successes, dtype=float)[..., None]
    rate = min(max(rate, _EDGE), 1.0 - _EDGE)
    odds = _ODDS_RATIOS if above else 1.0 / _ODDS_RATIOS
    alternatives = odds * rate / (1.0 - rate + odds * rate)
    log_ratios = (x * np.log(alternatives / rate)
                  + (trials - x) * np.log((1.0 - alternatives) / (1.0 - rate)))
    top = log_ratios.max(axis=-1)
    log_e = top + np.log(np.mean(np.exp(log_ratios - top[..., None]), axis=-1))
    return float(log_e) if log_e.ndim == 0 else log_e


def normal_log_e(z: float, information: float, rho: float) -> float:
    """log of the one-sided normal-mixture e-value of a standardized statistic
    `z` after `information` effective samples, mixture spread `rho` (see the
    module docstring)."""
    v = max(information, 0.0)
    x = max(z * math.sqrt(v / (v + rho)), -30.0)  # below: e < 1 and Phi underflows
    # erfc keeps Phi's far left tail, where NormalDist.cdf rounds to 0.
    return (0.5 * math.log(rho / (v + rho)) + x * x / 2
            + math.log(math.erfc(-x / math.sqrt(2))))


def p_value(log_e: float) -> float:
    """The always-valid p-value of an e-value: 1/E, at most 1."""
    return math.exp(-max(log_e, 0.0))


@functools.lru_cache(maxsize=4096)  # a pure function of three numbers, asked every look
def quantile_upper_rank(n: int, q: float, alpha: float) -> int | None:
    """The 1-based rank u for which X_(u) of n samples is an anytime-valid
    upper confidence bound of the q-quantile at level alpha; None while n is
    too small for any.

    Fewer than u samples fall below the true quantile Q at every n, except
    with probability alpha (their count is Binomial(n, <= q), and u is the
    least count the binomial mixture rejects), so X_(u) >= Q.
    """
    if n <= 0:
        return None
    start = int(n * q)
    spread = math.sqrt(n * q * (1 - q))
    counts = np.arange(start, min(n, start + int(12 * spread) + 60) + 1)
    hits = np.flatnonzero(binomial_log_e(counts, n, q) >= math.log(1 / alpha))
    return int(counts[hits[0]]) if len(hits) and counts[hits[0]] >= 1 else None


@functools.lru_cache(maxsize=256)
def least_samples_to_bound(q: float, alpha: float) -> int:
    """The fewest samples from which `quantile_upper_rank` has a bound: what
    a tail test short of stable samples needs. More samples never lose the
    bound (all n below the quantile is ever stronger evidence), so a bisection."""
    low, high = 0, 1
    while quantile_upper_rank(high, q, alpha) is None:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if quantile_upper_rank(middle, q, alpha) is None \
            else (low, middle)
    return high


# --- the rank test ------------------------------------------------------------


@dataclass(frozen=True)
class MannWhitney:
    """One-sided test that x tends to be larger than y."""

    u: float  # U of x: pairs (x_i, y_j) with x_i > y_j, ties counted half
    z: float
    p_value: float  # fixed-sample; the judges use z through the normal mixture
    n_x: int
    n_y: int

    @property
    def effective_samples(self) -> float:
        """The information of a two-sample comparison: n_x n_y / (n_x + n_y)."""
        return self.n_x * self.n_y / (self.n_x + self.n_y)


def mann_whitney_greater(x: Sequence[float], y: Sequence[float],
                         continuity: bool = True) -> MannWhitney:
    """Mann-Whitney U, alternative "x is stochastically greater than y": the
    normal approximation with tie correction (and, by default, the 0.5
    continuity correction, as scipy's asymptotic method does).

    From sorted samples, since the controller judges often: U counts, for
    each x, the y below it (and half those equal), a binary search each;
    only when values repeat are the pooled sample's tie groups counted."""
    a = np.sort(np.asarray(x, dtype=float))
    b = np.sort(np.asarray(y, dtype=float))
    n_x, n_y = len(a), len(b)
    if n_x == 0 or n_y == 0:
        raise ValueError("mann_whitney_greater: both samples need at least one value")
    below = np.searchsorted(b, a, "left")
    equal = b[np.minimum(below, n_y - 1)] == a
    tie_term = 0.0
    if equal.any() or np.any(a[1:] == a[:-1]) or np.any(b[1:] == b[:-1]):
        below_or_equal = np.searchsorted(b, a, "right")
        u = float((below + below_or_equal).sum() / 2.0)
        pooled = np.sort(np.concatenate([a, b]), kind="stable")  # two sorted runs: a merge
        starts = np.flatnonzero(np.r_[True, pooled[1:] != pooled[:-1], True])
        ties = np.diff(starts).astype(float)
        tie_term = float(np.sum(ties ** 3 - ties))
    else:
        u = float(below.sum())
    n = n_x + n_y
    mean = n_x * n_y / 2.0
    variance = n_x * n_y / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if variance <= 0:  # every value equal: no evidence either way
        return MannWhitney(u, 0.0, 0.5, n_x, n_y)
    z = (u - mean - (0.5 if continuity else 0.0)) / math.sqrt(variance)
    return MannWhitney(u, z, _NORMAL.cdf(-z), n_x, n_y)


def quantile_sorted(ordered: np.ndarray, q: float) -> float:
    """The q-quantile of a sorted sample, interpolated as numpy's default."""
    h = (len(ordered) - 1) * q
    low = int(math.floor(h))
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (h - low) * (ordered[high] - ordered[low]))


# --- metrics ----------------------------------------------------------------


def _finite_nonnegative(values: Sequence[float]) -> np.ndarray | None:
    array = np.asarray(values, dtype=float).ravel()
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        return None
    return array


def _checked_pair(name: str, what: str, stable: Sequence[float], canary: Sequence[float],
                  ) -> tuple[np.ndarray, np.ndarray] | MetricResult:
    """Both samples as sorted arrays (quantiles and counts above a value are
    then lookups), or the Error result that one holds a bad value."""
    s, c = _finite_nonnegative(stable), _finite_nonnegative(canary)
    if s is None or c is None:
        return MetricResult(name, ERROR, f"{what} samples hold a negative or non-finite value",
                            {"n_stable": float(len(stable)), "n_canary": float(len(canary))})
    return np.sort(s), np.sort(c)


def _too_few(name: str, what: str, n_stable: int, n_canary: int, need: int, setting: str,
             numbers: dict[str, float]) -> MetricResult | None:
    """Inconclusive while either version has fewer than `need` (the spec's
    `setting`) samples."""
    if n_stable < need or n_canary < need:
        wanted = f"need {need} each, {wire_key(setting)}"
        if n_canary == 0 and n_stable == 0:
            reason = f"no {what} yet from either version ({wanted})"
        elif n_canary == 0:
            reason = f"no canary {what} yet (stable {n_stable}; {wanted})"
        else:
            reason = f"too few {what}: canary {n_canary}, stable {n_stable}, {wanted}"
        return MetricResult(name, INCONCLUSIVE, reason, numbers)
    return None


def _percent(q: float) -> str:
    return f"{q * 100:g}"


def _verdict(p: float, alpha: float, failed: str, otherwise: str,
             other: str = SUCCESSFUL) -> tuple[str, str]:
    """Failed, with its reason, once the always-valid p-value reaches alpha;
    else the `other` outcome with the other reason."""
    if p <= alpha:
        return FAILED, f"{failed} (p={p:.3g} <= {alpha:.3g})"
    return other, f"{otherwise} (p={p:.3g})"


def _combine(name: str, checks: list[tuple[str, str]],
             numbers: dict[str, float]) -> MetricResult:
    """One metric from its checks (outcome, reason): the worst outcome, its
    reason first."""
    outcome = worst([o for o, _ in checks])
    ordered = [r for o, r in checks if o == outcome] + [r for o, r in checks if o != outcome]
    return MetricResult(name, outcome, "; ".join(ordered), numbers)


@dataclass(frozen=True)
class _Timing:
    """How the reasons speak of one timed quantity's samples."""

    label: str  # before "p95" in a reason: "" for request latency
    samples: str  # what one sample is, plural
    plural: str  # the quantity, plural


# The timed quantities, by metric prefix: request latency, a generative
# model's time to first token and time per output token.
_TIMINGS = {"latency": _Timing("", "requests", "latencies"),
            "ttft": _Timing("TTFT ", "first tokens", "TTFTs"),
            "tpot": _Timing("TPOT ", "token intervals", "TPOTs")}


def judge_latency_quantile(q: float, bound: LatencyBound, stable: Sequence[float],
                           canary: Sequence[float], alpha: float,
                           min_samples: int, quantity: str = "latency") -> MetricResult:
    """The tail test of the q-quantile (see the module docstring) at `alpha`,
    and max_ms, when set, a test of its own at `alpha` too. `quantity`:
    latency, ttft or tpot (milliseconds each), which names the metric."""
    pct = _percent(q)
    name = f"{quantity}_p{pct}"
    timing = _TIMINGS[quantity]
    checked = _checked_pair(name, timing.label.strip() or "latency", stable, canary)
    if isinstance(checked, MetricResult):
        return checked
    s, c = checked
    numbers = {"n_stable": float(len(s)), "n_canary": float(len(c)),
               "min_samples": float(min_samples), "max_ratio": bound.max_ratio,
               "quantile": q, "alpha": alpha}
    too_few = _too_few(name, "samples", len(s), len(c), min_samples, "min_samples", numbers)
    if too_few is not None:
        return too_few
    # Half the share bounds stable's quantile, half tests the canary's count.
    rank = quantile_upper_rank(len(s), q, alpha / 2)
    q_s, q_c = quantile_sorted(s, q), quantile_sorted(c, q)
    numbers.update({f"p{pct}_stable_ms": q_s, f"p{pct}_canary_ms": q_c,
                    "median_stable_ms": quantile_sorted(s, 0.5),
                    "median_canary_ms": quantile_sorted(c, 0.5),
                    "expected_share_above": 1 - q})
    if q_s > 0:
        numbers[f"p{pct}_ratio"] = q_c / q_s
    if rank is None:  # minSamples met, but too few for this test's share of the budget
        need = least_samples_to_bound(q, alpha / 2)
        numbers["stable_samples_to_bound"] = float(need)
        return MetricResult(name, INCONCLUSIVE, f"too few stable samples to bound its p{pct} "
                            f"at this confidence: {len(s)}, need {need}", numbers)
    upper = float(s[rank - 1])
    threshold = bound.max_ratio * upper
    above = len(c) - int(np.searchsorted(c, threshold, "right"))
    p = p_value(binomial_log_e(above, len(c), 1 - q))
    numbers.update({f"p{pct}_stable_upper_ms": upper, "threshold_ms": threshold,
                    "canary_above": float(above), "canary_share_above": above / len(c),
                    "p_value": p, "alpha_bound": alpha / 2, "alpha_count": alpha / 2})
    tail = f"{timing.label}p{pct}"
    detail = (f"{above} of {len(c)} canary {timing.samples} ({above / len(c):.1%}) above "
              f"{threshold:.3g} ms = {bound.max_ratio:g} x stable {tail}'s bound "
              f"{upper:.3g} ms, {1 - q:.0%} expected; {tail} {q_c:.3g} vs {q_s:.3g} ms")
    checks = [_verdict(p, alpha / 2, f"canary {tail} above {bound.max_ratio:g}x stable's: "
                       f"{detail}", f"no {tail} regression beyond {bound.max_ratio:g}x: {detail}")]
    if bound.max_ms is not None:
        over = len(c) - int(np.searchsorted(c, bound.max_ms, "right"))
        p_max = p_value(binomial_log_e(over, len(c), 1 - q))
        numbers.update(max_ms=bound.max_ms, canary_above_max=float(over), p_value_max=p_max)
        if p_max <= alpha or q_c > bound.max_ms:
            checks.append(_verdict(
                p_max, alpha, f"canary {tail} above {bound.max_ms:g} ms: {over} of {len(c)} "
                f"{timing.samples} above it", f"canary {tail} {q_c:.3g} ms is above "
                f"{bound.max_ms:g} ms but not yet significantly", INCONCLUSIVE))
    return _combine(name, checks, numbers)


def _shift_p(unit: str, key: str, max_ratio: float, s: np.ndarray, c: np.ndarray,
             rho: float, numbers: dict[str, float]) -> tuple[float, str]:
    """Mann-Whitney of canary/max_ratio against stable (sorted) through the
    normal mixture: the always-valid p-value and the reason's numbers."""
    test = mann_whitney_greater(c / max_ratio, s)
    p = p_value(normal_log_e(test.z, test.effective_samples, rho))
    median_s, median_c = quantile_sorted(s, 0.5), quantile_sorted(c, 0.5)
    numbers.update({f"median_stable_{key}": median_s, f"median_canary_{key}": median_c,
                    "u": test.u, "z": test.z, "effective_samples": test.effective_samples,
                    "p_value": p})
    if median_s > 0:
        numbers["median_ratio"] = median_c / median_s
    return p, f"median {median_c:.4g} vs {median_s:.4g} {unit}, z={test.z:.3g}"


def judge_latency_shift(bound: ShiftBound, stable: Sequence[float], canary: Sequence[float],
                        alpha: float, min_samples: int, quantity: str = "latency",
                        ) -> MetricResult:
    """Mann-Whitney with the max_ratio margin; `quantity` as for the tail test."""
    name = f"{quantity}_shift"
    timing = _TIMINGS[quantity]
    checked = _checked_pair(name, timing.label.strip() or "latency", stable, canary)
    if isinstance(checked, MetricResult):
        return checked
    s, c = checked
    numbers = {"n_stable": float(len(s)), "n_canary": float(len(c)),
               "min_samples": float(min_samples), "max_ratio": bound.max_ratio, "alpha": alpha}
    too_few = _too_few(name, "samples", len(s), len(c), min_samples, "min_samples", numbers)
    if too_few is not None:
        return too_few
    p, detail = _shift_p("ms", "ms", bound.max_ratio, s, c, RHO_REQUESTS, numbers)
    return _combine(name, [_verdict(
        p, alpha, f"canary {timing.plural} shifted beyond {bound.max_ratio:g}x stable's: "
        f"{detail}", f"no shift beyond {bound.max_ratio:g}x: {detail}")], numbers)


def judge_error_rate(bound: ErrorRateBound, stable_errors: int, stable_requests: int,
                     canary_errors: int, canary_requests: int, alpha: float,
                     min_samples: int, client_errors: tuple[int, int] = (0, 0)
                     ) -> MetricResult:
    """The canary's share of all errors against its share with no regression,
    and (with max) its error count against max; `alpha` for each. Errors are
    the failures the server caused; `client_errors` (stable's, the canary's:
    requests refused for what the client sent) are shown, never judged, so
    that no client can roll a version back by sending it bad requests."""
    name = "error_rate"
    numbers = {"n_stable": float(stable_requests), "n_canary": float(canary_requests),
               "errors_stable": float(stable_errors), "errors_canary": float(canary_errors),
               "client_errors_stable": float(client_errors[0]),
               "client_errors_canary": float(client_errors[1]),
               "min_samples": float(min_samples), "max_ratio": bound.max_ratio,
               "alpha": alpha}
    if not (0 <= stable_errors <= stable_requests and 0 <= canary_errors <= canary_requests):
        return MetricResult(name, ERROR, "error counts are negative or exceed the requests",
                            numbers)
    too_few = _too_few(name, "requests", stable_requests, canary_requests, min_samples,
                       "min_samples", numbers)
    if too_few is not None:
        return too_few
    rate_s, rate_c = stable_errors / stable_requests, canary_errors / canary_requests
    errors = stable_errors + canary_errors
    share_max = (bound.max_ratio * canary_requests
                 / (bound.max_ratio * canary_requests + stable_requests))
    p = p_value(binomial_log_e(canary_errors, errors, share_max)) if errors else 1.0
    numbers.update(rate_stable=rate_s, rate_canary=rate_c, canary_share_of_errors_max=share_max,
                   p_value=p)
    # The test is of the canary's share of the errors; with none there is
    # nothing to share, and the reason says so rather than bound a share of 0.
    detail = (f"canary {rate_c:.3g} vs stable {rate_s:.3g}: {canary_errors} of the {errors} "
              f"errors are the canary's, at most {share_max:.1%} expected" if errors else
              f"no errors in {canary_requests} canary and {stable_requests} stable requests")
    if any(client_errors):
        detail += (f" (client errors, not judged: canary {client_errors[1]}, "
                   f"stable {client_errors[0]})")
    checks = [_verdict(p, alpha, f"canary error rate above {bound.max_ratio:g}x stable's: "
                       f"{detail}", f"error rate {detail}" if errors else detail)]
    if bound.max is not None:
        p_max = p_value(binomial_log_e(canary_errors, canary_requests, bound.max))
        numbers.update(max=bound.max, p_value_max=p_max)
        if p_max <= alpha or rate_c > bound.max:
            checks.append(_verdict(
                p_max, alpha, f"canary error rate {rate_c:.3g} above {bound.max:g}",
                f"canary error rate {rate_c:.3g} above {bound.max:g} but not yet "
                f"significantly", INCONCLUSIVE))
    return _combine(name, checks, numbers)


# The energy metrics and the unit of their figures.
ENERGY_UNITS = {"energy_per_inference": "J/inference", "energy_per_token": "J/token"}


def energy_gate(allow_modeled: bool, stable: str | None, canary: str | None,
                metric: str = "energy_per_inference") -> str | None:
    """Why two versions' energy figures are not judged, or None to judge
    them. A source is None where the version has no figure yet: missing data,
    which the judgement itself makes Inconclusive."""
    seen = [source for source in (stable, canary) if source is not None]
    if len(seen) == 2 and all(seen) and stable != canary:
        return "figures of different sources do not compare"
    if not allow_modeled and not _measured(seen):
        return (f"the figures are not measurements (set {wire_path(metric, 'allow_modeled')}: "
                "true to judge them anyway)")
    return None


def _measured(sources: Sequence[str | None]) -> bool:
    return all(source in names.MEASURED_ENERGY for source in sources if source is not None)


def judge_energy(bound: EnergyBound, stable: Sequence[float], canary: Sequence[float],
                 alpha: float, stable_source: str = "", canary_source: str = "",
                 metric: str = "energy_per_inference") -> MetricResult:
    """The rank test of J/inference (`metric` energy_per_token: J/token), or
    (see `energy_gate`) its comparison reported, NotJudged; the reason names
    the figures' sources."""
    sources = (stable_source if len(stable) else None, canary_source if len(canary) else None)
    gate = energy_gate(bound.allow_modeled, *sources, metric=metric)
    result = _compare_energy(bound, stable, canary, alpha, metric)
    numbers = {**result.numbers, "measured": float(_measured(sources)),
               "judged": float(gate is None)}
    label = names.energy_sources_label(*sources)
    if gate is None:
        said = "" if sources == (None, None) else f"; source {label}"  # none: no figures
        return replace(result, reason=result.reason + said, numbers=numbers)
    return MetricResult(result.metric, NOT_JUDGED, f"{gate}. Compared anyway ({label}), it "
                        f"would be {result.outcome.lower()}: {result.reason}", numbers)


def _compare_energy(bound: EnergyBound, stable: Sequence[float], canary: Sequence[float],
                    alpha: float, name: str) -> MetricResult:
    unit = ENERGY_UNITS[name]
    checked = _checked_pair(name, unit, stable, canary)
    if isinstance(checked, MetricResult):
        return checked
    s, c = checked
    numbers = {"n_stable": float(len(s)), "n_canary": float(len(c)),
               "min_windows": float(bound.min_windows), "max_ratio": bound.max_ratio,
               "alpha": alpha}
    too_few = _too_few(name, f"{unit} windows", len(s), len(c), bound.min_windows,
                       "min_windows", numbers)
    if too_few is not None:
        return too_few
    mean_s, mean_c = float(np.mean(s)), float(np.mean(c))
    numbers.update(mean_stable_j=mean_s, mean_canary_j=mean_c)
    if mean_s > 0:
        numbers["ratio"] = mean_c / mean_s
    p, detail = _shift_p("J", "j", bound.max_ratio, s, c, RHO_WINDOWS, numbers)
    means = f"mean {mean_c:.4g} vs {mean_s:.4g} {unit}, {detail}"
    return _combine(name, [_verdict(
        p, alpha, f"canary uses more than {bound.max_ratio:g}x stable's energy: {means}",
        means)], numbers)


def judge_agreement(bound: AgreementBound, agreed: int, compared: int, alpha: float,
                    min_samples: int) -> MetricResult:
    """Failed on evidence that the agreement rate is below min, Successful on
    evidence that it is above, Inconclusive in between (`alpha` each way)."""
    name = "agreement"
    numbers = {"compared": float(compared), "agreed": float(agreed), "min": bound.min,
               "min_samples": float(min_samples), "alpha": alpha}
    if not 0 <= agreed <= compared:
        return MetricResult(name, ERROR, "agreed count is negative or exceeds compared", numbers)
    if compared < min_samples:
        return MetricResult(name, INCONCLUSIVE, f"too few shadowed requests: {compared}, need "
                            f"{min_samples} ({wire_key('min_samples')})", numbers)
    rate = agreed / compared
    below = p_value(binomial_log_e(agreed, compared, bound.min, above=False))
    above = 0.0 if bound.min <= 0 else p_value(binomial_log_e(agreed, compared, bound.min))
    numbers.update(rate=rate, p_value=below, p_value_above=above)
    if below <= alpha:
        return MetricResult(name, FAILED, f"agreement {rate:.4g} below {bound.min:g} "
                            f"(p={below:.3g} <= {alpha:.3g})", numbers)
    if above <= alpha:
        return MetricResult(name, SUCCESSFUL, f"agreement {rate:.4g} above {bound.min:g} "
                            f"(p={above:.3g} <= {alpha:.3g})", numbers)
    reason = (f"agreement {rate:.4g} over {compared} shadowed requests: not yet "
              f"significantly above {bound.min:g} (p={above:.3g} > {alpha:.3g})")
    need = _shadows_to_show(rate, bound.min, alpha)
    if need is not None:
        numbers["shadowed_to_decide"] = float(need)
        reason += f"; about {need} would show it if the rate holds"
    return MetricResult(name, INCONCLUSIVE, reason, numbers)


def _shadows_to_show(rate: float, least: float, alpha: float) -> int | None:
    """The fewest shadowed requests at which agreement `rate`, held, would be
    shown above `least` at `alpha`; None when it never would. The log
    e-value is convex in the count and 0 at none, so once it reaches the
    threshold it stays: double, then bisect."""
    if not 0 < least < rate:
        return None
    threshold = math.log(1 / alpha)
    def shown(n: int) -> bool:
        return binomial_log_e(rate * n, n, least) >= threshold
    low, high = 0, 1
    while not shown(high):
        if high > 10**9:
            return None
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if shown(middle) else (middle, high)
    return high


def analyze(spec: AnalysisSpec, measurements: Measurements,
            tests: int | None = None, kind: str = PREDICTIVE) -> AnalysisRun:
    """Judge every configured metric of a model of `kind` (`METRICS_OF_KIND`),
    canary vs stable, on each tier, and agreement over all of them; the worst
    outcome wins.

    Each tier is judged on its own samples, so a tier's regression is not
    diluted by another tier's traffic and stable is compared on the tier the
    canary ran on. A tier where neither version served a request this stage
    has nothing at stake and is left out (unless no tier served any). Every
    test gets (1 - confidence) / `tests`, the rollout's count
    (`rollout_tests`); None counts this look's tests only, as for a rollout
    of this one stage.
    """
    tiers = ({tier: s for tier, s in measurements.tiers.items() if s.served}
             or dict(measurements.tiers) or {None: TierSamples()})
    tests = stage_tests(spec, len(tiers), kind) if tests is None else tests
    alpha = (1 - spec.confidence) / tests
    judged = spec.judged(kind)
    metrics: list[MetricResult] = []
    for tier, samples in tiers.items():
        metrics.extend(replace(_judge_metric(metric, bound, samples.stable, samples.canary,
                                             alpha, spec.min_samples), tier=tier)
                       for metric, bound in judged.items() if metric != "agreement")
    if spec.agreement is not None:
        metrics.append(judge_agreement(spec.agreement, measurements.shadow_agreed,
                                       measurements.shadow_compared, alpha, spec.min_samples))
    budget = {"alpha_rollout": 1 - spec.confidence, "tests": float(tests)}
    metrics = [replace(m, numbers={**m.numbers, **budget}) for m in metrics]
    return AnalysisRun(measurements.window, worst([m.outcome for m in metrics]),
                       tuple(metrics))


def _judge_metric(metric: str, bound: object, stable: VersionSamples, canary: VersionSamples,
                  alpha: float, min_samples: int) -> MetricResult:
    """One metric of one tier (any of `METRICS_OF_KIND` but agreement)."""
    quantity, _, test = metric.partition("_")
    if metric == "error_rate":
        return judge_error_rate(bound, stable.errors, stable.requests, canary.errors,
                                canary.requests, alpha, min_samples,
                                (stable.client_errors, canary.client_errors))
    if metric in ENERGY_UNITS:
        figures = "joules_per_inference" if metric == "energy_per_inference" \
            else "joules_per_token"
        return judge_energy(bound, getattr(stable, figures), getattr(canary, figures), alpha,
                            stable.energy_source, canary.energy_source, metric)
    samples = {"latency": "latencies_ms", "ttft": "ttft_ms", "tpot": "tpot_ms"}[quantity]
    if test == "shift":
        return judge_latency_shift(bound, getattr(stable, samples), getattr(canary, samples),
                                   alpha, min_samples, quantity)
    q = {"p95": 0.95, "p99": 0.99}[test]
    return judge_latency_quantile(q, bound, getattr(stable, samples), getattr(canary, samples),
                                  alpha, min_samples, quantity)
