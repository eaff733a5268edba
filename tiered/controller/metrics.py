"""The controller's Prometheus metrics: where each rollout stands and what its
latest analysis found, per metric and tier, the shape canary users alert on;
and each autoscaled tier's agents and metric.

The Reconciler hands every status it writes (and the decisions it made) to
`RolloutMetrics`; a scrape reads them from another thread, hence the lock.
Both backends run the Reconciler, so both export the same metrics.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from tiered import names
from tiered.rollout.status import TieredModelStatus
from tiered.telemetry.exposition import Family

OUTCOMES = tuple(names.Outcome)


class RolloutMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._statuses: dict[str, TieredModelStatus] = {}
        self._decisions: Counter[tuple[str, str]] = Counter()

    def observe(self, name: str, status: TieredModelStatus, reasons: Iterable[str]) -> None:
        """The status just written for `name`, and the decisions (event reasons) it made."""
        with self._lock:
            self._statuses[name] = status
            for reason in reasons:
                self._decisions[(name, reason)] += 1

    def forget(self, name: str) -> None:
        with self._lock:
            self._statuses.pop(name, None)

    def families(self) -> list[Family]:
        phase = Family("tiered_rollout_phase", "gauge",
                       "1 for the phase each model's rollout is in, 0 for the others")
        stage = Family("tiered_rollout_stage", "gauge",
                       "The live stage, counted from 1 (0: no rollout in progress)")
        versions = Family("tiered_rollout_version", "gauge",
                          "The stable and canary versions (role label)")
        weight = Family("tiered_rollout_canary_weight", "gauge",
                        "Percent of each tier's traffic on the canary")
        analysis = Family("tiered_rollout_analysis", "gauge",
                          "The latest analysis: 1 for each metric and tier's outcome "
                          "(Successful, Failed, Inconclusive, Error, NotJudged), 0 for the others")
        p_value = Family("tiered_rollout_analysis_p_value", "gauge",
                         "The p-value of each metric and tier's latest test, where it has one")
        decisions = Family("tiered_rollout_decisions_total", "counter",
                           "Decisions this controller made since it started, by reason "
                           "(StageAdvanced, Promoted, RolledBack, Paused, ...)")
        replicas = Family("tiered_autoscaling_replicas", "gauge",
                          "Agents each autoscaled tier runs, as the controller decided")
        scale_value = Family("tiered_autoscaling_metric", "gauge",
                             "The autoscaling metric per agent at the latest look "
                             "(metric label: concurrency or utilization)")
        with self._lock:
            statuses = dict(self._statuses)
            counted = dict(self._decisions)
        for model, status in sorted(statuses.items()):
            rollout = status.rollout
            for each in names.Phase:
                phase.add({"model": model, "phase": each},
                          1 if rollout is not None and rollout.phase == each else 0)
            live = rollout is not None and rollout.canary_version is not None \
                and rollout.phase == names.Phase.PROGRESSING
            stage.add({"model": model}, rollout.stage_index + 1 if live else 0)
            if rollout is not None:
                versions.add({"model": model, "role": "stable"}, rollout.stable_version)
                if rollout.canary_version is not None:
                    versions.add({"model": model, "role": "canary"}, rollout.canary_version)
            for tier in names.TIERS:
                weight.add({"model": model, "tier": tier}, status.weights.get(tier, 0.0))
            last = rollout.last_analysis if rollout is not None else None
            for result in last.metrics if last is not None else ():
                labels = {"model": model, "metric": result.metric, "tier": result.tier or ""}
                for outcome in OUTCOMES:
                    analysis.add({**labels, "outcome": outcome},
                                 1 if result.outcome == outcome else 0)
                if "p_value" in result.numbers:
                    p_value.add(labels, result.numbers["p_value"])
            for tier, scale in sorted(status.scaling.items()):
                replicas.add({"model": model, "tier": tier}, scale.replicas)
                if scale.value is not None:
                    scale_value.add({"model": model, "tier": tier}, scale.value)
        for (model, reason), count in sorted(counted.items()):
            decisions.add({"model": model, "reason": reason}, count)
        return [phase, stage, versions, weight, analysis, p_value, decisions, replicas,
                scale_value]
