"""The `TieredModel` spec, as frozen dataclasses.

Each field's constraints are declared with `spec_field` (`tiered.rollout.schema`);
cross-field rules (durations, stage tiers) live in `__post_init__`. Pure data:
no I/O here (`load_tiered_model` takes an already-parsed mapping). One document
drives the host backend and Kubernetes; `tiered.rollout.wire` says how it is
written.
"""

# spec_field returns dataclasses.field(...) with metadata; ruff cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered import names
from tiered.errors import ConfigError
from tiered.rollout.schema import Checked, spec_field
from tiered.rollout.wire import (
    API_GROUP,
    API_VERSION,
    KIND,
    OLD_VERSIONS,
    respell,
    spelling,
    wire_key,
)
from tiered.settings import Quantity, load_dataclass


@dataclass(frozen=True)
class Artifact(Checked):
    """The ONNX artifact every tier's engine is built from."""

    uri: str = spec_field(doc="path or URI of the ONNX model", min_length=1)
    sha256: str | None = spec_field(
        None, doc="hex SHA-256 of the artifact; when omitted, `tiered apply` pins the "
        "file's digest at apply time", pattern=r"[0-9a-f]{64}")
    calibration: str | None = spec_field(
        None, doc="npz of representative inputs for INT8 calibration; random inputs when "
        "omitted")
    eval: str | None = spec_field(
        None, doc="npz of held-out inputs (and labels) the tier builds are judged on")
    calibration_sha256: str | None = spec_field(
        None, doc="hex SHA-256 of the calibration file, required with it; `tiered apply` "
        "pins a local file's", pattern=r"[0-9a-f]{64}")
    eval_sha256: str | None = spec_field(
        None, doc="hex SHA-256 of the eval file, required with it; `tiered apply` pins a "
        "local file's", pattern=r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Batching(Checked):
    max_batch_size: int = spec_field(8, doc="largest batch the engine runs",
                                     minimum=1, maximum=4096)
    max_queue_delay_us: int = spec_field(
        1000, doc="longest a request waits for a batch to fill", minimum=0, maximum=10_000_000)


@dataclass(frozen=True)
class Toleration(Checked):
    """A Kubernetes toleration, for tiers on tainted nodes (edge gateways, GPU pools)."""

    key: str = spec_field("", doc="taint key; empty with Exists: every taint")
    operator: str = spec_field("Equal", doc="Equal or Exists", enum=("Equal", "Exists"))
    value: str = spec_field("", doc="taint value (Equal)")
    effect: str = spec_field("", doc="empty: every effect",
                             enum=("", "NoSchedule", "PreferNoSchedule", "NoExecute"))


GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Resources(Checked):
    """Container resources of the tier's agents, as Kubernetes quantities."""

    requests: Mapping[str, Quantity] = spec_field(default_factory=dict,
                                                  doc="e.g. {cpu: 2, memory: 4Gi}")
    limits: Mapping[str, Quantity] = spec_field(default_factory=dict,
                                                doc="e.g. {nvidia.com/gpu: 1}")

    def __post_init__(self) -> None:
        super().__post_init__()
        for kind in ("requests", "limits"):
            gpus = str(getattr(self, kind).get(GPU_RESOURCE, "0"))
            if not gpus.isdigit():
                raise ConfigError(f"resources.{kind}.{GPU_RESOURCE}: a whole number of GPUs, "
                                  f"got {gpus!r}")

    @property
    def gpus(self) -> int:
        """GPUs a pod asks for: the limit, else the request (they must agree)."""
        return int(str(self.limits.get(GPU_RESOURCE) or self.requests.get(GPU_RESOURCE) or 0))


@dataclass(frozen=True)
class Autoscaling(Checked):
    """Agents of a tier that follow its load (`tiered.controller.scaling`)."""

    min_replicas: int = spec_field(1, doc="fewest agents while the tier serves "
                                   "(scaleToZero lets it go to none when idle)",
                                   minimum=1, maximum=1000)
    max_replicas: int = spec_field(4, doc="most agents", minimum=1, maximum=1000)
    metric: str = spec_field(
        names.ScaleMetric.CONCURRENCY, enum=tuple(names.ScaleMetric),
        doc="what is held at the target, per agent, over each read of its telemetry: "
        "concurrency (requests inside the agent at once, the sum of their latencies over "
        "the window, as Knative's KPA scales), or utilization (the share of the window its "
        "engines were busy)")
    target: float = spec_field(2.0, doc="the metric's value per agent to hold (utilization: "
                               "a share, at most 1)", minimum=0.0, exclusive_minimum=True)
    tolerance: float = spec_field(0.1, doc="no change while the metric is within this "
                                  "share of its target", minimum=0.0, maximum=1.0)
    scale_to_zero: bool = spec_field(False, doc="go to no agent after idleSeconds without a "
                                     "request; the router sends the tier's requests to the "
                                     "next tier meanwhile, and its unmet demand wakes it")
    idle_s: float = spec_field(300.0, doc="seconds without a request before a scaleToZero "
                               "tier goes to zero", minimum=0.0)
    scale_up_window_s: float = spec_field(
        0.0, doc="stabilisation: a scale-up follows the lowest recommendation of this "
        "window", minimum=0.0, maximum=3600.0)
    scale_down_window_s: float = spec_field(
        60.0, doc="stabilisation: a scale-down follows the highest recommendation of this "
        "window, so a dip does not remove agents a burst needs again", minimum=0.0,
        maximum=3600.0)
    max_scale_up: int = spec_field(4, doc="most agents added at one change",
                                   minimum=1, maximum=1000)
    max_scale_down: int | None = spec_field(
        None, doc="most agents removed at one change; null: down to the scale-down "
        "window's highest recommendation at once, as the HPA's default policy (going to "
        "zero when idle is one change)", minimum=1, maximum=1000)
    scale_period_s: float = spec_field(
        15.0, doc="least time between two changes of the count (going to zero and waking "
        "aside), so maxScaleUp and maxScaleDown bound a rate, as the HPA's periodSeconds",
        minimum=0.0, maximum=3600.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_replicas > self.max_replicas:
            raise ConfigError(f"maxReplicas: must be at least minReplicas "
                              f"({self.min_replicas}), got {self.max_replicas}")
        if self.metric == names.ScaleMetric.UTILIZATION and self.target > 1:
            raise ConfigError(f"target: utilization is a share of the window, at most 1, "
                              f"got {self.target:g}")


@dataclass(frozen=True)
class TierSpec(Checked):
    """How one tier runs the model."""

    engine: str | None = spec_field(None, doc="engine backend; null: the tier profile's",
                                    enum=tuple(names.Backend))
    precision: str | None = spec_field(
        None, doc="numeric precision of the tier build; null: the tier profile's",
        enum=tuple(names.Precision))
    replicas: int = spec_field(1, doc="agents of this tier serving the model (with "
                               "autoscaling: where it starts)", minimum=0, maximum=1000)
    autoscaling: Autoscaling | None = spec_field(
        None, doc="agents that follow the load between minReplicas and maxReplicas; null: "
        "a fixed `replicas`")
    batching: Batching = spec_field(default_factory=Batching, doc="dynamic batching")
    per_node: bool = spec_field(False, doc="Kubernetes: one agent on every matching node "
                                "(a DaemonSet) instead of `replicas`")
    node_selector: Mapping[str, str] = spec_field(default_factory=dict,
                                                  doc="Kubernetes: node labels to run on")
    tolerations: tuple[Toleration, ...] = spec_field((), doc="Kubernetes: taints to accept")
    resources: Resources = spec_field(default_factory=Resources,
                                      doc="Kubernetes: the agent container's resources")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.autoscaling is not None and self.per_node:
            raise ConfigError("autoscaling: a tier with perNode runs an agent on every "
                              "matching node; leave one of them out")


@dataclass(frozen=True)
class CascadeSettings(Checked):
    tiers: tuple[str, ...] = spec_field(names.TIERS, doc="escalation order, cheapest first",
                                        min_items=1, enum=names.TIERS)
    threshold: float = spec_field(0.9, doc="escalate when confidence is below this",
                                  minimum=0.0, maximum=1.0)
    output: str = spec_field("", doc="output judged for confidence; empty: the only one")

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(set(self.tiers)) != len(self.tiers):
            raise ConfigError("tiers: a tier is listed twice")


@dataclass(frozen=True)
class Split(Checked):
    """A vision-language model's stages on two tiers (`tiered.router.dataplane`)."""

    vision: str = spec_field(doc="the tier whose agents encode the image", enum=names.TIERS)
    decoder: str = spec_field(doc="the tier whose agents answer from the visual tokens",
                              enum=names.TIERS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vision == self.decoder:
            raise ConfigError(f"decoder: the same tier as vision ({self.vision}); a split "
                              "needs two")


@dataclass(frozen=True)
class Routing(Checked):
    policy: str = spec_field(names.Policy.SLO_ENERGY, doc="how the router picks a tier",
                             enum=tuple(names.Policy))
    slo_ms: float = spec_field(50.0, doc="latency target when a request sets none",
                               minimum=0.0, exclusive_minimum=True)
    cascade: CascadeSettings = spec_field(default_factory=CascadeSettings,
                                          doc="settings of the cascade policy")
    split: Split | None = spec_field(
        None, doc="a vision-language model: requests with an image (and no tier hint) are "
        "encoded on the vision tier and answered on the decoder tier; null: whole on one tier")


@dataclass(frozen=True)
class Stage(Checked):
    """One step of the rollout: canary traffic per tier and how long to judge it."""

    name: str = spec_field(doc="shown in status and the CLI", min_length=1)
    weights: Mapping[str, float] = spec_field(
        doc="percent of each tier's traffic sent to the canary; unlisted tiers get 0",
        keys=names.TIERS, minimum=0.0, maximum=100.0)
    # The defaults give the analysis the data to catch what bench/judge.py
    # simulates (e.g. errors 0.5% -> 2%) at 5% of 100 requests/s.
    min_requests: int = spec_field(
        1000, doc="canary requests needed before the stage can pass", minimum=1)
    min_duration_s: float = spec_field(
        600.0, doc="seconds the stage runs at least before it can pass", minimum=0.0)
    max_duration_s: float = spec_field(
        3600.0, doc="seconds after which a stage still undecided (too few requests or samples "
        "to decide) follows onUndecided", minimum=0.0, exclusive_minimum=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_duration_s > self.max_duration_s:
            raise ConfigError(f"max_duration_s: must be at least the minimum duration "
                              f"({self.min_duration_s:g} s), got {self.max_duration_s:g}")


@dataclass(frozen=True)
class LatencyBound(Checked):
    """A latency percentile (p95, p99) of the canary against stable's: of
    requests, or of a generative model's first token or time per token."""

    max_ratio: float = spec_field(
        1.05, doc="the canary's percentile may exceed stable's by this factor before it "
        "regresses", minimum=1.0)
    max_ms: float | None = spec_field(
        None, doc="absolute bound on the canary's percentile (ms); null: none",
        minimum=0.0, exclusive_minimum=True)


@dataclass(frozen=True)
class ShiftBound(Checked):
    """The canary's latencies as a whole against stable's (a location test)."""

    max_ratio: float = spec_field(
        1.05, doc="canary latencies as a whole (a Mann-Whitney shift, not one quantile) may "
        "exceed stable's by this factor before they regress", minimum=1.0)


@dataclass(frozen=True)
class ErrorRateBound(Checked):
    max: float | None = spec_field(0.01, doc="absolute bound on the canary's error rate",
                                   minimum=0.0, maximum=1.0)
    max_ratio: float = spec_field(
        2.0, doc="canary error rate may exceed stable's by this factor", minimum=1.0)


@dataclass(frozen=True)
class EnergyBound(Checked):
    """Energy per inference, or per output token of a generative model."""

    max_ratio: float = spec_field(
        1.1, doc="canary J/inference (J/token) may exceed stable's by this factor",
        minimum=1.0)
    min_windows: int = spec_field(
        5, doc="telemetry windows of J/inference (J/token) needed per version (the rank "
        "test behind it fails a canary only from about 20 windows a version on)", minimum=2)
    allow_modeled: bool = spec_field(
        False, doc="judge figures that are not measured: the CPU-time model (source model, "
        "an estimate) or an unknown source. Off: such figures are reported and never fail "
        "a rollout. Figures of different sources (nvml vs model) are never judged")


@dataclass(frozen=True)
class AgreementBound(Checked):
    min: float = spec_field(0.99, doc="least share of shadowed requests where canary and "
                            "stable agree (judged by its lower confidence bound)",
                            minimum=0.0, maximum=1.0)


@dataclass(frozen=True)
class AnalysisSpec(Checked):
    """What a canary must show; a metric set to null is not judged, nor one
    of the other kind of model (`METRICS_OF_KIND`)."""

    latency_p95: LatencyBound | None = spec_field(
        default_factory=LatencyBound, doc="the 95th percentile of request latency, canary "
        "vs stable: a tail test (predictive models)")
    latency_p99: LatencyBound | None = spec_field(
        None, doc="the 99th percentile of request latency, canary vs stable; null: not judged "
        "(predictive models)")
    latency_shift: ShiftBound | None = spec_field(
        default_factory=ShiftBound, doc="request latency as a whole, canary vs stable: a "
        "location test (predictive models)")
    error_rate: ErrorRateBound | None = spec_field(default_factory=ErrorRateBound,
                                                   doc="share of failed requests")
    energy_per_inference: EnergyBound | None = spec_field(
        default_factory=EnergyBound, doc="joules per inference (predictive models)")
    agreement: AgreementBound | None = spec_field(
        default_factory=AgreementBound, doc="shadow agreement with stable (generative "
        "models: greedy requests whose token ids are stable's)")
    ttft_p95: LatencyBound | None = spec_field(
        default_factory=LatencyBound, doc="the 95th percentile of time to first token, "
        "canary vs stable: a tail test (generative models)")
    ttft_shift: ShiftBound | None = spec_field(
        default_factory=ShiftBound, doc="time to first token as a whole, canary vs stable: "
        "a location test (generative models)")
    tpot_p95: LatencyBound | None = spec_field(
        default_factory=LatencyBound, doc="the 95th percentile of time per output token, "
        "canary vs stable: a tail test (generative models)")
    energy_per_token: EnergyBound | None = spec_field(
        default_factory=EnergyBound, doc="joules per output token (generative models)")
    confidence: float = spec_field(
        0.995, doc="1 - the probability that a canary with no regression is rolled back, "
        "per rollout: over every look, metric, tier and stage", minimum=0.5, maximum=1.0,
        exclusive_maximum=True)
    min_samples: int = spec_field(
        50, doc="samples per version below which a metric is inconclusive", minimum=1)
    consecutive_failure_limit: int = spec_field(
        1, doc="failed analyses in a row before onFailure", minimum=1, maximum=100)
    interval_s: float = spec_field(
        10.0, doc="seconds between analyses: the stage is judged once per interval, so "
        "failures in a row are failures of distinct looks at growing data", minimum=0.1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not any(getattr(self, metric) for metrics in METRICS_OF_KIND.values()
                   for metric in metrics):
            raise ConfigError("every metric is null; judge at least one")

    def judged(self, kind: str) -> dict[str, Any]:
        """The metrics a model of `kind` is judged on, name -> bound, in
        `METRICS_OF_KIND`'s order; nulls left out."""
        return {metric: bound for metric in METRICS_OF_KIND[kind]
                if (bound := getattr(self, metric)) is not None}


# The metrics each kind of model is judged on. A metric of the other kind is
# ignored, its default included, so one analysis block serves either kind.
METRICS_OF_KIND: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    names.ModelKind.PREDICTIVE: ("latency_p95", "latency_p99", "latency_shift", "error_rate",
                                 "energy_per_inference", "agreement"),
    names.ModelKind.GENERATIVE: ("ttft_p95", "ttft_shift", "tpot_p95", "error_rate",
                                 "energy_per_token", "agreement"),
    names.ModelKind.VISION_LANGUAGE: ("ttft_p95", "ttft_shift", "tpot_p95", "error_rate",
                                      "energy_per_token", "agreement"),
})


@dataclass(frozen=True)
class RolloutSpec(Checked):
    stages: tuple[Stage, ...] = spec_field(doc="canary steps, in order", min_items=1,
                                           max_items=32)
    analysis: AnalysisSpec = spec_field(default_factory=AnalysisSpec,
                                        doc="how each stage is judged")
    on_failure: str = spec_field(
        names.OnFailure.ROLLBACK, doc="what a stage does once its analysis has failed "
        "consecutiveFailureLimit times in a row: rollback, or pause for a person to decide",
        enum=tuple(names.OnFailure))
    on_undecided: str = spec_field(
        names.OnUndecided.PAUSE, doc="what a stage still undecided at its maxDurationSeconds "
        "does (too few canary requests, a test short of samples, no measurements): pause, "
        "for a person to resume it (another maxDurationSeconds), promote or abort it; or "
        "rollback. Too little data is no evidence against the canary, hence the default. "
        "A stage whose canary served no request at all pauses whatever this says",
        enum=tuple(names.OnUndecided))
    shadow_fraction: float = spec_field(
        0.1, doc="share of stable requests also sent to the canary to measure agreement",
        minimum=0.0, maximum=1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [stage.name for stage in self.stages]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise ConfigError(f"stages[{index}]: name {name!r} is used twice")


@dataclass(frozen=True)
class TieredModel(Checked):
    """A model served on the tiers, and how new versions of it roll out."""

    name: str = spec_field(doc="model name", min_length=1,
                           pattern=r"[a-z0-9]([-a-z0-9_.]*[a-z0-9])?")
    artifact: Artifact = spec_field(doc="the model artifact")
    tiers: Mapping[str, TierSpec] = spec_field(doc="tiers that serve the model",
                                                keys=names.TIERS)
    rollout: RolloutSpec = spec_field(doc="staged canary of a new version")
    routing: Routing = spec_field(default_factory=Routing, doc="routing policy")
    kind: str = spec_field(
        names.ModelKind.PREDICTIVE, enum=tuple(names.ModelKind),
        doc="predictive: one answer a request, judged on request latency and J/inference; "
        "generative: tokens streamed, judged on time to first token, time per output token "
        "and J/token; vision-language: an image and text in, tokens streamed, judged as "
        "generative (its vision stage's time in the first token's). Said, not guessed from "
        "the artifact")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tiers:
            raise ConfigError("tiers: needs at least one tier")
        split = self.routing.split
        if split is not None:
            if self.kind != names.ModelKind.VISION_LANGUAGE:
                raise ConfigError(f"routing.split: only for kind {names.ModelKind.VISION_LANGUAGE}"
                                  f" (its stages), not {self.kind}")
            for role in ("vision", "decoder"):
                if getattr(split, role) not in self.tiers:
                    raise ConfigError(f"routing.split.{role}: tier {getattr(split, role)!r} is "
                                      "not one of the model's tiers")
        if not self.rollout.analysis.judged(self.kind):
            raise ConfigError(f"rollout.analysis: every metric a {self.kind} model is judged "
                              f"on ({', '.join(map(wire_key, METRICS_OF_KIND[self.kind]))}) "
                              "is null; judge at least one")
        for index, stage in enumerate(self.rollout.stages):
            for tier, weight in stage.weights.items():
                if tier not in self.tiers and weight > 0:
                    raise ConfigError(f"rollout.stages[{index}].weights: tier {tier!r} is not "
                                      f"one the model runs on ({', '.join(self.tiers)})")
        for tier in self.routing.cascade.tiers:
            if self.routing.policy == names.Policy.CASCADE and tier not in self.tiers:
                raise ConfigError(f"routing.cascade.tiers: tier {tier!r} is not one the "
                                  f"model runs on ({', '.join(self.tiers)})")


def load_tiered_model(data: Any, where: str = KIND) -> TieredModel:
    """A TieredModel from a parsed mapping: a Kubernetes object (apiVersion,
    kind, metadata.name, spec), or flat (`name:` beside the spec keys, which are
    the Python field names: the form code and tests build)."""
    if isinstance(data, Mapping) and "spec" in data:
        version = _api_version(data, where)
        if data.get("kind") != KIND:
            raise ConfigError(f"{where}.kind: expected {KIND}, got {data.get('kind')!r}")
        metadata = data.get("metadata")
        if not isinstance(metadata, Mapping) or not metadata.get("name"):
            raise ConfigError(f"{where}.metadata.name: required")
        spec = data["spec"]
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where}.spec: expected a mapping, got {type(spec).__name__}")
        if "name" in spec:
            raise ConfigError(f"{where}.spec: unknown key 'name'; the name is metadata.name")
        try:
            return load_dataclass(TieredModel, {"name": metadata["name"], **spec},
                                  f"{where}.spec", spelling(version))
        except ConfigError as error:  # the name came from metadata.name: say so
            prefix = f"{where}.spec.name: "
            if str(error).startswith(prefix):
                raise ConfigError(f"{where}.metadata.name: {str(error)[len(prefix):]}") from error
            raise
    return load_dataclass(TieredModel, data, where)


def _api_version(data: Mapping[str, Any], where: str) -> str:
    group, _, version = str(data.get("apiVersion", "")).partition("/")
    if group != API_GROUP or version not in (API_VERSION, *OLD_VERSIONS):
        raise ConfigError(f"{where}.apiVersion: expected {API_GROUP}/{API_VERSION}, "
                          f"got {data.get('apiVersion')!r}")
    return version


def as_resource(document: Mapping[str, Any]) -> dict[str, Any]:
    """A TieredModel document as a Kubernetes object of the current API
    version, keeping what it says as written: a flat or v1alpha1 document's
    keys are respelled, the rest (metadata, unset fields) left as they were."""
    if "spec" in document:
        resource = dict(document)
        if _api_version(document, KIND) == API_VERSION:
            return resource
        resource["spec"] = respell(TieredModel, document["spec"])
    else:
        spec = {k: v for k, v in document.items() if k != "name"}
        resource = {"kind": KIND, "metadata": {"name": document.get("name")},
                    "spec": respell(TieredModel, spec)}
    resource["apiVersion"] = f"{API_GROUP}/{API_VERSION}"
    return resource
