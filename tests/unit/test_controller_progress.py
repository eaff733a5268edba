"""Rollout history snapshots and the progress lines made from them."""

from __future__ import annotations

import dataclasses

import pytest

from tiered.controller.plan import make_snapshot
from tiered.rollout.progress import (
    REASON_CHARS,
    ProgressLines,
    progress_line,
    quiet_tail,
    still_line,
    weights_label,
)
from tiered.rollout.snapshot import Figures, StageFigures
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.status import AnalysisRun, MetricResult, RolloutStatus

SPEC = load_tiered_model({
    "name": "digits", "artifact": {"uri": "digits.onnx", "sha256": "a" * 64},
    "tiers": {"edge": {}, "regional": {}},
    "rollout": {"stages": [{"name": "edge", "weights": {"edge": 20}},
                           {"name": "wide", "weights": {"edge": 50, "regional": 50}}]}})
NUMBERS = StageFigures(stable=Figures(requests=400, p95_ms=1.5, jpi=0.2),
                       canary=Figures(requests=120, p95_ms=1.7, jpi=0.21), agreement=0.97,
                       agreement_compared=90)


def live(run):
    return RolloutStatus(stable_version=1, canary_version=2, stage_index=1,
                         phase="Progressing", last_analysis=run)


def test_a_hold_names_what_keeps_the_analysis_from_passing():
    run = AnalysisRun(5, "Inconclusive", (
        MetricResult("latency_p95", "Successful", "ok", tier="edge"),
        MetricResult("latency_p95", "Inconclusive", "too few samples", tier="regional"),
        MetricResult("agreement", "Inconclusive", "lower bound not yet >= 0.95")))
    snap = make_snapshot(SPEC, live(run), "hold", "stage 2/2 'wide': analysis inconclusive", NUMBERS)
    assert snap.pending == ("latency_p95 on regional", "agreement")
    line = progress_line(0.0, snap)
    assert "stage 2/2 wide [all tiers 50%]" in line
    assert "stable n 400 p95 1.50 ms 200.000 mJ/inf  canary n 120 p95 1.70 ms" in line
    assert line.endswith("| hold: stage 2/2 'wide': analysis inconclusive")


def test_a_hold_with_a_passing_analysis_and_other_decisions_read_plainly():
    passing = AnalysisRun(5, "Successful", (MetricResult("latency_p95", "Successful", "ok",
                                                          tier="edge"),))
    held = progress_line(0.0, make_snapshot(SPEC, live(passing), "hold", "too short", NUMBERS))
    assert held.endswith("| hold: too short")
    advanced = progress_line(0.0, make_snapshot(SPEC, live(passing), "advance", "stage 1 passed",
                                           NUMBERS))
    assert advanced.endswith("| advance: stage 1 passed")
    assert make_snapshot(SPEC, live(None), "hold", "no measurements yet").pending == ()


@pytest.mark.parametrize("stable, canary, shown", [
    ({"energy_source": "model"}, {"energy_source": "model"},
     "210.000 mJ/inf (model, estimate)  agree"),
    ({"energy_source": "nvml"}, {"energy_source": "nvml"}, "210.000 mJ/inf (nvml)  agree"),
    ({"energy_source": "nvml"}, {"energy_source": "model"},
     "210.000 mJ/inf (stable nvml, canary model, estimate)  agree"),
    ({}, {}, "210.000 mJ/inf  agree"),
    ({"energy_source": "nvml", "jpi": None}, {"energy_source": "nvml", "jpi": None},
     "p95 1.70 ms - mJ/inf  agree"),
])
def test_j_per_inference_shows_its_source_when_the_snapshot_has_one(stable, canary, shown):
    passing = AnalysisRun(5, "Successful", ())
    figures = dataclasses.replace(NUMBERS, stable=dataclasses.replace(NUMBERS.stable, **stable),
                                  canary=dataclasses.replace(NUMBERS.canary, **canary))
    line = progress_line(0.0, make_snapshot(SPEC, live(passing), "hold", "too short", figures))
    assert shown in line


@pytest.mark.parametrize(("weights", "label"), [
    ({"datacenter": 50, "edge": 50, "regional": 50}, "all tiers 50%"),
    ({"regional": 5, "edge": 20, "datacenter": 0}, "edge 20%, regional 5%"),
    ({"datacenter": 10, "edge": 10, "regional": 0}, "edge 10%, datacenter 10%"),
    ({"edge": 20}, "edge 20%"),
    ({"edge": 0, "regional": 0}, "no canary traffic"),
])
def test_weights_read_in_tier_order_with_full_names(weights, label):
    assert weights_label(weights) == label


def test_a_hold_is_shown_again_only_when_its_reason_changes():
    run = AnalysisRun(5, "Inconclusive", ())
    lines = ProgressLines()

    def shown(action, reason):
        return lines.line(0.0, make_snapshot(SPEC, live(run), action, reason, NUMBERS))

    assert shown("hold", "too little data: 35 of 40 canary requests") is not None
    assert shown("hold", "too little data: 38 of 40 canary requests") is None  # counts only
    assert shown("hold", "too short: 5 of 10 s") is not None  # another reason
    assert shown("advance", "stage 1 passed") is not None  # a decision always shows
    assert shown("hold", "too short: 6 of 10 s") is not None  # after it, shown again


def test_a_short_line_leaves_out_the_stage_it_names_and_cuts_a_long_reason():
    run = AnalysisRun(5, "Inconclusive", ())
    reason = "stage 2/2 'wide': too little data: " + "latency_p95 on edge: no samples; " * 20
    snap = make_snapshot(SPEC, live(run), "hold", reason, NUMBERS)
    whole, short = progress_line(0.0, snap), progress_line(0.0, snap, short=True)
    assert whole.endswith(f"hold: {reason}")
    decision = short[short.index("| hold: ") + len("| hold: "):]
    assert decision.startswith("too little data: latency_p95 on edge")
    assert len(decision) == REASON_CHARS and decision.endswith("…")
    assert short.startswith(whole[:whole.index("| hold: ")])  # the head and figures as they were


@pytest.mark.parametrize("quiet_s, stage, tail", [
    (31.4, None, "nothing new for 31 s"),
    (30.0, (45.2, 120.0),
     "nothing new for 30 s; stage 45 s in, maxDurationSeconds 120 (75 s left)"),
    (60.0, (130.0, 120.0),
     "nothing new for 60 s; stage 130 s in, maxDurationSeconds 120 (0 s left)"),
])
def test_a_long_hold_says_for_how_long_in_the_yamls_words(quiet_s, stage, tail):
    assert quiet_tail(quiet_s, stage) == tail
    reason = "stage 2/2 'wide': too little data: 35 of 1000 canary requests"
    line = still_line(0.0, make_snapshot(SPEC, live(None), "hold", reason), quiet_s, stage)
    assert "digits v1->v2 Progressing stage 2/2 wide [all tiers 50%]" in line
    assert line.endswith(f"| hold: {reason} | {tail}")
