"""The names every part of tiered shares: tiers, engines, precisions, routing
policies, rollout phases and actions, onFailure and onUndecided values, metric
outcomes and energy sources.

Each set is one `StrEnum`, defined here once. A member equals its string, so
YAML, JSON, the CRD and the wire carry the same plain words as before, and a
value read from a document compares equal to the member it names. A leaf: it
imports nothing of ours, so every package (the pure rollout judge and the
protocol included) may import it.
"""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    EDGE = "edge"
    REGIONAL = "regional"
    DATACENTER = "datacenter"


# Cheapest first: the order a cascade escalates in and tables list tiers in.
TIERS: tuple[Tier, ...] = tuple(Tier)


class Backend(StrEnum):
    """An engine backend (`tiered.engines`; a TieredModel's `engine`)."""

    ONNXRUNTIME = "onnxruntime"
    TORCH = "torch"
    TENSORRT = "tensorrt"


class Precision(StrEnum):
    """A tier build's numeric precision; which backend builds which is
    `tiered.engines.build`'s to say."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    FP8 = "fp8"


class ModelKind(StrEnum):
    """What a TieredModel serves, which decides what its rollouts are judged
    on: one answer per request (request latency, J/inference) or tokens
    streamed (time to first token, time per output token, J/token): a
    generative model's, or a vision-language model's, which answers an image
    and a question (its vision stage's time counted in the first token's)."""

    PREDICTIVE = "predictive"
    GENERATIVE = "generative"
    VISION_LANGUAGE = "vision-language"

    @property
    def streams_tokens(self) -> bool:
        """Judged on its tokens (TTFT, TPOT, J/token), not on its requests."""
        return self is not ModelKind.PREDICTIVE


class Policy(StrEnum):
    """How the router picks a tier for a request."""

    SLO_ENERGY = "slo-energy"
    CASCADE = "cascade"


class ScaleMetric(StrEnum):
    """The per-agent quantity a tier's autoscaling holds at its target."""

    CONCURRENCY = "concurrency"  # requests inside an agent at once, over the window
    UTILIZATION = "utilization"  # the share of the window its engines were busy


class OnFailure(StrEnum):
    """What a rollout stage does once its analysis has failed
    consecutiveFailureLimit times in a row."""

    ROLLBACK = "rollback"
    PAUSE = "pause"


class OnUndecided(StrEnum):
    """What a rollout stage still undecided at its maxDurationSeconds does:
    too little data to decide is no evidence against the canary, so by
    default a person decides (pause)."""

    PAUSE = "pause"
    ROLLBACK = "rollback"


class Phase(StrEnum):
    """Where a rollout stands."""

    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    PROMOTED = "Promoted"
    ROLLED_BACK = "RolledBack"
    ABORTED = "Aborted"


class Action(StrEnum):
    """A step of a rollout: what the engine decided, or a person asked for."""

    START = "start"
    ADVANCE = "advance"
    HOLD = "hold"
    ROLLBACK = "rollback"
    PROMOTE = "promote"
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"
    RETRY = "retry"


class Outcome(StrEnum):
    """A metric's (and an analysis run's) outcome. NotJudged is a metric's
    only: shown with its comparison, it neither holds nor fails a stage (an
    energy figure that is not a measurement), so a run is never NotJudged."""

    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"
    NOT_JUDGED = "NotJudged"


class EnergySource(StrEnum):
    """Where an energy figure comes from: a GPU's or a CPU package's counter
    (measurements), or CPU time times configured watts (an estimate)."""

    NVML = "nvml"
    RAPL = "rapl"
    MODEL = "model"


MEASURED_ENERGY = frozenset({EnergySource.NVML, EnergySource.RAPL})


def energy_source_label(source: str) -> str:
    """A figure's source as shown beside it: a modeled figure says it is an
    estimate, and a figure of no known source says so."""
    if source == EnergySource.MODEL:
        return "model, estimate"
    return source or "source unknown"


def energy_sources_label(stable: str | None, canary: str | None) -> str:
    """Stable's and the canary's sources as one label: one source once, two
    each named; None is a version with no figure yet."""
    if stable == canary:
        return energy_source_label(stable or "")
    return ", ".join(f"{who} " + ("no figure yet" if source is None
                                  else energy_source_label(source))
                     for who, source in (("stable", stable), ("canary", canary)))
