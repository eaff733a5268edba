"""The rollout engine as decision tables, the manual verbs, weight arithmetic,
and the detection-power simulation against a fixed-threshold check."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
import typing
from pathlib import Path

import numpy as np
import pytest

from tiered import names
from tiered.errors import InvalidArgument
from tiered.rollout import analysis as a
from tiered.rollout import engine as e
from tiered.rollout import spec as s
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import RolloutStatus
from tiered.settings import type_hints

SHA = "cd" * 32


def model(on_failure="rollback", limit=1, on_undecided=None, **analysis):
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
            # None: the default (pause)
            **({} if on_undecided is None else {"on_undecided": on_undecided}),
        },
    })


SPEC = model()
R = np.random.default_rng(11)
STABLE_MS = tuple(R.lognormal(math.log(20), 0.5, 2000))
SAME_MS = tuple(R.lognormal(math.log(20), 0.5, 400))
SLOW_MS = tuple(R.lognormal(math.log(30), 0.5, 400))


# Twenty J/inference windows a version: with three, no rank test can reach
# the small share of the rollout's false-rollback budget each look gets.
WINDOWS = tuple(1.0 + 0.002 * k for k in range(-10, 10))


def measure(window=1, stage=0, canary_ms=SAME_MS, requests=400, errors=0, joules=1.0,
            agreed=400, compared=400):
    return a.Measurements(
        window=window, stage=stage, tiers={"edge": a.TierSamples(
            stable=a.VersionSamples(STABLE_MS, 8000, 8, WINDOWS, "nvml"),
            canary=a.VersionSamples(canary_ms, requests, errors,
                                    tuple(joules * w for w in WINDOWS), "nvml"))},
        shadow_compared=compared, shadow_agreed=agreed)


def status(**changes):
    base = RolloutStatus(stable_version=1, canary_version=2, stage_index=0,
                         phase="Progressing", stage_started_at=1000.0)
    return dataclasses.replace(base, **changes)


# name: (spec, status, measurements, now, expected action, words in the reason)
TABLE = {
    "passing first stage advances": (SPEC, status(), measure(), 1100, names.Action.ADVANCE, "on to stage 2"),
    "passing last stage promotes": (SPEC, status(stage_index=1), measure(stage=1), 1100,
                                    names.Action.PROMOTE, "promoting version 2"),
    "too few canary requests hold": (SPEC, status(), measure(requests=100), 1100, names.Action.HOLD,
                                     "too little data: 100 of 300"),
    "too short holds": (SPEC, status(), measure(), 1030, names.Action.HOLD,
                        "too short: 30 of 60 s (minDurationSeconds)"),
    "no measurements hold": (SPEC, status(), None, 1100, names.Action.HOLD, "no measurements"),
    "measurements of another stage hold": (SPEC, status(), measure(stage=1), 1100, names.Action.HOLD,
                                           "no measurements"),
    "too few samples hold (inconclusive)": (SPEC, status(), measure(canary_ms=SAME_MS[:10]),
                                            1100, names.Action.HOLD, "analysis inconclusive"),
    "latency regression rolls back": (SPEC, status(), measure(canary_ms=SLOW_MS), 1100,
                                      names.Action.ROLLBACK, "latency_p95"),
    "a failed analysis follows onFailure, whatever onUndecided says": (
        model(on_undecided="pause"), status(), measure(canary_ms=SLOW_MS), 1100,
        names.Action.ROLLBACK, "rolling back to version 1 (onFailure: rollback)"),
    "a failed analysis pauses with onFailure: pause, whatever onUndecided says": (
        model("pause", on_undecided="rollback"), status(), measure(errors=40), 1100,
        names.Action.PAUSE, "pausing (onFailure: pause)"),
    "a failed analysis at max duration still follows onFailure": (
        SPEC, status(), measure(errors=40), 1600, names.Action.ROLLBACK, "(onFailure: rollback)"),
    "latency regression fails fast, before min duration": (
        SPEC, status(), measure(canary_ms=SLOW_MS), 1010, names.Action.ROLLBACK, "latency_p95"),
    "errors roll back": (SPEC, status(), measure(errors=40), 1100, names.Action.ROLLBACK, "error_rate"),
    "energy regression rolls back": (SPEC, status(), measure(joules=1.5), 1100, names.Action.ROLLBACK,
                                     "energy_per_inference"),
    "disagreement rolls back": (SPEC, status(), measure(agreed=300), 1100, names.Action.ROLLBACK,
                                "agreement"),
    "failure pauses when onFailure is pause": (model("pause"), status(),
                                               measure(errors=40), 1100, names.Action.PAUSE,
                                               "onFailure: pause"),
    "one failure of two allowed holds": (model(limit=2), status(), measure(errors=40), 1100,
                                         names.Action.HOLD, "1 of 2 in a row"),
    "second failure in a row rolls back": (
        model(limit=2), status(consecutive_failures=1), measure(window=2, errors=40), 1100,
        names.Action.ROLLBACK, "2 of 2 in a row"),
    "inconclusive past max_duration pauses by default, though onFailure rolls back": (
        SPEC, status(), measure(canary_ms=SAME_MS[:10]), 1600, names.Action.PAUSE,
        "undecided at maxDurationSeconds (600 s)"),
    "inconclusive past max_duration rolls back with onUndecided: rollback": (
        model(on_undecided="rollback"), status(), measure(canary_ms=SAME_MS[:10]), 1600,
        names.Action.ROLLBACK, "rolling back to version 1 (onUndecided: rollback)"),
    "inconclusive past max_duration pauses with onUndecided: pause": (
        model(on_undecided="pause"), status(), measure(canary_ms=SAME_MS[:10]), 1600,
        names.Action.PAUSE, "pausing (onUndecided: pause)"),
    "inconclusive past max_duration pauses with onFailure: pause too": (
        model("pause"), status(), measure(canary_ms=SAME_MS[:10]), 1600, names.Action.PAUSE,
        "undecided at maxDurationSeconds"),
    "too few canary requests past max_duration pause": (
        SPEC, status(), measure(requests=100), 1600, names.Action.PAUSE,
        "too little data: 100 of 300 canary requests (minRequests)"),
    "too few canary requests past max_duration roll back with onUndecided: rollback": (
        model(on_undecided="rollback"), status(), measure(requests=100), 1600,
        names.Action.ROLLBACK, "too little data: 100 of 300 canary requests (minRequests)"),
    "no data past max_duration pauses": (SPEC, status(), None, 1600, names.Action.PAUSE,
                                         "no measurements"),
    "no data past max_duration rolls back with onUndecided: rollback": (
        model(on_undecided="rollback"), status(), None, 1600, names.Action.ROLLBACK,
        "no measurements"),
    "no canary traffic past max_duration pauses, whatever onFailure says": (
        SPEC, status(), measure(canary_ms=(), requests=0, agreed=0, compared=0), 1600,
        names.Action.PAUSE, "no canary traffic in 600 s"),
    "no canary traffic past max_duration pauses, whatever onUndecided says": (
        model(on_undecided="rollback"), status(),
        measure(canary_ms=(), requests=0, agreed=0, compared=0), 1600,
        names.Action.PAUSE, "no canary traffic in 600 s"),
    "no canary traffic yet holds": (
        SPEC, status(), measure(canary_ms=(), requests=0, agreed=0, compared=0), 1100,
        names.Action.HOLD, "too little data: 0 of 300"),
    "paused holds": (SPEC, status(phase="Paused", paused=True), measure(), 1100, names.Action.HOLD,
                     "paused"),
    "finished holds": (SPEC, status(phase="RolledBack"), measure(), 1100, names.Action.HOLD,
                       "RolledBack"),
}


@pytest.mark.parametrize("case", TABLE)
def test_decide(case):
    spec, before, measurements, now, action, words = TABLE[case]
    decision = e.decide(spec, before, measurements, now)
    assert decision.action == action, decision.reason
    assert words in decision.reason
    assert decision.status.message == decision.reason
    paused = action == names.Action.PAUSE
    assert (decision.status.phase == "Paused") == (paused or before.phase == "Paused")
    assert decision.status.paused == (paused or before.paused)
    if paused or action == names.Action.ROLLBACK:
        assert decision.status.stage_index == before.stage_index


def _snake_spec_fields() -> set[str]:
    """The spec's snake_case field names, but the metrics' (a metric is
    named by its identifier in results, as the status and Prometheus do)."""
    seen, todo = set(), [s.TieredModel]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        for hint in type_hints(cls).values():
            inner = [hint, *typing.get_args(hint)]
            for each in [*inner, *(arg for i in inner for arg in typing.get_args(i))]:
                if dataclasses.is_dataclass(each) and each not in seen:
                    todo.append(each)
    metrics = {m for ms in s.METRICS_OF_KIND.values() for m in ms}
    return {f.name for cls in seen for f in dataclasses.fields(cls)
            if "_" in f.name and f.name not in metrics}


SNAKE = re.compile(r"\b(" + "|".join(sorted(_snake_spec_fields())) + r")\b")


@pytest.mark.parametrize("case", TABLE)
def test_reasons_name_spec_fields_as_the_yaml_writes_them(case):
    spec, before, measurements, now, _, _ = TABLE[case]
    reason = e.decide(spec, before, measurements, now).reason
    assert not SNAKE.search(reason), reason
    assert "max_duration" not in reason and "on_failure" not in reason, reason


def test_an_undecided_pause_says_what_is_missing_and_what_to_do():
    decision = e.decide(SPEC, status(), measure(canary_ms=SAME_MS[:10], requests=100), 1600)
    assert decision.action == names.Action.PAUSE
    reason = decision.reason
    # Why: each test short of samples, with its numbers, and the canary's requests.
    assert reason.startswith("stage 1/2 'edge-5' undecided at maxDurationSeconds (600 s): "
                             "too little data: 100 of 300 canary requests (minRequests); "
                             "analysis inconclusive: "), reason
    assert ("latency_p95 on edge: too few samples: canary 10, stable 2000, need 50 each, "
            "minSamples") in reason
    # What: nothing failed; resume (another maxDurationSeconds), traffic, promote, abort.
    assert "pausing (onUndecided: pause): nothing failed" in reason
    for remedy in ("Resume to give the stage another 600 s", "send the canary more traffic",
                   "promote", "abort"):
        assert remedy in reason, remedy
    assert decision.analysis is not None and decision.analysis.verdict == a.INCONCLUSIVE
    # Resumed, it runs another maxDurationSeconds: held, not undecided again at once.
    resumed = e.resume(SPEC, decision.status, 1600)
    again = e.decide(SPEC, resumed.status, measure(window=2, canary_ms=SAME_MS[:10],
                                                   requests=100), 1610)
    assert again.action == names.Action.HOLD and resumed.status.stage_started_at == 1600
    late = e.decide(SPEC, again.status, measure(window=3, canary_ms=SAME_MS[:10],
                                                requests=100), 2200)
    assert late.action == names.Action.PAUSE and "undecided" in late.reason


def test_a_version_short_of_data_is_never_rolled_back_by_default():
    # The users' case: healthy numbers, one test not yet significant at the end.
    decision = e.decide(SPEC, status(stage_index=1), measure(stage=1, agreed=390), 1600)
    assert decision.action == names.Action.PAUSE, decision.reason
    assert "agreement: agreement 0.975 over 400 shadowed requests: not yet significantly " \
        "above 0.95" in decision.reason
    assert decision.status.stable_version == 1 and decision.status.canary_version == 2


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
    assert (first.action, again.action) == (names.Action.HOLD, names.Action.HOLD)
    assert again.status.consecutive_failures == 1
    third = e.decide(spec, again.status, measure(window=6, errors=40), 1120)
    assert third.action == names.Action.ROLLBACK


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
    "pause": (e.pause, status(), names.Action.PAUSE, "Paused", 0),
    "pause twice is a no-op": (e.pause, status(phase="Paused", paused=True), names.Action.HOLD,
                               "Paused", 0),
    "resume": (e.resume, status(phase="Paused", paused=True, consecutive_failures=2),
               names.Action.RESUME, "Progressing", 0),
    "resume when running is a no-op": (e.resume, status(), names.Action.HOLD, "Progressing", 0),
    "promote one stage": (e.promote, status(), names.Action.ADVANCE, "Progressing", 1),
    "promote from the last stage": (e.promote, status(stage_index=1), names.Action.PROMOTE,
                                    "Promoted", 1),
    "promote a paused rollout": (e.promote, status(phase="Paused", paused=True),
                                 names.Action.ADVANCE, "Progressing", 1),
    "abort": (e.abort, status(stage_index=1), names.Action.ABORT, "Aborted", 1),
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
    assert decision.action == names.Action.PROMOTE and decision.status.stable_version == 2


def test_abort_sends_all_traffic_to_stable_and_keeps_the_canary_on_record():
    decision = e.abort(SPEC, status(), 2000)
    assert decision.status.canary_version == 2
    assert not any(e.canary_weights(SPEC, decision.status).values())


@pytest.mark.parametrize("verb", [e.pause, e.resume, e.promote, e.abort])
@pytest.mark.parametrize("phase", ["Promoted", "RolledBack", "Aborted"])
def test_verbs_on_a_finished_rollout_are_refused(verb, phase):
    if (verb, phase) in ((e.promote, "Promoted"), (e.abort, "Aborted")):
        return  # already in effect: a no-op (tests/unit/test_rollout_verbs.py)
    with pytest.raises(InvalidArgument, match=f"phase: the rollout is {phase}"):
        verb(SPEC, status(phase=phase), 2000)


def test_start_begins_at_stage_zero_and_refuses_the_stable_version():
    begun = e.start(SPEC, 1, 2, 500.0)
    assert (begun.stage_index, begun.phase, begun.stage_started_at) == (0, "Progressing", 500)
    with pytest.raises(InvalidArgument, match="canaryVersion"):
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
#
# bench/judge.py's simulation, at fewer rollouts: traffic at 100 requests/s a
# tier through the real engine, one look per interval, the spec defaults'
# stages with 5% of the edge tier's traffic on the canary in the first.

_PATH = Path(__file__).resolve().parents[2] / "bench" / "judge.py"
_spec = importlib.util.spec_from_file_location("bench_judge", _PATH)
judge = importlib.util.module_from_spec(_spec)
sys.modules["bench_judge"] = judge  # dataclasses look their module up
_spec.loader.exec_module(judge)


def rollouts(profile, share, key, trials, arm="judge"):
    spec = judge.with_first_share(judge.profiles()[profile], share)
    scenario = next(s for s in judge.SCENARIOS if s.key == key)
    return [judge.run_rollout(spec, scenario, judge.Traffic(), (99, ord(key), k), arm)
            for k in range(trials)]


@pytest.mark.parametrize("key", "abcde")
def test_the_default_settings_catch_every_regression_in_its_stage(key):
    """Every latency +20%, the slowest 10% x1.5, errors 0.5% -> 2%,
    J/inference +30%, agreement 100% -> 90%: each caught by a failed analysis
    (so within the stage's max_duration) in all 40 rollouts, the target being
    99%; the location test alone missed the tail, and per-look tests at 5%
    rolled back good canaries."""
    outcomes = rollouts("defaults", 5.0, key, 40)
    assert [o.result for o in outcomes] == ["caught"] * 40


@pytest.mark.parametrize("key", "fg")
def test_the_default_settings_promote_a_good_canary_through_every_stage(key):
    """An unchanged canary, also while both versions slow down together in
    10 s bursts: promoted in all 8 rollouts, after about 180 looks each (the
    target, at most 0.5% rolled back, is bench/judge.py's to show: 8
    rollouts of ~0.5 s each here only catch a judge gone badly wrong)."""
    outcomes = rollouts("defaults", 5.0, key, 8)
    assert [o.result for o in outcomes] == ["promoted"] * 8
    assert min(o.looks for o in outcomes) >= 180


def test_a_fixed_p95_threshold_rolls_back_good_canaries_that_the_judge_keeps():
    # The demo's short intervals: few canary requests per check, noisy p95s.
    judged = rollouts("demo", 20.0, "f", 40)
    fixed = rollouts("demo", 20.0, "f", 40, arm="flagger")
    assert all(o.result == "promoted" for o in judged)
    assert sum(o.result == "caught" for o in fixed) >= 4
