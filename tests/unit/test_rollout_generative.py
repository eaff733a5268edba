"""A generative TieredModel: its kind and bounds in the spec, its metrics
(TTFT and TPOT p95, TTFT shift, J/token, errors, agreement) judged by the
same sequential tests as request latency, the budget split over them, and
the rollout engine's decisions on generative measurements."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tiered import names
from tiered.errors import ConfigError
from tiered.rollout import analysis as a
from tiered.rollout import engine as e
from tiered.rollout import spec as s
from tiered.rollout.openapi import crd_validation

SHA = "ab" * 32
GENERATIVE, PREDICTIVE = names.ModelKind.GENERATIVE, names.ModelKind.PREDICTIVE


def document(kind="generative", **analysis) -> dict:
    return {
        "name": "chat",
        "artifact": {"uri": "checkpoints/tinyllama-v2", "sha256": SHA},
        "tiers": {"edge": {}, "regional": {}},
        "kind": kind,
        "rollout": {
            "stages": [{"name": "edge-5", "weights": {"edge": 5}, "min_requests": 300,
                        "min_duration_s": 60, "max_duration_s": 600},
                       {"name": "all", "weights": {"edge": 50, "regional": 50},
                        "min_requests": 300, "min_duration_s": 60, "max_duration_s": 600}],
            "analysis": {"agreement": {"min": 0.95},
                         "energy_per_token": {"max_ratio": 1.1, "min_windows": 3},
                         **analysis},
        },
    }


# --- the spec -------------------------------------------------------------------

def test_kind_defaults_to_predictive_and_generative_is_said():
    plain = document()
    del plain["kind"]
    assert s.load_tiered_model(plain).kind == PREDICTIVE
    assert s.load_tiered_model(document()).kind == GENERATIVE
    with pytest.raises(ConfigError, match="kind: 'chatty' is not one of predictive, generative"):
        s.load_tiered_model(document(kind="chatty"))


def test_generative_bounds_are_written_camel_case_and_read_from_v1alpha1():
    flat = document(ttft_p95={"max_ratio": 1.2, "max_ms": 400.0}, tpot_p95={"max_ratio": 1.1})
    resource = s.as_resource(flat)
    analysis = resource["spec"]["rollout"]["analysis"]
    assert analysis["ttftP95"] == {"maxRatio": 1.2, "maxMilliseconds": 400.0}
    assert analysis["tpotP95"] == {"maxRatio": 1.1}
    assert analysis["energyPerToken"] == {"maxRatio": 1.1, "minWindows": 3}
    assert resource["spec"]["kind"] == "generative"
    current = s.load_tiered_model(resource)
    old = {"apiVersion": "tiered.dev/v1alpha1", "kind": "TieredModel",
           "metadata": {"name": "chat"}, "spec": {k: v for k, v in flat.items() if k != "name"}}
    assert s.load_tiered_model(old) == current
    bounds = current.rollout.analysis
    assert bounds.ttft_p95 == s.LatencyBound(1.2, 400.0)
    assert bounds.tpot_p95 == s.LatencyBound(1.1)
    assert bounds.ttft_shift == s.ShiftBound()  # the default: on


def test_each_kind_is_judged_on_its_own_metrics_and_ignores_the_others():
    analysis = s.AnalysisSpec(latency_p99=s.LatencyBound())
    assert list(analysis.judged(GENERATIVE)) == [
        "ttft_p95", "ttft_shift", "tpot_p95", "error_rate", "energy_per_token", "agreement"]
    assert list(analysis.judged(PREDICTIVE)) == [
        "latency_p95", "latency_p99", "latency_shift", "error_rate", "energy_per_inference",
        "agreement"]
    assert list(s.AnalysisSpec(tpot_p95=None, energy_per_token=None).judged(GENERATIVE)) == [
        "ttft_p95", "ttft_shift", "error_rate", "agreement"]


def test_a_kind_with_every_one_of_its_metrics_null_is_refused():
    nulls = {"ttft_p95": None, "ttft_shift": None, "tpot_p95": None, "error_rate": None,
             "energy_per_token": None, "agreement": None}
    with pytest.raises(ConfigError, match="every metric a generative model is judged on"):
        s.load_tiered_model(document(**nulls))
    # The same analysis judges a predictive model on its request latency.
    assert s.load_tiered_model(document(kind="predictive", **nulls)).kind == PREDICTIVE


def test_the_crd_declares_kind_and_the_generative_bounds():
    spec = crd_validation()["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["kind"]["enum"] == ["predictive", "generative", "vision-language"]
    assert spec["properties"]["kind"]["default"] == "predictive"
    analysis = spec["properties"]["rollout"]["properties"]["analysis"]["properties"]
    assert set(analysis["ttftP95"]["properties"]) == {"maxRatio", "maxMilliseconds"}
    assert analysis["tpotP95"]["nullable"] is True
    assert "minWindows" in analysis["energyPerToken"]["properties"]
    assert analysis["ttftShift"]["default"] == {"maxRatio": 1.05}


# --- the budget -----------------------------------------------------------------

def test_the_budget_counts_the_generative_tests():
    analysis = s.AnalysisSpec(ttft_p95=s.LatencyBound(1.1, max_ms=300))
    # ttft p95 + its max_ms, ttft shift, tpot p95, error ratio + its max, J/token
    assert a.tests_per_tier(analysis, GENERATIVE) == 7
    # predictive: p95, shift, error ratio + max, J/inference: unchanged by the new fields
    assert a.tests_per_tier(analysis, PREDICTIVE) == 5
    stages = [s.Stage("edge", {"edge": 5}), s.Stage("two", {"edge": 50, "regional": 50})]
    assert a.rollout_tests(analysis, stages, GENERATIVE) == (7 + 1) + (14 + 1)


# --- the analysis ---------------------------------------------------------------

RNG = np.random.default_rng(18)
ALPHA = 0.0005


def lognormal(median_ms: float, n: int, sigma: float = 0.4) -> tuple[float, ...]:
    return tuple(RNG.lognormal(math.log(median_ms), sigma, n))


def slow_tail(values, share=0.1, factor=1.5) -> tuple[float, ...]:
    """The slowest `share` of `values` `factor` times slower, the rest as they were."""
    cut = np.quantile(values, 1 - share)
    return tuple(v * factor if v > cut else v for v in values)


def windows(level: float, n: int = 20) -> tuple[float, ...]:
    return tuple(level * (1.0 + 0.01 * math.sin(k)) for k in range(n))


STABLE = a.VersionSamples(requests=8000, errors=8, ttft_ms=lognormal(120, 3000),
                          tpot_ms=lognormal(15, 3000, 0.2), output_tokens=400_000,
                          joules_per_token=windows(0.02), energy_source="nvml")


def canary(**changes) -> a.VersionSamples:
    fields = dict(requests=1500, errors=1, ttft_ms=lognormal(120, 1500),
                  tpot_ms=lognormal(15, 1500, 0.2), output_tokens=75_000,
                  joules_per_token=windows(0.02), energy_source="nvml")
    return a.VersionSamples(**{**fields, **changes})


def run(canary_samples, kind=GENERATIVE, analysis=None, compared=600, agreed=600):
    return a.analyze(analysis or s.AnalysisSpec(agreement=s.AgreementBound(0.95)),
                     a.Measurements(1, 0, {"edge": a.TierSamples(STABLE, canary_samples)},
                                    shadow_compared=compared, shadow_agreed=agreed),
                     tests=40, kind=kind)


def outcomes(result: a.AnalysisRun) -> dict[str, str]:
    return {m.metric: m.outcome for m in result.metrics}


OK = a.SUCCESSFUL
GENERATIVE_CASES = {
    # canary -> the metrics that fail (every other one passes)
    "unchanged": (canary(), set()),
    "TPOT 30% slower": (canary(tpot_ms=tuple(1.3 * v for v in canary().tpot_ms)),
                        {"tpot_p95"}),
    "slowest 10% of TTFT x1.5, median unchanged": (canary(ttft_ms=slow_tail(canary().ttft_ms)),
                                                   {"ttft_p95"}),
    "every TTFT 30% slower": (canary(ttft_ms=tuple(1.3 * v for v in canary().ttft_ms)),
                              {"ttft_p95", "ttft_shift"}),
    "J/token +30%": (canary(joules_per_token=windows(0.026)), {"energy_per_token"}),
    "errors 0.1% -> 2%": (canary(errors=30), {"error_rate"}),
}


@pytest.mark.parametrize("case", GENERATIVE_CASES)
def test_generative_metrics_catch_their_regression_and_only_it(case):
    samples, failing = GENERATIVE_CASES[case]
    result = run(samples)
    seen = outcomes(result)
    assert set(seen) == {"ttft_p95", "ttft_shift", "tpot_p95", "error_rate", "energy_per_token",
                         "agreement"}
    assert {m for m, o in seen.items() if o == a.FAILED} == failing, result.summary()
    assert all(o == OK for m, o in seen.items() if m not in failing), result.summary()


def test_a_failed_metric_names_ttft_or_tpot_and_its_numbers():
    result = run(canary(tpot_ms=tuple(1.3 * v for v in canary().tpot_ms)))
    (tpot,) = result.with_outcome(a.FAILED)
    assert tpot.label == "tpot_p95 on edge"
    assert tpot.reason.startswith("canary TPOT p95 above 1.05x stable's: ")
    assert "canary token intervals" in tpot.reason
    assert tpot.numbers["p95_ratio"] == pytest.approx(1.3, rel=0.08)
    assert "tpot_p95 on edge Failed: canary TPOT p95" in result.summary()
    ttft = run(canary(ttft_ms=slow_tail(canary().ttft_ms))).with_outcome(a.FAILED)[0]
    assert ttft.reason.startswith("canary TTFT p95 above") and "first tokens" in ttft.reason


def test_missing_token_telemetry_is_inconclusive_never_a_pass():
    # Requests were counted but no agent reported a Generation: TTFT, TPOT
    # and J/token have nothing to stand on.
    bare = a.VersionSamples(requests=1500, errors=1)
    result = a.analyze(s.AnalysisSpec(agreement=None), a.Measurements(
        1, 0, {"edge": a.TierSamples(a.VersionSamples(requests=8000, errors=8), bare)}),
        tests=40, kind=GENERATIVE)
    seen = outcomes(result)
    assert result.verdict == a.INCONCLUSIVE
    for metric in ("ttft_p95", "ttft_shift", "tpot_p95", "energy_per_token"):
        assert seen[metric] == a.INCONCLUSIVE, result.summary()
    assert seen["error_rate"] == OK
    assert "no J/token windows yet from either version (need 5 each, minWindows)" in next(
        m.reason for m in result.metrics if m.metric == "energy_per_token")


def test_modeled_j_per_token_is_reported_not_judged_unless_allowed():
    costly = canary(joules_per_token=windows(0.026), energy_source="model")
    stable = a.VersionSamples(**{**STABLE.__dict__, "energy_source": "model"})
    m = a.Measurements(1, 0, {"edge": a.TierSamples(stable, costly)})
    judged = a.analyze(s.AnalysisSpec(agreement=None), m, tests=40, kind=GENERATIVE)
    energy = next(r for r in judged.metrics if r.metric == "energy_per_token")
    assert energy.outcome == a.NOT_JUDGED and judged.verdict == OK
    assert energy.reason.startswith("the figures are not measurements")
    assert "energyPerToken.allowModeled" in energy.reason and "J/token" in energy.reason
    allowed = s.AnalysisSpec(agreement=None, energy_per_token=s.EnergyBound(allow_modeled=True))
    energy = next(r for r in a.analyze(allowed, m, tests=40, kind=GENERATIVE).metrics
                  if r.metric == "energy_per_token")
    assert energy.outcome == a.FAILED and "source model, estimate" in energy.reason


def test_greedy_disagreement_fails_a_generative_canary():
    assert outcomes(run(canary(), compared=600, agreed=500))["agreement"] == a.FAILED


def test_a_predictive_model_is_not_judged_on_tokens_nor_a_generative_on_requests():
    slow_tokens = canary(tpot_ms=tuple(2 * v for v in canary().tpot_ms))
    assert "tpot_p95" not in outcomes(run(slow_tokens, kind=PREDICTIVE))
    generative = outcomes(run(canary()))
    assert not {"latency_p95", "latency_shift", "energy_per_inference"} & set(generative)


# --- the engine -----------------------------------------------------------------

SPEC = s.load_tiered_model(document())


def measurements(samples: a.VersionSamples, window=1) -> a.Measurements:
    return a.Measurements(window, 0, {"edge": a.TierSamples(STABLE, samples)},
                          shadow_compared=600, shadow_agreed=600)


def decide(samples: a.VersionSamples) -> e.Decision:
    return e.decide(SPEC, e.start(SPEC, 1, 2, 0.0), measurements(samples), now=120.0)


def test_a_canary_30_percent_slower_per_token_is_rolled_back_on_tpot_p95():
    decision = decide(canary(tpot_ms=tuple(1.3 * v for v in canary().tpot_ms)))
    assert decision.action == names.Action.ROLLBACK
    assert "tpot_p95 on edge: canary TPOT p95 above 1.05x" in decision.reason
    # The budget is the rollout's: every generative test of both stages.
    assert decision.analysis.metrics[0].numbers["tests"] == a.rollout_tests(
        SPEC.rollout.analysis, SPEC.rollout.stages, GENERATIVE) == (6 + 1) + (12 + 1)


def test_a_slower_ttft_tail_alone_is_caught_by_ttft_p95():
    decision = decide(canary(ttft_ms=slow_tail(canary().ttft_ms)))
    assert decision.action == names.Action.ROLLBACK
    assert "ttft_p95 on edge" in decision.reason and "tpot" not in decision.reason


def test_an_unchanged_generative_canary_advances():
    decision = decide(canary())
    assert decision.action == names.Action.ADVANCE, decision.reason


def test_no_token_telemetry_holds_and_then_follows_on_undecided():
    bare = a.VersionSamples(requests=1500, errors=1)
    decision = decide(bare)
    assert decision.action == names.Action.HOLD
    assert "analysis inconclusive" in decision.reason and "ttft_p95 on edge" in decision.reason
    late = e.decide(SPEC, e.start(SPEC, 1, 2, 0.0), measurements(bare), now=600.0)
    assert late.action == names.Action.PAUSE and "undecided" in late.reason
    assert "ttft_p95 on edge: no canary samples yet" in late.reason
    strict = s.load_tiered_model({**document(), "rollout": {
        **document()["rollout"], "on_undecided": "rollback"}})
    late = e.decide(strict, e.start(strict, 1, 2, 0.0), measurements(bare), now=600.0)
    assert late.action == names.Action.ROLLBACK and "undecided" in late.reason


def test_looks_of_an_unchanged_canary_never_roll_it_back_and_a_slower_one_is_caught():
    """A small simulation: a stage looked at every 10 s while samples grow,
    over seeds; the unchanged canary advances, the TPOT +30% one is rolled
    back within the stage."""
    def rollout(seed: int, tpot_factor: float) -> tuple[str, str]:
        rng = np.random.default_rng(seed)
        status = e.start(SPEC, 1, 2, 0.0)
        stable_ttft, stable_tpot = [], []
        canary_ttft, canary_tpot = [], []
        for look in range(1, 61):  # to max_duration_s
            # per 10 s: 90 stable and 10 canary requests, a J/token window each
            stable_ttft += list(rng.lognormal(math.log(120), 0.4, 90))
            stable_tpot += list(rng.lognormal(math.log(15), 0.2, 90))
            canary_ttft += list(rng.lognormal(math.log(120), 0.4, 10))
            canary_tpot += list(tpot_factor * rng.lognormal(math.log(15), 0.2, 10))
            energy = tuple(rng.lognormal(math.log(0.02), 0.05, look))
            stable = a.VersionSamples(requests=90 * look, ttft_ms=tuple(stable_ttft[-4000:]),
                                      tpot_ms=tuple(stable_tpot[-4000:]),
                                      joules_per_token=energy, energy_source="nvml")
            canary_samples = a.VersionSamples(requests=10 * look, ttft_ms=tuple(canary_ttft),
                                              tpot_ms=tuple(canary_tpot),
                                              joules_per_token=energy[::-1],
                                              energy_source="nvml")
            m = a.Measurements(look, 0, {"edge": a.TierSamples(stable, canary_samples)},
                               shadow_compared=10 * look, shadow_agreed=10 * look)
            decision = e.decide(SPEC, status, m, now=10.0 * look)
            status = decision.status
            if decision.action != names.Action.HOLD:
                return decision.action, decision.reason
        return names.Action.HOLD, decision.reason

    for seed in range(8):
        assert rollout(seed, 1.0)[0] == names.Action.ADVANCE
        action, reason = rollout(seed, 1.3)
        assert action == names.Action.ROLLBACK and "tpot_p95 on edge" in reason, reason
