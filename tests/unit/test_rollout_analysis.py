"""Canary analysis: the statistics against known values (and scipy), and each
metric's outcome table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tiered.rollout import analysis as a
from tiered.rollout.spec import (
    AgreementBound,
    AnalysisSpec,
    EnergyBound,
    ErrorRateBound,
    LatencyBound,
)

try:
    from scipy import stats
except ImportError:  # scipy is only a cross-check
    stats = None


def test_mann_whitney_matches_a_hand_computed_value():
    # Every x beats every y: U = 6; mean 3, variance 3*2/12*6 = 3.
    test = a.mann_whitney_greater([3, 4, 5], [1, 2])
    assert test.u == 6
    assert test.z == pytest.approx((6 - 3 - 0.5) / math.sqrt(3))
    assert test.p_value == pytest.approx(0.07446, abs=1e-4)


def test_mann_whitney_counts_ties_half_and_corrects_the_variance():
    test = a.mann_whitney_greater([1, 2, 2], [2, 3])
    assert test.u == 1.0
    # Tie group of three 2s: sum(t^3 - t) = 24; variance = 6/12 * (6 - 24/20) = 2.4.
    assert test.z == pytest.approx((1 - 3 - 0.5) / math.sqrt(2.4))


def test_mann_whitney_of_identical_values_is_no_evidence():
    assert a.mann_whitney_greater([5, 5], [5, 5, 5]).p_value == 0.5


@pytest.mark.skipif(stats is None, reason="scipy absent")
@pytest.mark.parametrize("seed", range(6))
def test_mann_whitney_agrees_with_scipy(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 20, size=40 + seed * 7).astype(float)  # many ties
    y = rng.integers(0, 18, size=55).astype(float)
    ours = a.mann_whitney_greater(x, y)
    theirs = stats.mannwhitneyu(x, y, alternative="greater", method="asymptotic")
    assert ours.u == pytest.approx(theirs.statistic)
    assert ours.p_value == pytest.approx(theirs.pvalue, rel=1e-9)


def test_average_ranks_share_ties():
    ranks, tie_term = a.average_ranks(np.array([10.0, 20.0, 10.0, 30.0]))
    assert ranks.tolist() == [1.5, 3.0, 1.5, 4.0]
    assert tie_term == 6.0


def test_wilson_interval_known_value():
    # 95 of 100, one-sided 95% (z = 1.6449): centre 0.93815, half-width 0.03731.
    lower, upper = a.wilson_interval(95, 100, 0.95)
    assert lower == pytest.approx(0.90084, abs=5e-5)
    assert upper == pytest.approx(0.97545, abs=5e-5)
    assert a.wilson_interval(0, 0, 0.95) == (0.0, 1.0)


def test_quantile_lower_bound_is_below_the_quantile():
    values = np.arange(1, 1001, dtype=float)
    bound = a.quantile_lower_bound(values, 0.95, 0.95)
    # k = floor(950 - 1.645 * sqrt(47.5)) = 938
    assert bound == 938.0


def test_worst_outcome_order():
    assert a.worst([a.SUCCESSFUL, a.INCONCLUSIVE, a.ERROR]) == a.ERROR
    assert a.worst([a.ERROR, a.FAILED]) == a.FAILED
    assert a.worst([a.SUCCESSFUL, a.INCONCLUSIVE]) == a.INCONCLUSIVE
    assert a.worst([]) == a.INCONCLUSIVE  # nothing judged is not a pass


def lognormal(rng, median_ms, n, sigma=0.5):
    return rng.lognormal(math.log(median_ms), sigma, n)


R = np.random.default_rng(7)
STABLE = lognormal(R, 20, 2000)
SAME = lognormal(R, 20, 400)
SLOWER = lognormal(R, 26, 400)  # 30% slower
FEW = lognormal(R, 20, 10)

LATENCY = {
    # name: (bound, canary samples, expected outcome)
    "unchanged canary passes": (LatencyBound(1.05), SAME, a.SUCCESSFUL),
    "30% slower canary fails": (LatencyBound(1.05), SLOWER, a.FAILED),
    "30% slower is within a 1.5x margin": (LatencyBound(1.5), SLOWER, a.SUCCESSFUL),
    "too few samples are inconclusive": (LatencyBound(1.05), FEW, a.INCONCLUSIVE),
    "no samples are inconclusive": (LatencyBound(1.05), np.array([]), a.INCONCLUSIVE),
    "p95 clearly above max_ms fails": (LatencyBound(1.5, max_ms=30), SAME, a.FAILED),
    "p95 near max_ms is inconclusive": (
        LatencyBound(1.5, max_ms=float(np.quantile(SAME, 0.95)) * 0.99), SAME, a.INCONCLUSIVE),
    "p95 well below max_ms passes": (LatencyBound(1.05, max_ms=200), SAME, a.SUCCESSFUL),
    "a NaN is an error": (LatencyBound(1.05), np.r_[SAME, np.nan], a.ERROR),
}


@pytest.mark.parametrize("case", LATENCY)
def test_latency(case):
    bound, canary, expected = LATENCY[case]
    result = a.judge_latency(bound, STABLE, canary, 0.95, 50)
    assert result.outcome == expected, result.reason
    if expected in (a.SUCCESSFUL, a.FAILED):
        for key in ("n_canary", "n_stable", "p95_canary_ms", "p95_stable_ms", "u", "z",
                    "p_value", "alpha", "max_ratio"):
            assert key in result.numbers


ERRORS = {
    # name: (bound, stable errors/requests, canary errors/requests, expected)
    "same rate passes": (ErrorRateBound(0.05, 2.0), (20, 4000), (2, 400), a.SUCCESSFUL),
    "no errors pass": (ErrorRateBound(0.05, 2.0), (0, 4000), (0, 400), a.SUCCESSFUL),
    "ten times the errors fail": (ErrorRateBound(None, 2.0), (20, 4000), (20, 400), a.FAILED),
    "above the absolute max fails": (ErrorRateBound(0.01, 100.0), (400, 4000), (40, 400),
                                     a.FAILED),
    "barely above max is inconclusive": (ErrorRateBound(0.01, 100.0), (400, 4000), (5, 400),
                                         a.INCONCLUSIVE),
    "too few requests are inconclusive": (ErrorRateBound(0.01, 2.0), (0, 4000), (0, 10),
                                          a.INCONCLUSIVE),
    "more errors than requests is an error": (ErrorRateBound(0.01, 2.0), (0, 4000), (5, 4),
                                              a.ERROR),
}


@pytest.mark.parametrize("case", ERRORS)
def test_error_rate(case):
    bound, (se, sn), (ce, cn), expected = ERRORS[case]
    result = a.judge_error_rate(bound, se, sn, ce, cn, 0.95, 50)
    assert result.outcome == expected, result.reason


ENERGY = {
    "same energy passes": ([1.0, 1.02, 0.98, 1.01, 0.99], a.SUCCESSFUL),
    "40% more energy fails": ([1.4, 1.42, 1.38, 1.41, 1.39], a.FAILED),
    "5% more is within the 1.1x margin": ([1.05, 1.07, 1.03, 1.06, 1.04], a.SUCCESSFUL),
    "too few windows are inconclusive": ([1.4, 1.4], a.INCONCLUSIVE),
    "no meter is inconclusive": ([], a.INCONCLUSIVE),
    "a negative reading is an error": ([1.0, -1.0, 1.0, 1.0, 1.0], a.ERROR),
}


@pytest.mark.parametrize("case", ENERGY)
def test_energy(case):
    canary, expected = ENERGY[case]
    stable = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0]
    result = a.judge_energy(EnergyBound(1.1, 5), stable, canary, 0.95)
    assert result.outcome == expected, result.reason


AGREEMENT = {
    "high agreement passes": ((1995, 2000), a.SUCCESSFUL),
    "clearly lower fails": ((900, 1000), a.FAILED),
    "near the minimum is inconclusive": ((995, 1000), a.INCONCLUSIVE),
    "too few comparisons are inconclusive": ((10, 10), a.INCONCLUSIVE),
}


@pytest.mark.parametrize("case", AGREEMENT)
def test_agreement(case):
    (agreed, compared), expected = AGREEMENT[case]
    result = a.judge_agreement(AgreementBound(0.99), agreed, compared, 0.95, 50)
    assert result.outcome == expected, result.reason
    assert result.numbers["compared"] == compared


def test_a_run_takes_the_worst_metric_and_skips_null_ones():
    spec = AnalysisSpec(energy_per_inference=None, agreement=None)
    measurements = a.Measurements(window=3, stage=0, tiers={"edge": a.TierSamples(
        stable=a.VersionSamples(tuple(STABLE), 2000, 0),
        canary=a.VersionSamples(tuple(SLOWER), 400, 0))})
    run = a.analyze(spec, measurements)
    assert [m.metric for m in run.metrics] == ["latency_p95", "error_rate"]
    assert run.verdict == a.FAILED and run.window == 3
    assert run.with_outcome(a.FAILED)[0].metric == "latency_p95"


def test_missing_data_is_never_a_pass():
    empty = a.Measurements(window=0, stage=0, tiers={"edge": a.TierSamples()})
    run = a.analyze(AnalysisSpec(), empty)
    assert run.verdict == a.INCONCLUSIVE
    assert {m.outcome for m in run.metrics} == {a.INCONCLUSIVE}


# --- per tier -----------------------------------------------------------------

LATENCY_ONLY = AnalysisSpec(error_rate=None, energy_per_inference=None, agreement=None)


def lognormal_ms(median_ms, n, seed):
    return tuple(np.random.default_rng(seed).lognormal(math.log(median_ms), 0.3, n))


def version(latencies):
    return a.VersionSamples(latencies, len(latencies), 0)


def test_a_regression_on_one_tier_fails_that_tier_by_name():
    tiers = {
        "edge": a.TierSamples(version(lognormal_ms(10, 2000, 1)), version(lognormal_ms(10, 2000, 2))),
        "regional": a.TierSamples(version(lognormal_ms(5, 300, 3)), version(lognormal_ms(8, 100, 4))),
    }
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=1, tiers=tiers))
    outcomes = {m.label: m.outcome for m in run.metrics}
    assert outcomes == {"latency_p95 on edge": a.SUCCESSFUL,
                        "latency_p95 on regional": a.FAILED}
    assert run.verdict == a.FAILED


def test_each_tier_is_compared_with_its_own_stable_whatever_the_traffic_mix():
    # Same version behaviour on each tier; the canary runs mostly on the slow
    # tier and stable mostly on the fast one. Pooled, the canary looks slower.
    tiers = {
        "edge": a.TierSamples(version(lognormal_ms(5, 1900, 1)), version(lognormal_ms(5, 100, 2))),
        "datacenter": a.TierSamples(version(lognormal_ms(20, 100, 3)),
                                    version(lognormal_ms(20, 1900, 4))),
    }
    measurements = a.Measurements(window=1, stage=2, tiers=tiers)
    assert a.analyze(LATENCY_ONLY, measurements).verdict == a.SUCCESSFUL
    pooled = a.Measurements(window=1, stage=2, tiers={"all": a.TierSamples(
        measurements.pooled("stable"), measurements.pooled("canary"))})
    assert a.analyze(LATENCY_ONLY, pooled).verdict == a.FAILED


def test_tiers_share_the_false_alarm_rate():
    same = a.TierSamples(version(lognormal_ms(10, 300, 5)), version(lognormal_ms(10, 300, 6)))
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=0, tiers={
        "edge": same, "regional": same, "datacenter": a.TierSamples()}))
    # datacenter served nothing this stage: left out; the two others split the alpha
    assert [m.tier for m in run.metrics] == ["edge", "regional"]
    each = 1 - (1 - LATENCY_ONLY.confidence) / 2
    assert [m.numbers["confidence"] for m in run.metrics] == pytest.approx([each, each])


def test_with_no_traffic_anywhere_every_tier_is_inconclusive():
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=0, tiers={
        "edge": a.TierSamples(), "regional": a.TierSamples()}))
    assert [(m.tier, m.outcome) for m in run.metrics] == [
        ("edge", a.INCONCLUSIVE), ("regional", a.INCONCLUSIVE)]
    assert run.verdict == a.INCONCLUSIVE


def test_a_tier_with_stable_traffic_and_no_canary_is_inconclusive_not_skipped():
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=0, tiers={
        "edge": a.TierSamples(version(lognormal_ms(10, 300, 7)), a.VersionSamples())}))
    assert run.verdict == a.INCONCLUSIVE and "too few samples" in run.metrics[0].reason
