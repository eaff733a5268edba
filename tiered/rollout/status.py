"""The `TieredModel`'s status, as frozen dataclasses: the same on both backends."""

# spec_field returns dataclasses.field(...) with metadata; ruff cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered import names
from tiered.rollout.schema import spec_field
from tiered.rollout.wire import API_VERSION, spelling
from tiered.settings import Timestamp, load_dataclass

# An analysis run's verdicts: a metric not judged counts as Successful in it.
VERDICTS = tuple(o for o in names.Outcome if o != names.Outcome.NOT_JUDGED)


@dataclass(frozen=True)
class MetricResult:
    """One metric's outcome and every number it was decided from."""

    metric: str = spec_field(doc="latency_p95, latency_p99, latency_shift, error_rate, "
                             "energy_per_inference, agreement; of a generative model "
                             "ttft_p95, ttft_shift, tpot_p95, energy_per_token")
    outcome: str = spec_field(doc="the metric's outcome; NotJudged: shown, neither holding "
                              "nor failing the stage", enum=tuple(names.Outcome))
    reason: str = spec_field(doc="the outcome in words, with its numbers")
    numbers: Mapping[str, float] = spec_field(
        default_factory=dict, doc="samples, quantiles, test statistic, p-value, thresholds")
    tier: str | None = spec_field(
        default=None, doc="the tier judged; null for agreement, judged over every tier")

    @property
    def label(self) -> str:
        return self.metric if self.tier is None else f"{self.metric} on {self.tier}"


@dataclass(frozen=True)
class AnalysisRun:
    """One analysis of canary vs stable: the worst metric outcome wins."""

    window: int = spec_field(doc="measurement window judged; the same window counts once")
    verdict: str = spec_field(doc="worst outcome of the metrics judged", enum=VERDICTS)
    metrics: tuple[MetricResult, ...] = spec_field(default=(), doc="per metric")

    def with_outcome(self, outcome: str) -> tuple[MetricResult, ...]:
        return tuple(m for m in self.metrics if m.outcome == outcome)

    def summary(self) -> str:
        return "; ".join(f"{m.label} {m.outcome}: {m.reason}" for m in self.metrics)


@dataclass(frozen=True)
class RolloutStatus:
    """Everything the engine needs to resume: all progress lives here."""

    stable_version: int = spec_field(doc="version serving the rest of the traffic", minimum=0)
    canary_version: int | None = spec_field(None, doc="version being rolled out", minimum=1)
    stage_index: int = spec_field(0, doc="current stage of spec.rollout.stages", minimum=0)
    phase: str = spec_field(names.Phase.PROGRESSING, doc="where the rollout stands",
                            enum=tuple(names.Phase))
    stage_started_at: Timestamp = spec_field(0.0, doc="when the current stage began (moved "
                                             "on by the time it was held blind)")
    blind_since: Timestamp | None = spec_field(
        None, doc="when the stage's telemetry became unreadable: its clock stops (min and "
        "max duration) until every agent reads again")
    consecutive_failures: int = spec_field(0, doc="failed analyses in a row", minimum=0)
    paused: bool = spec_field(False, doc="true while paused (by hand, by onFailure or "
                              "onUndecided)")
    last_analysis: AnalysisRun | None = spec_field(None, doc="the latest analysis")
    message: str = spec_field("", doc="the latest decision's reason")
    promoting: bool = spec_field(False, doc="true while a promotion waits for the canary's "
                                 "agents to be ready at every tier's count")


@dataclass(frozen=True)
class ArtifactVersion:
    """A version number given to one artifact digest; numbers are never reused."""

    version: int = spec_field(doc="version number the agents serve it as", minimum=1)
    uri: str = spec_field(doc="where the artifact was", min_length=1)
    sha256: str = spec_field(doc="its digest", pattern=r"[0-9a-f]{64}")


CONDITION_STATUSES = ("True", "False", "Unknown")


@dataclass(frozen=True)
class Condition:
    """One aspect of the resource's state, in Kubernetes' `metav1.Condition`
    shape (hence the camelCase names), so `kubectl wait --for=condition=Ready`
    and kstatus read it."""

    type: str = spec_field(doc="Ready, Progressing or Degraded", min_length=1)
    status: str = spec_field(doc="True, False or Unknown", enum=CONDITION_STATUSES)
    reason: str = spec_field(doc="why, in one CamelCase word", pattern=r"[A-Za-z][A-Za-z0-9]*")
    lastTransitionTime: str = spec_field(doc="when status last changed (RFC 3339)",
                                         min_length=1)
    message: str = spec_field("", doc="why, in words")
    observedGeneration: int = spec_field(0, doc="the spec generation it was set for",
                                         minimum=0)


@dataclass(frozen=True)
class HistoryEntry:
    """One step of the rollout (a start, advance, promotion, rollback, pause,
    abort), with the numbers it was taken on."""

    t: Timestamp = spec_field(doc="when")
    action: str = spec_field(doc="start, advance, promote, rollback, pause, resume, abort")
    reason: str = spec_field(doc="the decision in words, with its numbers")
    phase: str = spec_field(doc="the rollout's phase after it", enum=tuple(names.Phase))
    stable_version: int = spec_field(doc="stable version after it", minimum=0)
    canary_version: int | None = spec_field(None, doc="canary version after it")
    stage: str = spec_field("", doc="the stage it left or entered, as 'N/M name'")
    numbers: Mapping[str, float] = spec_field(
        default_factory=dict, doc="the stage's headline numbers: requests, p95s, "
        "J/inference, agreement (generative: TTFT and TPOT p95s, J/token)")
    sources: Mapping[str, str] = spec_field(
        default_factory=dict, doc="where each J/inference (J/token) number came from: nvml, "
        "rapl (measured) or model (an estimate)")


@dataclass(frozen=True)
class Retirement:
    """A version no longer wanted, kept until `after` so that every router has
    read a routing table without it."""

    version: int = spec_field(doc="the version", minimum=1)
    after: Timestamp = spec_field(doc="when it may go")


@dataclass(frozen=True)
class Recommendation:
    """What one look at a tier's load recommended (kept for the stabilisation
    windows; a look that recommends what the one before did is not kept)."""

    t: Timestamp = spec_field(doc="when")
    replicas: int = spec_field(doc="agents recommended", minimum=0)


@dataclass(frozen=True)
class TierScale:
    """One autoscaled tier: its agents, and why that many."""

    replicas: int = spec_field(doc="agents the tier runs", minimum=0)
    reason: str = spec_field("", doc="the latest decision in words, with its numbers")
    value: float | None = spec_field(None, doc="the metric per agent at the latest look")
    changed_at: Timestamp = spec_field(0.0, doc="when replicas last changed")
    last_request_at: Timestamp | None = spec_field(
        None, doc="when a request was last seen (or the tier last woke)")
    recommendations: tuple[Recommendation, ...] = spec_field(
        (), doc="recent recommendations, oldest first, for the stabilisation windows")


@dataclass(frozen=True)
class TieredModelStatus:
    """The resource's status, the same on both backends: the rollout's progress
    plus what the controller keeps so that a restarted one resumes."""

    rollout: RolloutStatus | None = spec_field(None, doc="the rollout; null before the "
                                               "first version serves")
    artifacts: tuple[ArtifactVersion, ...] = spec_field((), doc="every artifact seen, "
                                                        "with its version number")
    weights: Mapping[str, float] = spec_field(default_factory=dict, keys=names.TIERS,
                                              doc="percent of each tier's traffic on the "
                                              "canary now")
    stage: str = spec_field("", doc="the live stage, as 'N/M name'; empty when none")
    weights_summary: str = spec_field("", doc="weights in one line, for kubectl get")
    observed_generation: int = spec_field(0, doc="the spec generation this status is for",
                                          minimum=0)
    message: str = spec_field("", doc="the latest event or error, in words")
    conditions: tuple[Condition, ...] = spec_field((), doc="Ready, Progressing, Degraded")
    history: tuple[HistoryEntry, ...] = spec_field(
        (), doc="the rollout's latest steps, oldest first (bounded)")
    retiring: tuple[Retirement, ...] = spec_field(
        (), doc="versions on their way out, and when they go")
    stage_samples: Mapping[str, Any] | None = spec_field(
        None, doc="the live stage's samples so far (counts, latency buckets, energy "
        "windows, shadow counts, telemetry cursors): a restarted controller goes on "
        "from them")
    scaling: Mapping[str, TierScale] = spec_field(
        default_factory=dict, keys=names.TIERS, doc="each autoscaled tier's agents and "
        "why (spec.tiers.*.autoscaling)")


def load_status(data: Any, where: str, version: str = API_VERSION) -> TieredModelStatus:
    """A stored status, as `to_plain` wrote it (or as v1alpha1 did)."""
    return load_dataclass(TieredModelStatus, data or {}, where, spelling(version))
