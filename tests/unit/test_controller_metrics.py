"""The controller's metrics: each rollout's phase, stage, weights and latest
analysis per metric and tier, in Prometheus's text format."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tiered.controller.metrics import RolloutMetrics
from tiered.rollout.status import AnalysisRun, MetricResult, RolloutStatus, TieredModelStatus
from tiered.telemetry.exposition import render


def scrape(metrics: RolloutMetrics) -> dict[str, dict[tuple, float]]:
    """Metric name -> {sorted labels: value}, as a Prometheus server reads it."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(render(metrics.families())):
        for sample in family.samples:
            found.setdefault(family.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def rolling(outcome: str) -> TieredModelStatus:
    analysis = AnalysisRun(7, outcome, (
        MetricResult("latency_p95", outcome, "p95 6 vs 5 ms", {"p_value": 0.004}, "edge"),
        MetricResult("agreement", "Successful", "agreement 1", {"p_value": 1e-9}, None),
    ))
    rollout = RolloutStatus(stable_version=1, canary_version=2, stage_index=1,
                            phase="Progressing", last_analysis=analysis)
    return TieredModelStatus(rollout=rollout, weights={"edge": 100.0, "regional": 50.0})


def test_a_live_rollout_shows_its_stage_weights_and_each_analysis_per_tier():
    metrics = RolloutMetrics()
    metrics.observe("digits", rolling("Failed"), ["StageAdvanced"])
    found = scrape(metrics)
    assert found["tiered_rollout_phase"][(("model", "digits"), ("phase", "Progressing"))] == 1
    assert found["tiered_rollout_phase"][(("model", "digits"), ("phase", "Promoted"))] == 0
    assert found["tiered_rollout_stage"][(("model", "digits"),)] == 2  # counted from 1
    weights = found["tiered_rollout_canary_weight"]
    assert weights[(("model", "digits"), ("tier", "regional"))] == 50
    assert weights[(("model", "digits"), ("tier", "datacenter"))] == 0
    analysis = found["tiered_rollout_analysis"]
    key = (("metric", "latency_p95"), ("model", "digits"), ("tier", "edge"))
    assert analysis[(*key[:2], ("outcome", "Failed"), key[2])] == 1
    assert analysis[(*key[:2], ("outcome", "Successful"), key[2])] == 0
    assert found["tiered_rollout_analysis_p_value"][key] == 0.004
    agreement = (("metric", "agreement"), ("model", "digits"), ("outcome", "Successful"),
                 ("tier", ""))
    assert analysis[agreement] == 1  # judged over every tier: no tier
    versions = found["tiered_rollout_version"]
    assert versions[(("model", "digits"), ("role", "canary"))] == 2


def test_decisions_are_counted_and_a_deleted_model_leaves():
    metrics = RolloutMetrics()
    metrics.observe("digits", rolling("Successful"), ["StageAdvanced"])
    metrics.observe("digits", rolling("Failed"), ["RolledBack"])
    metrics.observe("digits", rolling("Failed"), [])
    found = scrape(metrics)
    decisions = found["tiered_rollout_decisions"]  # the parser drops _total from the name
    assert decisions[(("model", "digits"), ("reason", "RolledBack"))] == 1
    assert decisions[(("model", "digits"), ("reason", "StageAdvanced"))] == 1
    metrics.forget("digits")
    assert "tiered_rollout_phase" not in scrape(metrics)
