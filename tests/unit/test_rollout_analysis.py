"""Canary analysis: the statistics against known values (and scipy), each
metric's outcome table, the false-rollback budget, and that every test keeps
its share of it however often it is looked at."""

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
    ShiftBound,
    Stage,
)

try:
    from scipy import stats
except ImportError:  # scipy is only a cross-check
    stats = None

ALPHA = 0.001  # one test's share, about what a three-stage rollout gives each


# --- statistics ---------------------------------------------------------------

def test_mann_whitney_matches_a_hand_computed_value():
    # Every x beats every y: U = 6; mean 3, variance 3*2/12*6 = 3.
    test = a.mann_whitney_greater([3, 4, 5], [1, 2])
    assert test.u == 6
    assert test.z == pytest.approx((6 - 3 - 0.5) / math.sqrt(3))
    assert test.p_value == pytest.approx(0.07446, abs=1e-4)
    assert test.effective_samples == pytest.approx(6 / 5)


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
    for xs, ys in ((x, y), (rng.lognormal(0, 1, 300), rng.lognormal(0.1, 1, 500))):
        ours = a.mann_whitney_greater(xs, ys)
        theirs = stats.mannwhitneyu(xs, ys, alternative="greater", method="asymptotic")
        assert ours.u == pytest.approx(theirs.statistic)
        assert ours.p_value == pytest.approx(theirs.pvalue, rel=1e-9)


def test_quantile_sorted_interpolates_as_numpy():
    values = np.sort(np.random.default_rng(3).lognormal(0, 1, 101))
    for q in (0.0, 0.5, 0.95, 0.99, 1.0):
        assert a.quantile_sorted(values, q) == pytest.approx(np.quantile(values, q))


def test_binomial_e_value_grows_with_evidence_and_stays_small_without():
    # Against "rate <= 5%": 5 of 100 is no evidence, 20 of 100 is strong.
    assert a.binomial_log_e(5, 100, 0.05) < 0
    assert a.binomial_log_e(20, 100, 0.05) > math.log(1 / ALPHA)
    # Vectorized, and monotone in the count.
    log_e = a.binomial_log_e(np.arange(0, 30), 100, 0.05)
    assert np.all(np.diff(log_e) > 0)
    # The other side: against "rate >= 99%", 90 of 100 is strong evidence.
    assert a.binomial_log_e(90, 100, 0.99, above=False) > math.log(1 / ALPHA)
    assert a.binomial_log_e(100, 100, 0.99, above=False) < 0


def test_binomial_e_value_is_an_average_of_likelihood_ratios():
    x, n, rate = 7, 40, 0.1
    odds = np.geomspace(1.1, 100.0, 24)
    alternatives = odds * rate / (1 - rate + odds * rate)
    ratios = (alternatives / rate) ** x * ((1 - alternatives) / (1 - rate)) ** (n - x)
    assert a.binomial_log_e(x, n, rate) == pytest.approx(math.log(ratios.mean()))


def test_normal_mixture_e_value_matches_its_closed_form_and_needs_information():
    z, v, rho = 4.0, 500.0, 100.0
    s = z * math.sqrt(v)
    closed = (2 * math.sqrt(rho / (v + rho)) * math.exp(s * s / (2 * (v + rho)))
              * 0.5 * math.erfc(-s / math.sqrt(v + rho) / math.sqrt(2)))
    assert a.normal_log_e(z, v, rho) == pytest.approx(math.log(closed))
    # The same z is weaker evidence with little information behind it.
    assert a.normal_log_e(4.0, 5, rho) < a.normal_log_e(4.0, 500, rho)
    assert a.p_value(a.normal_log_e(-50.0, 500, rho)) == 1.0  # far left: no evidence, no error


def test_quantile_upper_rank_bounds_the_quantile_and_needs_enough_samples():
    assert a.quantile_upper_rank(100, 0.95, ALPHA) is None  # 100 samples cannot bound a p95
    rank = a.quantile_upper_rank(4000, 0.95, ALPHA)
    assert 3800 < rank < 3900
    # At every look of a growing sample, X_(rank) stays above the true p95
    # (that of the standard lognormal) in all but a small share of sequences.
    true_p95 = math.exp(1.6448536)
    rng = np.random.default_rng(5)
    below = 0
    for _ in range(200):
        values = rng.lognormal(0, 1, 4000)
        for n in range(500, 4001, 250):
            rank = a.quantile_upper_rank(n, 0.95, 0.05)
            if np.sort(values[:n])[rank - 1] < true_p95:
                below += 1
                break
    assert below <= 200 * 0.05


# --- the budget ---------------------------------------------------------------

def test_every_test_of_every_stage_shares_the_budget():
    spec = AnalysisSpec(latency_p95=LatencyBound(1.1, max_ms=50))
    # p95 + its max_ms, shift, error ratio + its max, energy
    assert a.tests_per_tier(spec) == 6
    stages = [Stage("edge", {"edge": 5}), Stage("two", {"edge": 50, "regional": 50}),
              Stage("none", {"edge": 0, "regional": 50})]
    assert a.rollout_tests(spec, stages) == (6 + 1) + (12 + 1) + (6 + 1)
    lean = AnalysisSpec(latency_p95=None, latency_shift=None, error_rate=None,
                        energy_per_inference=None)
    assert a.rollout_tests(lean, stages) == 3  # agreement, once a stage


def test_a_run_gives_each_test_its_share_and_says_so():
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=0, tiers={
        "edge": a.TierSamples(version(lognormal_ms(10, 300, 5)),
                              version(lognormal_ms(10, 300, 6)))}), tests=40)
    for m in run.metrics:
        assert m.numbers["alpha"] == pytest.approx((1 - LATENCY_ONLY.confidence) / 40)
        assert m.numbers["tests"] == 40
        assert m.numbers["alpha_rollout"] == pytest.approx(1 - LATENCY_ONLY.confidence)


# --- metrics ------------------------------------------------------------------

def test_worst_outcome_order():
    assert a.worst([a.SUCCESSFUL, a.INCONCLUSIVE, a.ERROR]) == a.ERROR
    assert a.worst([a.ERROR, a.FAILED]) == a.FAILED
    assert a.worst([a.SUCCESSFUL, a.INCONCLUSIVE]) == a.INCONCLUSIVE
    assert a.worst([]) == a.INCONCLUSIVE  # nothing judged is not a pass
    # A metric shown but not judged neither holds nor fails: it counts as Successful.
    assert a.worst([a.NOT_JUDGED, a.SUCCESSFUL]) == a.SUCCESSFUL
    assert a.worst([a.NOT_JUDGED]) == a.SUCCESSFUL
    assert a.worst([a.NOT_JUDGED, a.INCONCLUSIVE]) == a.INCONCLUSIVE


def lognormal(rng, median_ms, n, sigma=0.5):
    return rng.lognormal(math.log(median_ms), sigma, n)


def slow_tail(values, factor, median_ms, sigma=0.5):
    """The slowest 10% of a lognormal sample `factor` times slower; median unchanged."""
    cut = median_ms * math.exp(sigma * 1.2815516)
    return np.where(values > cut, values * factor, values)


R = np.random.default_rng(7)
STABLE = lognormal(R, 20, 4000)
SAME = lognormal(R, 20, 2000)
SLOWER = lognormal(R, 26, 2000)  # 30% slower
TWICE = lognormal(R, 40, 2000)  # twice as slow
TAIL = slow_tail(lognormal(R, 20, 2000), 1.5, 20)  # p95 x1.5, median as stable's
FEW = lognormal(R, 20, 10)

# The tail test's threshold is max_ratio x an upper confidence bound of
# stable's p95 (about 10% above it with 4000 samples at this alpha), so a
# canary 30% slower everywhere is the location test's to catch, not the tail's.
P95 = {
    # name: (bound, canary samples, expected outcome)
    "unchanged canary passes": (LatencyBound(1.05), SAME, a.SUCCESSFUL),
    "a slower tail fails, the median unchanged": (LatencyBound(1.15), TAIL, a.FAILED),
    "twice as slow fails": (LatencyBound(1.05), TWICE, a.FAILED),
    "30% slower is within a 1.5x margin": (LatencyBound(1.5), SLOWER, a.SUCCESSFUL),
    "too few samples are inconclusive": (LatencyBound(1.05), FEW, a.INCONCLUSIVE),
    "no samples are inconclusive": (LatencyBound(1.05), np.array([]), a.INCONCLUSIVE),
    "p95 clearly above max_ms fails": (LatencyBound(1.5, max_ms=30), SAME, a.FAILED),
    "p95 near max_ms is inconclusive": (
        LatencyBound(1.5, max_ms=float(np.quantile(SAME, 0.95)) * 0.99), SAME, a.INCONCLUSIVE),
    "p95 well below max_ms passes": (LatencyBound(1.05, max_ms=200), SAME, a.SUCCESSFUL),
    "a NaN is an error": (LatencyBound(1.05), np.r_[SAME, np.nan], a.ERROR),
}


@pytest.mark.parametrize("case", P95)
def test_latency_p95(case):
    bound, canary, expected = P95[case]
    result = a.judge_latency_quantile(0.95, bound, STABLE, canary, ALPHA, 50)
    assert result.metric == "latency_p95"
    assert result.outcome == expected, result.reason
    if expected in (a.SUCCESSFUL, a.FAILED):
        for key in ("n_canary", "n_stable", "p95_canary_ms", "p95_stable_ms",
                    "p95_stable_upper_ms", "threshold_ms", "canary_above",
                    "expected_share_above", "p_value", "alpha", "max_ratio"):
            assert key in result.numbers, key
        assert result.numbers["threshold_ms"] == pytest.approx(
            bound.max_ratio * result.numbers["p95_stable_upper_ms"])


def test_the_tail_test_sees_the_tail_the_location_test_does_not():
    # The background of the issue: a location test named for the tail.
    p95 = a.judge_latency_quantile(0.95, LatencyBound(1.15), STABLE, TAIL, ALPHA, 50)
    shift = a.judge_latency_shift(ShiftBound(1.05), STABLE, TAIL, ALPHA, 50)
    assert (p95.outcome, shift.outcome) == (a.FAILED, a.SUCCESSFUL)
    assert p95.numbers["p95_ratio"] == pytest.approx(1.5, rel=0.1)
    assert shift.numbers["median_ratio"] == pytest.approx(1.0, rel=0.05)


def test_a_tail_test_short_of_stable_samples_says_how_many_it_needs():
    # 100 samples meet minSamples 50 but cannot bound a p95 at this share.
    rng = np.random.default_rng(3)
    stable, canary = lognormal(rng, 20, 100), lognormal(rng, 20, 100)
    result = a.judge_latency_quantile(0.95, LatencyBound(1.05), stable, canary, ALPHA, 50)
    need = a.least_samples_to_bound(0.95, ALPHA / 2)
    assert result.outcome == a.INCONCLUSIVE
    assert f"too few stable samples to bound its p95 at this confidence: 100, need {need}" \
        in result.reason
    assert a.quantile_upper_rank(need - 1, 0.95, ALPHA / 2) is None
    assert a.quantile_upper_rank(need, 0.95, ALPHA / 2) is not None
    assert result.numbers["stable_samples_to_bound"] == need


def test_p99_is_judged_at_its_own_quantile():
    result = a.judge_latency_quantile(0.99, LatencyBound(1.1), STABLE, TWICE, ALPHA, 50)
    assert result.metric == "latency_p99" and result.outcome == a.FAILED
    assert result.numbers["expected_share_above"] == pytest.approx(0.01)
    assert "p99_canary_ms" in result.numbers


SHIFT = {
    "unchanged canary passes": (ShiftBound(1.05), SAME, a.SUCCESSFUL),
    "30% slower canary fails": (ShiftBound(1.05), SLOWER, a.FAILED),
    "30% slower is within a 1.5x margin": (ShiftBound(1.5), SLOWER, a.SUCCESSFUL),
    "too few samples are inconclusive": (ShiftBound(1.05), FEW, a.INCONCLUSIVE),
    "a negative latency is an error": (ShiftBound(1.05), np.r_[SAME, -1.0], a.ERROR),
}


@pytest.mark.parametrize("case", SHIFT)
def test_latency_shift(case):
    bound, canary, expected = SHIFT[case]
    result = a.judge_latency_shift(bound, STABLE, canary, ALPHA, 50)
    assert result.outcome == expected, result.reason
    if expected in (a.SUCCESSFUL, a.FAILED):
        for key in ("median_stable_ms", "median_canary_ms", "u", "z", "effective_samples",
                    "p_value", "alpha"):
            assert key in result.numbers, key


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
    result = a.judge_error_rate(bound, se, sn, ce, cn, ALPHA, 50)
    assert result.outcome == expected, result.reason


def test_the_error_test_weighs_the_canary_share_of_all_errors():
    result = a.judge_error_rate(ErrorRateBound(None, 2.0), 20, 4000, 20, 400, ALPHA, 50)
    # With no regression beyond 2x, at most 2 * 400 / (2 * 400 + 4000) of the errors.
    assert result.numbers["canary_share_of_errors_max"] == pytest.approx(800 / 4800)
    assert "20 of the 40 errors are the canary's" in result.reason


def test_client_errors_are_shown_and_never_judged():
    """100 bad requests to the canary (refused, client errors) beside 400
    answered: the error test sees no failure, and says what it left out."""
    result = a.judge_error_rate(ErrorRateBound(0.02, 2.0), 0, 4000, 0, 400, ALPHA, 50,
                                client_errors=(3, 100))
    assert result.outcome == a.SUCCESSFUL, result.reason
    assert "(client errors, not judged: canary 100, stable 3)" in result.reason
    assert (result.numbers["client_errors_canary"], result.numbers["errors_canary"]) == (100, 0)


# name: (stable errors/requests, canary errors/requests, words in the reason, words not in it)
ERROR_REASONS = {
    "no errors says so, not a share of none": (
        (0, 4000), (0, 400), "no errors in 400 canary and 4000 stable requests", "0 of 0"),
    "no canary requests yet": ((3, 4000), (0, 0), "no canary requests yet (stable 4000; need 50 "
                               "each, minSamples)", "too few"),
    "too few canary requests": ((3, 4000), (0, 10), "too few requests: canary 10, stable 4000, "
                                "need 50 each, minSamples", "no canary"),
    "errors on stable only": ((8, 4000), (0, 400), "0 of the 8 errors are the canary's",
                              "no errors"),
}


@pytest.mark.parametrize("case", ERROR_REASONS)
def test_error_rate_reasons_say_what_is_true(case):
    (se, sn), (ce, cn), said, unsaid = ERROR_REASONS[case]
    result = a.judge_error_rate(ErrorRateBound(0.05, 2.0), se, sn, ce, cn, ALPHA, 50)
    assert said in result.reason and unsaid not in result.reason, result.reason


def windows(centre, n=20, spread=0.01):
    return [centre * (1 + spread * (k - n / 2) / n) for k in range(n)]


ENERGY = {
    "same energy passes": (windows(1.0), a.SUCCESSFUL),
    "40% more energy fails": (windows(1.4), a.FAILED),
    "5% more is within the 1.1x margin": (windows(1.05), a.SUCCESSFUL),
    "too few windows are inconclusive": ([1.4, 1.4], a.INCONCLUSIVE),
    "no meter is inconclusive": ([], a.INCONCLUSIVE),
    "a negative reading is an error": ([1.0, -1.0, 1.0, 1.0, 1.0], a.ERROR),
}


@pytest.mark.parametrize("case", ENERGY)
def test_energy(case):
    canary, expected = ENERGY[case]
    result = a.judge_energy(EnergyBound(1.1, 5), windows(1.0), canary, ALPHA, "nvml", "nvml")
    assert result.outcome == expected, result.reason


def test_a_few_windows_cannot_fail_energy_whatever_they_show():
    # Five windows a version: even a canary 40% costlier everywhere is no
    # evidence at a small share; the stage holds for more windows instead.
    result = a.judge_energy(EnergyBound(1.1, 5), windows(1.0, 5), windows(1.4, 5), ALPHA,
                            "rapl", "rapl")
    assert result.outcome == a.SUCCESSFUL and result.numbers["p_value"] > ALPHA


MEASURED, MODELED = EnergyBound(1.1, 5), EnergyBound(1.1, 5, allow_modeled=True)
# (bound, stable source, canary source, canary windows): outcome, judged, measured, in reason
ENERGY_SOURCES = {
    "nvml both: a 30% regression fails": (
        MEASURED, "nvml", "nvml", windows(1.3), a.FAILED, 1.0, 1.0, "source nvml"),
    "rapl both: an unchanged canary passes": (
        MEASURED, "rapl", "rapl", windows(1.0), a.SUCCESSFUL, 1.0, 1.0, "source rapl"),
    "model both: a 30% regression is not judged by default": (
        MEASURED, "model", "model", windows(1.3), a.NOT_JUDGED, 0.0, 0.0,
        "set energyPerInference.allowModeled: true"),
    "model both with allow_modeled: the 30% regression fails": (
        MODELED, "model", "model", windows(1.3), a.FAILED, 1.0, 0.0, "model, estimate"),
    "unknown source is not a measurement": (
        MEASURED, "", "", windows(1.3), a.NOT_JUDGED, 0.0, 0.0, "source unknown"),
    "nvml against model: sources differ": (
        MEASURED, "nvml", "model", windows(1.3), a.NOT_JUDGED, 0.0, 0.0, "different sources"),
    "nvml against rapl: sources differ even with allow_modeled": (
        MODELED, "nvml", "rapl", windows(1.3), a.NOT_JUDGED, 0.0, 1.0, "different sources"),
    "one measured side without figures yet waits": (
        MEASURED, "nvml", "nvml", [], a.INCONCLUSIVE, 1.0, 1.0,
        "no canary J/inference windows yet (stable 20; need 5 each, minWindows)"),
    "a modeled side is not judged before the other has figures": (
        MEASURED, "model", "", [], a.NOT_JUDGED, 0.0, 0.0, "stable model, estimate, canary no "
        "figure yet"),
}


@pytest.mark.parametrize("case", ENERGY_SOURCES)
def test_energy_is_judged_only_on_measurements_of_one_source(case):
    bound, stable_source, canary_source, canary, outcome, judged, measured, said = \
        ENERGY_SOURCES[case]
    result = a.judge_energy(bound, windows(1.0), canary, ALPHA, stable_source, canary_source)
    assert result.outcome == outcome, result.reason
    assert (result.numbers["judged"], result.numbers["measured"]) == (judged, measured)
    assert said in result.reason


def test_an_unjudged_estimate_still_reports_its_comparison():
    result = a.judge_energy(EnergyBound(1.1, 5), windows(1.0), windows(1.3), ALPHA,
                            "model", "model")
    assert result.outcome == a.NOT_JUDGED
    assert result.reason.startswith("the figures are not measurements (set "
                                    "energyPerInference.allowModeled: true")
    assert "(model, estimate), it would be failed: canary uses more than 1.1x" in result.reason
    assert result.numbers["ratio"] == pytest.approx(1.3) and result.numbers["p_value"] < ALPHA


def test_analyze_passes_each_versions_energy_source_to_the_judge():
    spec = AnalysisSpec(latency_p95=None, latency_shift=None, error_rate=None, agreement=None)
    def tier(source):
        return a.TierSamples(stable=a.VersionSamples((), 100, 0, windows(1.0), source),
                             canary=a.VersionSamples((), 100, 0, windows(1.3), source))
    for source, verdict, outcome in (("nvml", a.FAILED, a.FAILED),
                                     ("model", a.SUCCESSFUL, a.NOT_JUDGED)):
        run = a.analyze(spec, a.Measurements(window=1, stage=0, tiers={"edge": tier(source)}),
                        tests=1)
        assert run.verdict == verdict, run.summary()
        assert run.metrics[0].outcome == outcome, run.summary()


def test_pooled_energy_has_one_source_or_none():
    same = a.Measurements(0, 0, {"edge": a.TierSamples(canary=a.VersionSamples(
        joules_per_inference=(1.0,), energy_source="nvml")), "regional": a.TierSamples()})
    assert same.pooled("canary").energy_source == "nvml"
    mixed = a.Measurements(0, 0, {tier: a.TierSamples(canary=a.VersionSamples(
        joules_per_inference=(1.0,), energy_source=source))
        for tier, source in (("edge", "model"), ("regional", "nvml"))})
    assert mixed.pooled("canary").energy_source == ""


AGREEMENT = {
    "high agreement passes": ((1999, 2000), a.SUCCESSFUL),
    "clearly lower fails": ((900, 1000), a.FAILED),
    "near the minimum is inconclusive": ((995, 1000), a.INCONCLUSIVE),
    "too few comparisons are inconclusive": ((10, 10), a.INCONCLUSIVE),
}


@pytest.mark.parametrize("case", AGREEMENT)
def test_agreement(case):
    (agreed, compared), expected = AGREEMENT[case]
    result = a.judge_agreement(AgreementBound(0.99), agreed, compared, ALPHA, 50)
    assert result.outcome == expected, result.reason
    assert result.numbers["compared"] == compared


def test_agreement_not_yet_shown_says_how_many_comparisons_would_show_it():
    result = a.judge_agreement(AgreementBound(0.95), 978, 1000, 0.000152, 50)
    assert result.outcome == a.INCONCLUSIVE
    assert "agreement 0.978 over 1000 shadowed requests: not yet significantly above 0.95" \
        in result.reason
    need = int(result.numbers["shadowed_to_decide"])
    assert f"about {need} would show it if the rate holds" in result.reason
    assert 1000 < need < 2000
    held = round(0.978 * need)  # the same rate over that many: shown
    assert a.judge_agreement(AgreementBound(0.95), held, need, 0.000152, 50).outcome \
        == a.SUCCESSFUL
    # At or below the minimum no count would show it: nothing promised.
    never = a.judge_agreement(AgreementBound(0.95), 950, 1000, 0.000152, 50)
    assert never.outcome == a.INCONCLUSIVE and "would show it" not in never.reason


def test_a_run_takes_the_worst_metric_and_skips_null_ones():
    spec = AnalysisSpec(energy_per_inference=None, agreement=None)
    measurements = a.Measurements(window=3, stage=0, tiers={"edge": a.TierSamples(
        stable=a.VersionSamples(tuple(STABLE), 4000, 0),
        canary=a.VersionSamples(tuple(TWICE), 2000, 0))})
    run = a.analyze(spec, measurements)
    assert [m.metric for m in run.metrics] == ["latency_p95", "latency_shift", "error_rate"]
    assert run.verdict == a.FAILED and run.window == 3
    assert {m.metric for m in run.with_outcome(a.FAILED)} == {"latency_p95", "latency_shift"}


def test_missing_data_is_never_a_pass():
    empty = a.Measurements(window=0, stage=0, tiers={"edge": a.TierSamples()})
    run = a.analyze(AnalysisSpec(), empty)
    assert run.verdict == a.INCONCLUSIVE
    assert {m.outcome for m in run.metrics} == {a.INCONCLUSIVE}


# --- anytime validity ---------------------------------------------------------

def test_each_test_keeps_its_share_over_every_look():
    """An unchanged canary at the very edge of each margin, judged at 30 looks
    of growing data: the share of sequences that ever fail stays within the
    test's alpha. The same looks with a fixed-sample test at alpha would fail
    several times as often."""
    alpha, trials, looks = 0.05, 120, 30
    rng = np.random.default_rng(11)
    failed = dict.fromkeys(("p95", "shift", "errors", "agreement"), 0)
    fixed_sample = 0
    for _ in range(trials):
        stable, canary = rng.lognormal(0, 0.5, 4000), rng.lognormal(0, 0.5, 3000)
        stable_errors, canary_errors = rng.random(12000) < 0.01, rng.random(3000) < 0.01
        agreed = rng.random(3000) < 0.99
        hit = set()
        for k in range(1, looks + 1):
            s, c = stable[:min(4000, 400 * k)], canary[:100 * k]
            if a.judge_latency_quantile(0.95, LatencyBound(1.0), s, c, alpha,
                                        50).outcome == a.FAILED:
                hit.add("p95")
            shift = a.judge_latency_shift(ShiftBound(1.0), s, c, alpha, 50)
            if shift.outcome == a.FAILED:
                hit.add("shift")
            if shift.numbers["z"] > 1.6449:  # what a fixed-sample test at 5% would say
                hit.add("fixed")
            if a.judge_error_rate(ErrorRateBound(None, 1.0), int(stable_errors[:400 * k].sum()),
                                  400 * k, int(canary_errors[:100 * k].sum()), 100 * k, alpha,
                                  50).outcome == a.FAILED:
                hit.add("errors")
            if a.judge_agreement(AgreementBound(0.99), int(agreed[:100 * k].sum()), 100 * k,
                                 alpha, 50).outcome == a.FAILED:
                hit.add("agreement")
        for name in hit - {"fixed"}:
            failed[name] += 1
        fixed_sample += "fixed" in hit
    for name, count in failed.items():
        assert count / trials <= alpha, (name, count)
    assert fixed_sample / trials > 3 * alpha


# --- per tier -----------------------------------------------------------------

LATENCY_ONLY = AnalysisSpec(error_rate=None, energy_per_inference=None, agreement=None)


def lognormal_ms(median_ms, n, seed):
    return tuple(np.random.default_rng(seed).lognormal(math.log(median_ms), 0.3, n))


def version(latencies):
    return a.VersionSamples(latencies, len(latencies), 0)


def test_a_regression_on_one_tier_fails_that_tier_by_name():
    tiers = {
        "edge": a.TierSamples(version(lognormal_ms(10, 2000, 1)),
                              version(lognormal_ms(10, 2000, 2))),
        "regional": a.TierSamples(version(lognormal_ms(5, 1000, 3)),
                                  version(lognormal_ms(8, 300, 4))),
    }
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=1, tiers=tiers))
    outcomes = {m.label: m.outcome for m in run.metrics}
    assert outcomes == {"latency_p95 on edge": a.SUCCESSFUL,
                        "latency_shift on edge": a.SUCCESSFUL,
                        "latency_p95 on regional": a.FAILED,
                        "latency_shift on regional": a.FAILED}
    assert run.verdict == a.FAILED


def test_each_tier_is_compared_with_its_own_stable_whatever_the_traffic_mix():
    # Same version behaviour on each tier; the canary runs mostly on the slow
    # tier and stable mostly on the fast one. Pooled, the canary looks slower.
    tiers = {
        "edge": a.TierSamples(version(lognormal_ms(5, 1900, 1)), version(lognormal_ms(5, 300, 2))),
        "datacenter": a.TierSamples(version(lognormal_ms(20, 300, 3)),
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
    assert [m.tier for m in run.metrics] == ["edge", "edge", "regional", "regional"]
    each = (1 - LATENCY_ONLY.confidence) / (2 * a.tests_per_tier(LATENCY_ONLY))
    assert [m.numbers["alpha"] for m in run.metrics] == pytest.approx([each] * 4)


def test_with_no_traffic_anywhere_every_tier_is_inconclusive():
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=0, tiers={
        "edge": a.TierSamples(), "regional": a.TierSamples()}))
    assert {(m.tier, m.outcome) for m in run.metrics} == {
        ("edge", a.INCONCLUSIVE), ("regional", a.INCONCLUSIVE)}
    assert run.verdict == a.INCONCLUSIVE


def test_a_tier_with_stable_traffic_and_no_canary_is_inconclusive_not_skipped():
    run = a.analyze(LATENCY_ONLY, a.Measurements(window=1, stage=0, tiers={
        "edge": a.TierSamples(version(lognormal_ms(10, 300, 7)), a.VersionSamples())}))
    assert run.verdict == a.INCONCLUSIVE and "no canary samples yet" in run.metrics[0].reason


def test_the_requests_of_a_version_sum_over_tiers():
    m = a.Measurements(window=1, stage=0, tiers={
        "edge": a.TierSamples(a.VersionSamples(requests=5), a.VersionSamples(requests=2)),
        "regional": a.TierSamples(a.VersionSamples(requests=7), a.VersionSamples(requests=3))})
    assert (m.requests("stable"), m.requests("canary")) == (12, 5)


def test_energy_without_figures_on_either_side_names_no_source():
    result = a.judge_energy(MEASURED, [], [], 0.05, "nvml", "nvml")
    assert result.outcome == a.INCONCLUSIVE and "source" not in result.reason
