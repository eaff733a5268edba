"""The rollout engine as decision tables, the manual verbs, weight arithmetic,
and the detection-power simulation against a fixed-threshold check."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tiered.errors import InvalidArgument
from tiered.rollout import analysis as a
from tiered.rollout import engine as e
from tiered.rollout.spec import LatencyBound, RolloutStatus, load_tiered_model

SHA = "cd" * 32


def model(on_failure="rollback", limit=1, **analysis):
    return load_tiered_model({
        "name": "digits",
        "artifact": {"uri": "digits.onnx", "sha256": SHA},
        "tiers": {"edge": {}, "regional": {}, "datacenter": {}},
        "rollout": {
            "stages": [
                {"name": "edge-5", "weights": {"edge": 5}, "min_requests": 300,
                 "min_duration_s": 60, "max_duration_s": 600},
                {"name": "region", "weights": {"edge": 50, "regional": 50},
                 "min_requests": 300, "min_duration_s": 60, "max_duration_s": 600},
            ],
            "analysis": {"energy_per_inference": {"max_ratio": 1.1, "min_windows": 3},
                         "agreement": {"min": 0.95}, "consecutive_failure_limit": limit,
                         **analysis},
            "on_failure": on_failure,
        },
    })


SPEC = model()
R = np.random.default_rng(11)
STABLE_MS = tuple(R.lognormal(math.log(20), 0.5, 2000))
SAME_MS = tuple(R.lognormal(math.log(20), 0.5, 400))
SLOW_MS = tuple(R.lognormal(math.log(30), 0.5, 400))


def measure(window=1, stage=0, canary_ms=SAME_MS, requests=400, errors=0, joules=1.0,
            agreed=400, compared=400):
    return a.Measurements(
        window=window, stage=stage, tiers={"edge": a.TierSamples(
            stable=a.VersionSamples(STABLE_MS, 8000, 8, (1.0, 1.01, 0.99)),
            canary=a.VersionSamples(canary_ms, requests, errors,
                                    (joules, joules * 1.01, joules * 0.99)))},
        shadow_compared=compared, shadow_agreed=agreed)


def status(**changes):
    base = RolloutStatus(stable_version=1, canary_version=2, stage_index=0,
                         phase="Progressing", stage_started_at=1000.0)
    return dataclasses.replace(base, **changes)


# name: (spec, status, measurements, now, expected action, words in the reason)
TABLE = {
    "passing first stage advances": (SPEC, status(), measure(), 1100, e.ADVANCE, "on to stage 2"),
    "passing last stage promotes": (SPEC, status(stage_index=1), measure(stage=1), 1100,
                                    e.PROMOTE, "promoting version 2"),
    "too few canary requests hold": (SPEC, status(), measure(requests=100), 1100, e.HOLD,
                                     "too little data: 100 of 300"),
    "too short holds": (SPEC, status(), measure(), 1030, e.HOLD, "too short: 30 of 60 s"),
    "no measurements hold": (SPEC, status(), None, 1100, e.HOLD, "no measurements"),
    "measurements of another stage hold": (SPEC, status(), measure(stage=1), 1100, e.HOLD,
                                           "no measurements"),
    "too few samples hold (inconclusive)": (SPEC, status(), measure(canary_ms=SAME_MS[:10]),
                                            1100, e.HOLD, "analysis inconclusive"),
    "latency regression rolls back": (SPEC, status(), measure(canary_ms=SLOW_MS), 1100,
                                      e.ROLLBACK, "latency_p95"),
    "latency regression fails fast, before min duration": (
        SPEC, status(), measure(canary_ms=SLOW_MS), 1010, e.ROLLBACK, "latency_p95"),
    "errors roll back": (SPEC, status(), measure(errors=40), 1100, e.ROLLBACK, "error_rate"),
    "energy regression rolls back": (SPEC, status(), measure(joules=1.5), 1100, e.ROLLBACK,
                                     "energy_per_inference"),
    "disagreement rolls back": (SPEC, status(), measure(agreed=300), 1100, e.ROLLBACK,
                                "agreement"),
    "failure pauses when on_failure is pause": (model("pause"), status(),
                                                measure(errors=40), 1100, e.PAUSE,
                                                "on_failure: pause"),
    "one failure of two allowed holds": (model(limit=2), status(), measure(errors=40), 1100,
                                         e.HOLD, "1 of 2 in a row"),
    "second failure in a row rolls back": (
        model(limit=2), status(consecutive_failures=1), measure(window=2, errors=40), 1100,
        e.ROLLBACK, "2 of 2 in a row"),
    "inconclusive past max_duration rolls back": (
        SPEC, status(), measure(canary_ms=SAME_MS[:10]), 1600, e.ROLLBACK,
        "undecided at max_duration_s"),
    "inconclusive past max_duration pauses": (
        model("pause"), status(), measure(canary_ms=SAME_MS[:10]), 1600, e.PAUSE,
        "undecided at max_duration_s"),
    "no data past max_duration rolls back": (SPEC, status(), None, 1600, e.ROLLBACK,
                                             "no measurements"),
    "paused holds": (SPEC, status(phase="Paused", paused=True), measure(), 1100, e.HOLD,
                     "paused"),
    "finished holds": (SPEC, status(phase="RolledBack"), measure(), 1100, e.HOLD,
                       "RolledBack"),
}


@pytest.mark.parametrize("case", TABLE)
def test_decide(case):
    spec, before, measurements, now, action, words = TABLE[case]
    decision = e.decide(spec, before, measurements, now)
    assert decision.action == action, decision.reason
    assert words in decision.reason
    assert decision.status.message == decision.reason


def test_rollback_carries_the_failing_numbers_and_zero_canary_weights():
    decision = e.decide(SPEC, status(), measure(canary_ms=SLOW_MS), 1100)
    assert decision.status.phase == "RolledBack"
    latency = decision.analysis.with_outcome(a.FAILED)[0]
    assert latency.metric == "latency_p95"
    assert latency.numbers["p_value"] < latency.numbers["alpha"]
    assert latency.numbers["n_canary"] == 400
    assert not any(e.canary_weights(SPEC, decision.status).values())


def test_advance_moves_the_weights_and_restarts_the_stage_clock():
    decision = e.decide(SPEC, status(), measure(), 1100)
    assert decision.status.stage_index == 1
    assert decision.status.stage_started_at == 1100
    assert dict(e.canary_weights(SPEC, decision.status)) == {
        "edge": 50.0, "regional": 50.0, "datacenter": 0.0}


def test_promote_makes_the_canary_stable():
    decision = e.decide(SPEC, status(stage_index=1), measure(stage=1), 1100)
    assert decision.status.stable_version == 2
    assert decision.status.canary_version is None
    assert decision.status.phase == "Promoted"
    assert not any(e.canary_weights(SPEC, decision.status).values())


def test_the_same_window_counts_once_toward_the_failure_limit():
    spec = model(limit=2)
    first = e.decide(spec, status(), measure(window=5, errors=40), 1100)
    again = e.decide(spec, first.status, measure(window=5, errors=40), 1110)  # restart
    assert (first.action, again.action) == (e.HOLD, e.HOLD)
    assert again.status.consecutive_failures == 1
    third = e.decide(spec, again.status, measure(window=6, errors=40), 1120)
    assert third.action == e.ROLLBACK


def test_a_passing_window_resets_the_failure_count():
    spec = model(limit=2)
    first = e.decide(spec, status(), measure(window=1, errors=40), 1100)
    passing = e.decide(spec, first.status, measure(window=2, requests=100), 1100)
    assert passing.status.consecutive_failures == 0


def test_decide_is_level_based():
    # The same inputs give the same decision, whatever happened before.
    before, m = status(), measure()
    assert e.decide(SPEC, before, m, 1100) == e.decide(SPEC, before, m, 1100)


def test_hold_asks_to_be_called_again_by_the_next_deadline():
    decision = e.decide(SPEC, status(), measure(), 1050)
    assert decision.requeue_after_s == 10.0


# --- manual verbs -------------------------------------------------------------

VERBS = {
    # name: (verb, status before, expected action, expected phase, stage index after)
    "pause": (e.pause, status(), e.PAUSE, "Paused", 0),
    "pause twice is a no-op": (e.pause, status(phase="Paused", paused=True), e.HOLD,
                               "Paused", 0),
    "resume": (e.resume, status(phase="Paused", paused=True, consecutive_failures=2),
               e.RESUME, "Progressing", 0),
    "resume when running is a no-op": (e.resume, status(), e.HOLD, "Progressing", 0),
    "promote one stage": (e.promote, status(), e.ADVANCE, "Progressing", 1),
    "promote from the last stage": (e.promote, status(stage_index=1), e.PROMOTE,
                                    "Promoted", 1),
    "promote a paused rollout": (e.promote, status(phase="Paused", paused=True),
                                 e.ADVANCE, "Progressing", 1),
    "abort": (e.abort, status(stage_index=1), e.ABORT, "Aborted", 1),
}


@pytest.mark.parametrize("case", VERBS)
def test_manual_verbs(case):
    verb, before, action, phase, stage = VERBS[case]
    decision = verb(SPEC, before, 2000.0)
    assert decision.action == action
    assert decision.status.phase == phase
    assert decision.status.stage_index == stage
    assert decision.status.paused == (phase == "Paused")


def test_resume_restarts_the_stage_clock_and_failure_count():
    decision = e.resume(SPEC, status(phase="Paused", paused=True, consecutive_failures=2), 2000)
    assert decision.status.stage_started_at == 2000
    assert decision.status.consecutive_failures == 0


def test_full_promote_skips_the_remaining_stages():
    decision = e.promote(SPEC, status(), 2000, full=True)
    assert decision.action == e.PROMOTE and decision.status.stable_version == 2


def test_abort_sends_all_traffic_to_stable_and_keeps_the_canary_on_record():
    decision = e.abort(SPEC, status(), 2000)
    assert decision.status.canary_version == 2
    assert not any(e.canary_weights(SPEC, decision.status).values())


@pytest.mark.parametrize("verb", [e.pause, e.resume, e.promote, e.abort])
@pytest.mark.parametrize("phase", ["Promoted", "RolledBack", "Aborted"])
def test_verbs_on_a_finished_rollout_are_refused(verb, phase):
    with pytest.raises(InvalidArgument, match=f"phase: the rollout is {phase}"):
        verb(SPEC, status(phase=phase), 2000)


def test_start_begins_at_stage_zero_and_refuses_the_stable_version():
    begun = e.start(SPEC, 1, 2, 500.0)
    assert (begun.stage_index, begun.phase, begun.stage_started_at) == (0, "Progressing", 500)
    with pytest.raises(InvalidArgument, match="canary_version"):
        e.start(SPEC, 3, 3, 0.0)


# --- weight arithmetic --------------------------------------------------------

WEIGHTS = {
    # name: (status, expected canary percent per tier)
    "first stage": (status(), {"edge": 5, "regional": 0, "datacenter": 0}),
    "second stage": (status(stage_index=1), {"edge": 50, "regional": 50, "datacenter": 0}),
    "paused keeps the stage's weights": (status(phase="Paused", paused=True),
                                         {"edge": 5, "regional": 0, "datacenter": 0}),
    "a stage past the spec's end stays on the last": (
        status(stage_index=7), {"edge": 50, "regional": 50, "datacenter": 0}),
    "rolled back sends nothing to the canary": (
        status(phase="RolledBack"), {"edge": 0, "regional": 0, "datacenter": 0}),
    "no canary sends nothing": (status(canary_version=None),
                                {"edge": 0, "regional": 0, "datacenter": 0}),
}


@pytest.mark.parametrize("case", WEIGHTS)
def test_weights(case):
    before, expected = WEIGHTS[case]
    assert dict(e.canary_weights(SPEC, before)) == expected


# --- detection power ------------------------------------------------------------

def _simulate(ratio, trials, seed, *, min_requests, step, stable_cap, confidence, max_ratio,
              fixed_threshold_ms, flagger_failed_checks):
    """Fractions of trials rolled back by our analysis and by a fixed threshold."""
    rng = np.random.default_rng(seed)
    ours = fixed = fixed_strict = 0
    bound = LatencyBound(max_ratio)
    for _ in range(trials):
        stable = rng.lognormal(math.log(20.0), 0.5, stable_cap)
        canary = rng.lognormal(math.log(20.0 * ratio), 0.5, min_requests)
        for seen in range(step, min_requests + 1, step):  # one analysis per interval
            result = a.judge_latency(bound, stable[:min(stable_cap, seen * 19)],
                                     canary[:seen], confidence, 50)
            if result.outcome == a.FAILED:
                ours += 1
                break
        over = sum(np.quantile(canary[k - step:k], 0.95) > fixed_threshold_ms
                   for k in range(step, min_requests + 1, step))
        fixed += over >= 1
        fixed_strict += over >= flagger_failed_checks
    return ours / trials, fixed / trials, fixed_strict / trials


def test_a_20_percent_regression_is_caught_and_an_unchanged_canary_is_not_rolled_back():
    """Detection power of the latency analysis, beside a Flagger-style fixed threshold.

    Assumptions: latencies are lognormal (median 20 ms, sigma 0.5, so p95 is
    about 45.6 ms); a "20% p95 regression" scales every latency by 1.2 (the
    whole distribution shifts, so p95 rises 20%). The canary takes 5% of
    traffic: by the time it has served n requests the stable has served 19n,
    of which the analysis sees a bounded reservoir of at most 2000. The
    stage's min_requests is 300 canary requests (6000 in all); an analysis
    runs after every 50 canary requests (an interval) on everything the
    stage has seen, from min_samples = 50 on, with confidence 0.99,
    max_ratio 1.05 and a consecutive-failure limit of 1: the first Failed
    analysis rolls back. 500 seeded trials per case.

    The fixed-threshold check is the kind Flagger runs: once per interval,
    the interval's canary p95 against a threshold set 10% above the stable's
    true p95 (about 50 ms), rolling back after 1 (or 5 of the 6) failed
    checks.
    """
    settings = {"min_requests": 300, "step": 50, "stable_cap": 2000, "confidence": 0.99,
                "max_ratio": 1.05, "fixed_threshold_ms": 20.0 * math.exp(0.5 * 1.6449) * 1.1,
                "flagger_failed_checks": 5}
    caught, fixed_caught, strict_caught = _simulate(1.2, 500, 1, **settings)
    wrong, fixed_wrong, strict_wrong = _simulate(1.0, 500, 2, **settings)
    print(f"\n20% p95 regression caught within 300 canary requests: ours {caught:.1%}, "
          f"fixed threshold (1 failed check) {fixed_caught:.1%}, "
          f"(5 failed checks) {strict_caught:.1%}")
    print(f"unchanged canary rolled back: ours {wrong:.1%}, fixed threshold "
          f"(1 failed check) {fixed_wrong:.1%}, (5 failed checks) {strict_wrong:.1%}")
    assert caught >= 0.95
    assert wrong <= 0.01
