"""The `TieredModel` spec and the rollout status, as frozen dataclasses.

One schema definition: each field's constraints (range, enum, pattern, item
count, allowed mapping keys) are declared once in the field's metadata with
`spec_field`. `check_fields` enforces them when a dataclass is built (so
`tiered.settings.load_dataclass` reports a bad value with its field path) and
`openapi_schema` turns the same dataclasses into the CRD's openAPIV3Schema.
Cross-field rules (durations, stage tiers) live in `__post_init__`.

Pure data: no I/O here (`load_tiered_model` takes an already-parsed mapping).
One document drives the local backend and Kubernetes. As written (API version
v1alpha2) keys are camelCase, Kubernetes' convention, with units spelled out
(`interval_s` is `intervalSeconds`, `slo_ms` is `sloMilliseconds`; `wire_key`
is the one rule), and times are RFC 3339 strings. The fields keep their
snake_case names in Python. Documents of v1alpha1 (the same fields in
snake_case) are still read; `to_document` writes the current version.
"""

# spec_field returns dataclasses.field(...) with metadata; ruff cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered import names
from tiered.errors import ConfigError
from tiered.settings import Quantity, Timestamp, load_dataclass, rfc3339

API_GROUP = "tiered.dev"
API_VERSION = "v1alpha2"
OLD_VERSIONS = ("v1alpha1",)  # read and converted; keys are the Python field names
KIND = "TieredModel"
_UNITS = {"s": "Seconds", "ms": "Milliseconds", "us": "Microseconds"}
_RENAMED = {"t": "time"}


def wire_key(name: str) -> str:
    """A field's key as written: camelCase with its unit spelled out
    (`max_duration_s` -> `maxDurationSeconds`)."""
    if name in _RENAMED:
        return _RENAMED[name]
    first, *rest = name.split("_")
    if rest and rest[-1] in _UNITS:
        rest[-1] = _UNITS[rest[-1]]
    return first + "".join(part[:1].upper() + part[1:] for part in rest)


def wire_path(*names: str) -> str:
    """Nested fields as written, for messages a user reads beside the YAML
    (`wire_path("energy_per_inference", "allow_modeled")` ->
    `energyPerInference.allowModeled`)."""
    return ".".join(wire_key(name) for name in names)

_CONSTRAINTS = frozenset({
    "minimum", "maximum", "exclusive_minimum", "exclusive_maximum", "enum",
    "min_items", "max_items", "min_length", "pattern", "keys",
})


def spec_field(default: Any = dataclasses.MISSING, *, doc: str = "",
               default_factory: Any = dataclasses.MISSING, **constraints: Any) -> Any:
    """A dataclass field with its constraints and description as metadata.

    Scalars: minimum, maximum, exclusive_minimum/maximum (bools, OpenAPI 3.0
    style), enum, min_length, pattern. Tuples: min_items, max_items; enum and
    the numeric bounds apply to the items. Mappings: keys (the allowed keys);
    enum and the numeric bounds apply to the values.
    """
    unknown = set(constraints) - _CONSTRAINTS
    if unknown:
        raise TypeError(f"spec_field: unknown constraint {min(unknown)!r}")
    metadata = {"doc": doc, **constraints}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _check_scalar(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    if "enum" in meta and value not in meta["enum"]:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(str, meta['enum']))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}: expected a finite number, got {value!r}")
        low, high = meta.get("minimum"), meta.get("maximum")
        if low is not None:
            if meta.get("exclusive_minimum") and not value > low:
                raise ConfigError(f"{name}: must be > {low}, got {value}")
            if not value >= low:
                raise ConfigError(f"{name}: must be >= {low}, got {value}")
        if high is not None:
            if meta.get("exclusive_maximum") and not value < high:
                raise ConfigError(f"{name}: must be < {high}, got {value}")
            if not value <= high:
                raise ConfigError(f"{name}: must be <= {high}, got {value}")
    if isinstance(value, str):
        if len(value) < meta.get("min_length", 0):
            raise ConfigError(f"{name}: must not be empty" if meta["min_length"] == 1
                              else f"{name}: needs at least {meta['min_length']} characters")
        if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
            raise ConfigError(f"{name}: {value!r} does not match {meta['pattern']}")


def check_fields(instance: Any) -> None:
    """Enforce the constraints declared with `spec_field`; errors name the field."""
    for f in dataclasses.fields(instance):
        meta = f.metadata
        value = getattr(instance, f.name)
        if value is None or not (set(meta) & _CONSTRAINTS):
            continue
        if isinstance(value, tuple):
            if len(value) < meta.get("min_items", 0):
                raise ConfigError(f"{f.name}: needs at least {meta['min_items']} item"
                                  f"{'s' if meta['min_items'] > 1 else ''}")
            if "max_items" in meta and len(value) > meta["max_items"]:
                raise ConfigError(f"{f.name}: at most {meta['max_items']} items")
            for index, item in enumerate(value):
                _check_scalar(f"{f.name}[{index}]", item, meta)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if "keys" in meta and key not in meta["keys"]:
                    raise ConfigError(f"{f.name}: unknown key {key!r}; expected one "
                                      f"of {', '.join(meta['keys'])}")
                _check_scalar(f"{f.name}[{key!r}]", item, meta)
        else:
            _check_scalar(f.name, value, meta)


def _freeze_mappings(instance: Any) -> None:
    # load_dataclass builds plain dicts; a frozen spec should not hand out
    # mutable state.
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if isinstance(value, dict):
            object.__setattr__(instance, f.name, types.MappingProxyType(dict(value)))


class _Checked:
    """Base for spec dataclasses: declared constraints are checked on build."""

    def __post_init__(self) -> None:
        _freeze_mappings(self)
        check_fields(self)


# --- the spec ---------------------------------------------------------------


@dataclass(frozen=True)
class Artifact(_Checked):
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
class Batching(_Checked):
    max_batch_size: int = spec_field(8, doc="largest batch the engine runs",
                                     minimum=1, maximum=4096)
    max_queue_delay_us: int = spec_field(
        1000, doc="longest a request waits for a batch to fill", minimum=0, maximum=10_000_000)


@dataclass(frozen=True)
class Toleration(_Checked):
    """A Kubernetes toleration, for tiers on tainted nodes (edge gateways, GPU pools)."""

    key: str = spec_field("", doc="taint key; empty with Exists: every taint")
    operator: str = spec_field("Equal", doc="Equal or Exists", enum=("Equal", "Exists"))
    value: str = spec_field("", doc="taint value (Equal)")
    effect: str = spec_field("", doc="empty: every effect",
                             enum=("", "NoSchedule", "PreferNoSchedule", "NoExecute"))


GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Resources(_Checked):
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
class TierSpec(_Checked):
    """How one tier runs the model."""

    engine: str | None = spec_field(None, doc="engine backend; null: the tier profile's",
                                    enum=tuple(names.Backend))
    precision: str | None = spec_field(
        None, doc="numeric precision of the tier build; null: the tier profile's",
        enum=tuple(names.Precision))
    replicas: int = spec_field(1, doc="agents of this tier serving the model",
                               minimum=0, maximum=1000)
    batching: Batching = spec_field(default_factory=Batching, doc="dynamic batching")
    per_node: bool = spec_field(False, doc="Kubernetes: one agent on every matching node "
                                "(a DaemonSet) instead of `replicas`")
    node_selector: Mapping[str, str] = spec_field(default_factory=dict,
                                                  doc="Kubernetes: node labels to run on")
    tolerations: tuple[Toleration, ...] = spec_field((), doc="Kubernetes: taints to accept")
    resources: Resources = spec_field(default_factory=Resources,
                                      doc="Kubernetes: the agent container's resources")


@dataclass(frozen=True)
class CascadeSettings(_Checked):
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
class Routing(_Checked):
    policy: str = spec_field(names.Policy.SLO_ENERGY, doc="how the router picks a tier",
                             enum=tuple(names.Policy))
    slo_ms: float = spec_field(50.0, doc="latency target when a request sets none",
                               minimum=0.0, exclusive_minimum=True)
    cascade: CascadeSettings = spec_field(default_factory=CascadeSettings,
                                          doc="settings of the cascade policy")


@dataclass(frozen=True)
class Stage(_Checked):
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
class LatencyBound(_Checked):
    """A latency percentile (p95, p99) of the canary against stable's: of
    requests, or of a generative model's first token or time per token."""

    max_ratio: float = spec_field(
        1.05, doc="the canary's percentile may exceed stable's by this factor before it "
        "regresses", minimum=1.0)
    max_ms: float | None = spec_field(
        None, doc="absolute bound on the canary's percentile (ms); null: none",
        minimum=0.0, exclusive_minimum=True)


@dataclass(frozen=True)
class ShiftBound(_Checked):
    """The canary's latencies as a whole against stable's (a location test)."""

    max_ratio: float = spec_field(
        1.05, doc="canary latencies as a whole (a Mann-Whitney shift, not one quantile) may "
        "exceed stable's by this factor before they regress", minimum=1.0)


@dataclass(frozen=True)
class ErrorRateBound(_Checked):
    max: float | None = spec_field(0.01, doc="absolute bound on the canary's error rate",
                                   minimum=0.0, maximum=1.0)
    max_ratio: float = spec_field(
        2.0, doc="canary error rate may exceed stable's by this factor", minimum=1.0)


@dataclass(frozen=True)
class EnergyBound(_Checked):
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
class AgreementBound(_Checked):
    min: float = spec_field(0.99, doc="least share of shadowed requests where canary and "
                            "stable agree (judged by its lower confidence bound)",
                            minimum=0.0, maximum=1.0)


@dataclass(frozen=True)
class AnalysisSpec(_Checked):
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
})


@dataclass(frozen=True)
class RolloutSpec(_Checked):
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
class TieredModel(_Checked):
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
        "and J/token. Said, not guessed from the artifact")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tiers:
            raise ConfigError("tiers: needs at least one tier")
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


def load_status(data: Any, where: str, version: str = API_VERSION) -> TieredModelStatus:
    """A stored status, as `to_plain` wrote it (or as v1alpha1 did)."""
    return load_dataclass(TieredModelStatus, data or {}, where, spelling(version))


def _api_version(data: Mapping[str, Any], where: str) -> str:
    group, _, version = str(data.get("apiVersion", "")).partition("/")
    if group != API_GROUP or version not in (API_VERSION, *OLD_VERSIONS):
        raise ConfigError(f"{where}.apiVersion: expected {API_GROUP}/{API_VERSION}, "
                          f"got {data.get('apiVersion')!r}")
    return version


def spelling(version: str):
    """How the fields of `version` of the API are written."""
    return wire_key if version == API_VERSION else None


def as_resource(document: Mapping[str, Any]) -> dict[str, Any]:
    """A TieredModel document as a Kubernetes object of the current API
    version, keeping what it says as written: a flat or v1alpha1 document's
    keys are respelled, the rest (metadata, unset fields) left as they were."""
    if "spec" in document:
        resource = dict(document)
        if _api_version(document, KIND) == API_VERSION:
            return resource
        resource["spec"] = _respell(TieredModel, document["spec"])
    else:
        spec = {k: v for k, v in document.items() if k != "name"}
        resource = {"kind": KIND, "metadata": {"name": document.get("name")},
                    "spec": _respell(TieredModel, spec)}
    resource["apiVersion"] = f"{API_GROUP}/{API_VERSION}"
    return resource


def _respell(hint: Any, value: Any) -> Any:
    """`value`, read as `hint` with Python field names, with its keys as written now."""
    hint, _ = _strip_optional(hint)
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        hints, known = _hints(hint), {f.name for f in dataclasses.fields(hint)}
        return {(wire_key(k) if k in known else k):
                (_respell(hints[k], v) if k in known else v) for k, v in value.items()}
    if origin is tuple and isinstance(value, (list, tuple)):
        return [_respell(typing.get_args(hint)[0], v) for v in value]
    if origin in (Mapping, dict) and isinstance(value, Mapping):
        inner = typing.get_args(hint)[1]
        return {k: _respell(inner, v) for k, v in value.items()}
    return value


# --- status -----------------------------------------------------------------


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


# --- OpenAPI schema ---------------------------------------------------------

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def to_plain(value: Any, spell: Any = wire_key) -> Any:
    """A spec or status as plain data, written as API version `spell` writes
    keys (the current one by default; None: the Python field names, as
    v1alpha1 did, with times as seconds)."""
    if isinstance(value, enum.Enum):  # a tiered.names member: its plain string
        return value.value
    if dataclasses.is_dataclass(value):
        hints = _hints(type(value))
        plain = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if spell is None:
                plain[f.name] = to_plain(item, spell)
            elif _strip_optional(hints[f.name])[0] is Timestamp and item is not None:
                plain[spell(f.name)] = rfc3339(item)
            else:
                plain[spell(f.name)] = to_plain(item, spell)
        return plain
    if isinstance(value, tuple):
        return [to_plain(v, spell) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_plain(v, spell) for k, v in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _bounds(meta: Mapping[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for ours, theirs in (("minimum", "minimum"), ("maximum", "maximum"),
                         ("exclusive_minimum", "exclusiveMinimum"),
                         ("exclusive_maximum", "exclusiveMaximum"),
                         ("min_length", "minLength")):
        if meta.get(ours) is not None:
            schema[theirs] = meta[ours]
    if "pattern" in meta:
        schema["pattern"] = f"^(?:{meta['pattern']})$"
    if "enum" in meta:
        schema["enum"] = [to_plain(v) for v in meta["enum"]]
    return schema


def _type_schema(hint: Any, meta: Mapping[str, Any], spell: Any) -> dict[str, Any]:
    hint, optional = _strip_optional(hint)
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        schema = openapi_schema(hint, spell=spell)
    elif origin is tuple:
        schema = {"type": "array",
                  "items": _type_schema(typing.get_args(hint)[0], meta, spell)}
        if "min_items" in meta:
            schema["minItems"] = meta["min_items"]
        if "max_items" in meta:
            schema["maxItems"] = meta["max_items"]
        return _nullable(schema, optional)
    elif origin in (Mapping, dict) or hint is dict:
        args = typing.get_args(hint)
        value_schema = _type_schema(args[1] if len(args) == 2 else Any, meta, spell)
        if "keys" in meta:  # known keys: one property each, so the API server checks them
            schema = {"type": "object",
                      "properties": {to_plain(key): dict(value_schema) for key in meta["keys"]}}
        else:
            schema = {"type": "object", "additionalProperties": value_schema}
        return _nullable(schema, optional)
    elif hint is Any:
        schema = {"x-kubernetes-preserve-unknown-fields": True}
    elif hint is Quantity:  # as Kubernetes's own quantities are declared
        schema = {"anyOf": [{"type": "integer"}, {"type": "string"}],
                  "x-kubernetes-int-or-string": True}
    elif hint is Timestamp:
        schema = ({"type": "string", "format": "date-time"} if spell is not None
                  else {"type": "number"})
    elif hint in _SCALARS:
        schema = {"type": _SCALARS[hint], **_bounds(meta)}
    else:
        raise TypeError(f"openapi_schema: unsupported type {hint!r}")
    return _nullable(schema, optional)


def _nullable(schema: dict[str, Any], optional: bool) -> dict[str, Any]:
    if optional:
        schema["nullable"] = True
    return schema


def openapi_schema(cls: type, exclude: tuple[str, ...] = (),
                   spell: Any = wire_key) -> dict[str, Any]:
    """The OpenAPI v3 (Kubernetes structural) schema of a spec dataclass: types,
    required fields, defaults, enums and bounds, from the same declarations
    `check_fields` enforces; keys written as `spell` writes them (see `to_plain`)."""
    hints = _hints(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        key = f.name if spell is None else spell(f.name)
        schema = _type_schema(hints[f.name], f.metadata, spell)
        if f.metadata.get("doc"):
            schema["description"] = f.metadata["doc"]
        if f.default is not dataclasses.MISSING:
            if f.default is not None and not (hints[f.name] is Timestamp and spell):
                schema["default"] = to_plain(f.default, spell)
        elif f.default_factory is not dataclasses.MISSING:
            schema["default"] = to_plain(f.default_factory(), spell)
        else:
            required.append(key)
        properties[key] = schema
    result: dict[str, Any] = {"type": "object", "properties": properties}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        result["description"] = " ".join(cls.__doc__.split())
    if required:
        result["required"] = required
    return result


def crd_validation(version: str = API_VERSION) -> dict[str, Any]:
    """The `validation` block of a version of the TieredModel CRD (spec and status)."""
    spell = spelling(version)
    return {"openAPIV3Schema": {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(TieredModel, exclude=("name",), spell=spell),
            "status": openapi_schema(TieredModelStatus, spell=spell),
        },
        "required": ["spec"],
    }}
