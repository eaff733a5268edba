"""StageAccumulator as tables: samples per tier of the stage, counts, the latency
reservoir, J/inference windows, shadow deltas and the summary numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tiered.controller import measure
from tiered.controller.measure import StageAccumulator, VersionReading
from tiered.rollout.snapshot import Figures, StageFigures

STABLE, CANARY = 1, 2


def accumulator(baseline=None, stage=0, seed=0):
    return StageAccumulator(CANARY, stage, np.random.default_rng(seed), baseline or {})


def reading(tier, version, success=0, failure=0, latencies=(), joules=None, source="nvml"):
    return VersionReading(tier, version, success, failure, tuple(latencies), joules,
                          source if joules is not None else "")


POLL = [
    reading("edge", STABLE, 90, 10, (0.010, 0.020), 1.0),
    reading("edge", CANARY, 8, 2, (0.030,), 2.0),
    reading("regional", STABLE, 50, 0, (0.005,), 3.0),
    reading("regional", CANARY, 20, 5, (0.040, 0.050), 4.0),
    reading("datacenter", STABLE, 1000, 100, (0.001,), 9.0),
]


@pytest.mark.parametrize(("tiers", "stable", "canary"), [
    # tiers -> (requests, errors, latencies ms, J/inf) for stable, then canary
    (("edge",), (100, 10, (10.0, 20.0), (1.0,)), (10, 2, (30.0,), (2.0,))),
    (("regional",), (50, 0, (5.0,), (3.0,)), (25, 5, (40.0, 50.0), (4.0,))),
    (("edge", "regional"), (150, 10, (10.0, 20.0, 5.0), (1.0, 3.0)),
     (35, 7, (30.0, 40.0, 50.0), (2.0, 4.0))),
    (("datacenter",), (1100, 100, (1.0,), (9.0,)), (0, 0, (), ())),  # no canary there
    ((), (0, 0, (), ()), (0, 0, (), ())),
])
def test_per_tier_samples_of_the_given_tiers_only(tiers, stable, canary):
    acc = accumulator()
    acc.add(POLL)
    m = acc.measurements(STABLE, tiers)
    assert tuple(m.tiers) == tiers
    for samples, (requests, errors, latencies, joules) in ((m.pooled("stable"), stable),
                                                           (m.pooled("canary"), canary)):
        assert samples.requests == requests
        assert samples.errors == errors
        assert samples.latencies_ms == pytest.approx(latencies)
        assert tuple(samples.joules_per_inference) == joules


def test_counts_sum_over_polls_and_window_increments():
    acc = accumulator(stage=1)
    assert acc.window == 0
    for n in range(1, 4):
        acc.add([reading("edge", CANARY, 10, 1, (0.001 * n,))])
        assert acc.window == n
    acc.add([])  # an empty poll is still a window
    m = acc.measurements(STABLE, ["edge"])
    assert (m.window, m.stage) == (4, 1)
    edge = m.tiers["edge"]
    assert (edge.canary.requests, edge.canary.errors) == (33, 3)
    assert edge.canary.latencies_ms == pytest.approx((1.0, 2.0, 3.0))
    assert edge.stable.requests == 0


def test_measurements_accepts_any_iterable_of_tiers():
    acc = accumulator()
    acc.add(POLL)
    m = acc.measurements(STABLE, iter(["edge", "regional"]))
    assert (m.pooled("stable").requests, m.pooled("canary").requests) == (150, 35)
    assert (m.tiers["regional"].stable.requests, m.tiers["regional"].canary.requests) == (50, 25)


@pytest.mark.parametrize(("success", "joules", "kept"), [
    (5, 1.5, (1.5,)),
    (0, 1.5, ()),       # no successful inference: no window
    (5, None, ()),      # no energy reading: no window
    (0, None, ()),
    (1, 0.0, (0.0,)),   # zero joules is a value
])
def test_joules_window_only_with_success_and_value(success, joules, kept):
    acc = accumulator()
    acc.add([reading("edge", CANARY, success, 3, (), joules)])
    assert tuple(acc.measurements(STABLE, ["edge"]).tiers["edge"].canary.joules_per_inference) == kept


def test_joules_windows_bounded(monkeypatch):
    monkeypatch.setattr(measure, "WINDOWS", 3)
    acc = accumulator()
    for n in range(6):
        acc.add([reading("edge", CANARY, 1, 0, (), float(n))])
    assert tuple(acc.measurements(STABLE, ["edge"]).tiers["edge"].canary.joules_per_inference) == (
        3.0, 4.0, 5.0)


@pytest.mark.parametrize(("offered", "bound"), [(3, 5), (5, 5), (50, 5), (400, 7)])
def test_reservoir_bound(monkeypatch, offered, bound):
    monkeypatch.setattr(measure, "RESERVOIR", bound)
    acc = accumulator(seed=3)
    values = [0.001 * (i + 1) for i in range(offered)]
    for chunk in range(0, offered, 4):  # spread over several polls
        acc.add([reading("edge", CANARY, 4, 0, values[chunk:chunk + 4])])
    series = acc._series[("edge", CANARY)]
    assert series.latency.seen == offered
    assert len(series.latency.values) == min(offered, bound)
    kept = acc.measurements(STABLE, ["edge"]).tiers["edge"].canary.latencies_ms
    assert len(kept) == min(offered, bound)
    offered_ms = {round(v * 1000.0, 6) for v in values}
    assert {round(v, 6) for v in kept} <= offered_ms
    assert len(set(kept)) == len(kept)  # each sample kept at most once
    if offered <= bound:
        assert list(kept) == pytest.approx([v * 1000.0 for v in values])


def test_reservoir_is_per_tier_and_version(monkeypatch):
    monkeypatch.setattr(measure, "RESERVOIR", 4)
    acc = accumulator()
    acc.add([reading("edge", CANARY, 0, 0, [0.001] * 10),
             reading("regional", CANARY, 0, 0, [0.002] * 10),
             reading("edge", STABLE, 0, 0, [0.003] * 2)])
    m = acc.measurements(STABLE, ["edge", "regional"])
    assert [len(m.tiers[t].canary.latencies_ms) for t in ("edge", "regional")] == [4, 4]
    assert len(m.tiers["edge"].stable.latencies_ms) == 2


def test_reservoir_is_roughly_uniform(monkeypatch):
    monkeypatch.setattr(measure, "RESERVOIR", 200)
    acc = accumulator(seed=7)
    acc.add([reading("edge", CANARY, 0, 0, [i / 1000.0 for i in range(4000)])])
    kept = np.asarray(acc.measurements(STABLE, ["edge"]).tiers["edge"].canary.latencies_ms)
    # uniform over 0..3999 ms: mean about 2000; keeping only the first 200 gives 100
    assert 1600 < kept.mean() < 2400
    assert (kept >= 2000).sum() > 60


def test_shadow_counts_are_deltas_from_baseline():
    baseline = {("edge", "agree"): 100.0, ("edge", "disagree"): 4.0}
    acc = accumulator(baseline)
    m = acc.measurements(STABLE, ["edge"])
    assert (m.shadow_compared, m.shadow_agreed) == (0, 0)
    acc.set_shadow({("edge", "agree"): 130.0, ("edge", "disagree"): 6.0,
                    ("regional", "agree"): 10.0, ("regional", "error"): 50.0})
    m = acc.measurements(STABLE, ["edge"])  # agreement counts over every tier
    assert m.shadow_agreed == 30 + 10
    assert m.shadow_compared == 30 + 2 + 10  # "error" is neither agree nor disagree
    acc.set_shadow({("edge", "agree"): 131.0, ("edge", "disagree"): 6.0,
                    ("regional", "agree"): 10.0})
    m = acc.measurements(STABLE, ["edge"])  # cumulative counts replace, not add
    assert (m.shadow_compared, m.shadow_agreed) == (43, 41)


@pytest.mark.parametrize(("canary", "stage", "expected"), [
    (2, 0, True), (2, 1, False), (3, 0, False), (3, 1, False),
])
def test_matches(canary, stage, expected):
    assert accumulator(stage=0).matches(canary, stage) is expected


def test_summary_numbers():
    stable_s = [0.001 * i for i in range(1, 101)]
    canary_s = [0.002, 0.004, 0.006, 0.100]
    acc = accumulator({("edge", "agree"): 5.0})
    acc.add([reading("edge", STABLE, 95, 5, stable_s, 1.0),
             reading("edge", CANARY, 3, 1, canary_s, 2.0),
             reading("regional", CANARY, 7, 0, (9.0,), 50.0)])  # not in `tiers`
    acc.add([reading("edge", STABLE, 100, 0, (), 3.0),
             reading("edge", CANARY, 4, 0, (), 4.0)])
    acc.add([reading("edge", STABLE, 100, 0, (), 2.0)])
    acc.set_shadow({("edge", "agree"): 23.0, ("edge", "disagree"): 2.0})
    summary = acc.summary(STABLE, ["edge"])
    assert (summary.stable, summary.canary, summary.agreement, summary.agreement_compared) == (
        Figures(requests=300, jpi=2.0, energy_source="nvml", p95_ms=pytest.approx(
            float(np.percentile([1000 * s for s in stable_s], 95)))),
        Figures(requests=8, jpi=3.0, energy_source="nvml", p95_ms=pytest.approx(
            float(np.percentile([2.0, 4.0, 6.0, 100.0], 95)))),
        pytest.approx(18 / 20), 20)
    assert summary.stable.p95_ms == pytest.approx(95.05)
    # The one tier judged (regional is not in `tiers`) has the pooled figures as its
    # own (the pooled ones name the energy source).
    assert list(summary.tiers) == ["edge"]
    edge = summary.tiers["edge"]
    assert (edge.stable, edge.canary) == tuple(dataclasses.replace(pooled, energy_source=None)
                                               for pooled in (summary.stable, summary.canary))


def test_summary_with_nothing_measured():
    summary = accumulator().summary(STABLE, ["edge"])
    assert summary == StageFigures(stable=Figures(requests=0, energy_source=""),
                                   canary=Figures(requests=0, energy_source=""),
                                   agreement=None, agreement_compared=0)


def test_each_version_carries_the_source_of_its_energy_figures_and_mixed_is_unknown():
    acc = accumulator()
    acc.add([reading("edge", STABLE, 10, 0, (), 1.0, "nvml"),
             reading("edge", CANARY, 10, 0, (), 1.0, "model")])
    acc.add([reading("edge", STABLE, 10, 0, (), 1.0, "nvml"),
             reading("edge", CANARY, 10, 0, (), 1.0, "nvml")])
    m = acc.measurements(STABLE, ["edge"])
    assert m.tiers["edge"].stable.energy_source == "nvml"
    assert m.tiers["edge"].canary.energy_source == ""  # model, then nvml: not one source
    restored = StageAccumulator.restore(acc.state(), np.random.default_rng(0))
    assert restored.measurements(STABLE, ["edge"]) == m


def test_client_errors_are_kept_apart_from_failures_and_restored():
    acc = accumulator()
    acc.add([reading("edge", STABLE, 10, 1), VersionReading("edge", CANARY, 10, 0,
                                                            client_errors=100)])
    canary = acc.measurements(STABLE, ["edge"]).tiers["edge"].canary
    assert (canary.requests, canary.errors, canary.client_errors) == (10, 0, 100)
    restored = StageAccumulator.restore(acc.state(), np.random.default_rng(0))
    assert restored.measurements(STABLE, ["edge"]).tiers["edge"].canary.client_errors == 100


def test_summary_agreement_none_when_only_errors_compared():
    acc = accumulator()
    acc.set_shadow({("edge", "error"): 12.0})
    assert acc.summary(STABLE, ["edge"]).agreement is None


def test_energy_pools_the_polls_of_one_window():
    acc = StageAccumulator(CANARY, 0, np.random.default_rng(0), {})
    # two polls in window 7 (10 inferences at 0.2 J, 30 at 0.6 J), one in window 8
    acc.add([reading("edge", CANARY, 10, 0, (), 0.2)], window=7)
    acc.add([reading("edge", CANARY, 30, 0, (), 0.6)], window=7)
    acc.add([reading("edge", CANARY, 5, 0, (), 1.0)], window=8)
    windows = acc.measurements(STABLE, ["edge"]).tiers["edge"].canary.joules_per_inference
    assert windows == pytest.approx((0.5, 1.0))  # (10*0.2 + 30*0.6) / 40, then 1.0


def test_samples_start_with_the_canarys_first_request():
    acc = accumulator()
    # the canary's agents are still loading: stable alone, slowed, is not compared
    acc.add([reading("edge", STABLE, 50, 0, (0.090,), 5.0), reading("edge", CANARY)])
    acc.add([reading("edge", STABLE, 50, 0, (0.080,), 5.0)])
    m = acc.measurements(STABLE, ["edge"])
    assert (m.tiers["edge"].stable.requests, m.tiers["edge"].canary.requests) == (0, 0)
    acc.add([reading("edge", STABLE, 40, 0, (0.010,), 1.0),
             reading("edge", CANARY, 10, 0, (0.011,), 1.1)])
    acc.add([reading("edge", STABLE, 40, 0, (0.012,), 1.0)])  # from then on, every poll
    edge = acc.measurements(STABLE, ["edge"]).tiers["edge"]
    assert (edge.stable.requests, edge.canary.requests) == (80, 10)
    assert edge.stable.latencies_ms == pytest.approx((10.0, 12.0))
    assert acc.window == 4


def test_a_restored_stage_has_every_count_and_each_latency_within_one_percent():
    acc = accumulator({("r1", "edge", "agree"): 3.0})
    latencies = np.random.default_rng(4).lognormal(np.log(0.005), 0.6, 500)
    acc.add([reading("edge", STABLE, 400, 3, latencies[:250], 1.0),
             reading("edge", CANARY, 100, 1, latencies[250:], 2.0)], window=3)
    acc.set_shadow({("r1", "edge", "agree"): 10.0, ("r1", "edge", "disagree"): 1.0})
    restored = StageAccumulator.restore(acc.state(), np.random.default_rng(0))
    before, after = (a.measurements(STABLE, ["edge"]) for a in (acc, restored))
    for version in ("stable", "canary"):
        old, new = (getattr(m.tiers["edge"], version) for m in (before, after))
        assert (new.requests, new.errors, new.joules_per_inference) == (
            old.requests, old.errors, old.joules_per_inference)
        assert sorted(new.latencies_ms) == pytest.approx(sorted(old.latencies_ms), rel=0.01)
    assert (after.shadow_compared, after.shadow_agreed) == (8, 7)
