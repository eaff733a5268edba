"""Judging a live rollout: poll telemetry, accumulate the stage, ask the engine.

Shared by both backends. Each pass reads every agent's Telemetry.Stats since
its cursor and the router's shadow-agreement counters, adds them to the
current stage's samples (`StageAccumulator`), and calls the rollout engine
with them. What the backend does with the decision (write status, change
weights) is its own business.
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from tiered.controller.measure import StageAccumulator, VersionReading
from tiered.protocol import telemetry_pb2 as tpb
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc
from tiered.rollout import engine
from tiered.rollout.analysis import SUCCESSFUL
from tiered.rollout.spec import RolloutStatus, TieredModel

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0
SHADOW_METRIC = "tiered_router_shadow"


def snapshot(spec: TieredModel, status: RolloutStatus, action: str, reason: str,
             numbers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One line of rollout history: where it stands and the numbers it used."""
    index = min(status.stage_index, len(spec.rollout.stages) - 1)
    run = status.last_analysis
    return {
        "model": spec.name, "stable_version": status.stable_version,
        "canary_version": status.canary_version, "phase": status.phase,
        "stage_index": index, "stage_name": spec.rollout.stages[index].name,
        "stages": len(spec.rollout.stages),
        "weights": dict(engine.canary_weights(spec, status)),
        "action": action, "reason": reason,
        "verdict": run.verdict if run is not None else None,
        # what keeps the analysis from passing: metric labels, with their tier
        "pending": [m.label for m in run.metrics if m.outcome != SUCCESSFUL]
        if run is not None else [],
        **{key: None for key in ("stable_requests", "canary_requests", "p95_stable_ms",
                                 "p95_canary_ms", "jpi_stable", "jpi_canary", "agreement")},
        "agreement_compared": 0,
        **(numbers or {}),
    }


def shadow_counts(metrics_text: str, model: str, version: int) -> dict[tuple[str, str], float]:
    """(tier, result) -> count of the router's shadow comparisons for one canary version."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != SHADOW_METRIC:
            continue
        for sample in family.samples:
            labels = sample.labels
            if (sample.name.endswith("_total") and labels.get("model") == model
                    and labels.get("version") == str(version)):
                key = (labels["tier"], labels["result"])
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


class RolloutJudge:
    """Per model: the live stage's samples and each agent's telemetry cursor."""

    def __init__(self, channel: Callable[[str], grpc.Channel], seed: int = 0) -> None:
        self._channel = channel
        self._rng = np.random.default_rng(seed)
        self._cursors: dict[tuple[str, str], float] = {}
        self._stages: dict[str, StageAccumulator] = {}

    def judge(self, spec: TieredModel, status: RolloutStatus,
              agents: Mapping[str, Sequence[str]], router_metrics: str | None,
              now: float) -> tuple[engine.Decision, dict[str, Any]]:
        """The engine's decision on the live rollout, and the stage's headline numbers."""
        stage = self._stages.get(spec.name)
        if stage is None or not stage.matches(status.canary_version, status.stage_index):
            baseline = self._shadow(spec.name, status.canary_version, router_metrics)
            stage = StageAccumulator(status.canary_version, status.stage_index, self._rng,
                                     baseline)
            self._stages[spec.name] = stage
        # One analysis per interval (numbered on the wall clock, so no two stages
        # share a number): a failure counts once per look, not once per poll,
        # and each window's energy is one J/inference sample.
        window = int(now // spec.rollout.analysis.interval_s)
        readings, unreadable = self._readings(spec.name, agents)
        stage.add(readings, window)
        stage.set_shadow(self._shadow(spec.name, status.canary_version, router_metrics))
        tiers = [t for t, w in engine.canary_weights(spec, status).items() if w > 0]
        if unreadable:  # partial data is never judged: hold (max_duration still applies)
            decision = engine.decide(spec, status, None, now)
            why = f"telemetry unreadable from {', '.join(unreadable)}: {decision.reason}"
            decision = dataclasses.replace(
                decision, reason=why, status=dataclasses.replace(decision.status, message=why))
        else:
            measurements = stage.measurements(status.stable_version, tiers, window)
            decision = engine.decide(spec, status, measurements, now)
        return decision, stage.summary(status.stable_version, tiers)

    def forget(self, model: str) -> None:
        """No live rollout: the next one's samples start when it does."""
        self._cursors = {k: v for k, v in self._cursors.items() if k[1] != model}
        self._stages.pop(model, None)

    def _readings(self, model: str, agents: Mapping[str, Sequence[str]]
                  ) -> tuple[list[VersionReading], list[str]]:
        """This poll's readings, and the agents that could not be read."""
        readings, unreadable = [], []
        for tier, addresses in agents.items():
            for agent in addresses:
                key = (agent, model)
                first = key not in self._cursors
                try:
                    reply = tpb_grpc.TelemetryStub(self._channel(agent)).Stats(
                        tpb.StatsRequest(model_name=model, cursor=self._cursors.get(key, 0.0)),
                        timeout=RPC_TIMEOUT_S)
                except grpc.RpcError as error:  # an agent away: its samples are missing
                    log.warning("telemetry of %s unreadable: %s", agent, error.code().name)
                    unreadable.append(agent)
                    continue
                self._cursors[key] = reply.end
                if first:
                    continue  # what came before this stage's first poll is not its own
                readings.extend(
                    VersionReading(tier, int(v.model_version), v.success, v.failure,
                                   tuple(v.latency_samples_s),
                                   v.joules_per_inference if v.has_energy else None)
                    for v in reply.versions if v.model_version.isdigit())
        return readings, unreadable

    def _shadow(self, model: str, version: int | None, url: str | None
                ) -> dict[tuple[str, str], float]:
        if version is None or not url:
            return {}
        try:
            with urllib.request.urlopen(url, timeout=RPC_TIMEOUT_S) as reply:
                return shadow_counts(reply.read().decode(), model, version)
        except OSError as error:
            log.warning("router metrics unreadable: %s", error)
            return {}
