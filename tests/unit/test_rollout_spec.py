"""The TieredModel spec: loading, validation errors that name the field, and
the OpenAPI schema generated from the same declarations."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import yaml

from tiered import names
from tiered.errors import ConfigError
from tiered.rollout import spec as s
from tiered.rollout.openapi import crd_validation, openapi_schema
from tiered.rollout.status import Retirement, RolloutStatus, TieredModelStatus, load_status
from tiered.rollout.wire import to_plain

SHA = "ab" * 32


def document() -> dict:
    return {
        "name": "digits",
        "artifact": {"uri": "s3://models/digits.onnx", "sha256": SHA},
        "tiers": {
            "edge": {"engine": "onnxruntime", "precision": "int8", "replicas": 3,
                     "batching": {"max_batch_size": 4, "max_queue_delay_us": 500}},
            "datacenter": {"engine": "tensorrt", "precision": "fp16"},
        },
        "routing": {"policy": "cascade", "cascade": {"tiers": ["edge", "datacenter"]}},
        "rollout": {
            "stages": [
                {"name": "edge-5", "weights": {"edge": 5}, "min_requests": 300,
                 "min_duration_s": 60, "max_duration_s": 600},
                {"name": "all", "weights": {"edge": 100, "datacenter": 100}},
            ],
            "analysis": {"latency_p95": {"max_ratio": 1.05, "max_ms": 80},
                         "error_rate": {"max": 0.01, "max_ratio": 2},
                         "energy_per_inference": {"max_ratio": 1.1},
                         "agreement": {"min": 0.99},
                         "confidence": 0.99, "min_samples": 50,
                         "consecutive_failure_limit": 2},
            "on_failure": "pause",
        },
    }


def test_a_full_document_loads_into_frozen_dataclasses():
    model = s.load_tiered_model(document())
    assert model.tiers["edge"].batching.max_batch_size == 4
    assert model.tiers["datacenter"].replicas == 1  # default
    assert model.rollout.stages[0].weights == {"edge": 5.0}
    assert model.rollout.analysis.latency_p95.max_ms == 80
    assert model.rollout.on_failure == "pause"
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.name = "other"
    with pytest.raises(TypeError):  # mappings are read-only too
        model.rollout.stages[0].weights["edge"] = 50


def test_a_v1alpha1_object_loads_with_the_name_from_metadata():
    data = document()
    name = data.pop("name")
    obj = {"apiVersion": "tiered.dev/v1alpha1", "kind": "TieredModel",
           "metadata": {"name": name}, "spec": data}
    assert s.load_tiered_model(obj) == s.load_tiered_model(document())


def test_the_current_version_is_camel_case_with_units_spelled_out():
    obj = s.as_resource(document())
    assert obj["apiVersion"] == "tiered.dev/v1alpha2" and obj["metadata"] == {"name": "digits"}
    stage = obj["spec"]["rollout"]["stages"][0]
    assert stage == {"name": "edge-5", "weights": {"edge": 5}, "minRequests": 300,
                     "minDurationSeconds": 60, "maxDurationSeconds": 600}
    assert obj["spec"]["tiers"]["edge"]["batching"] == {"maxBatchSize": 4,
                                                        "maxQueueDelayMicroseconds": 500}
    assert obj["spec"]["rollout"]["analysis"]["latencyP95"] == {"maxRatio": 1.05,
                                                                "maxMilliseconds": 80}
    assert obj["spec"]["rollout"]["onFailure"] == "pause"
    assert s.load_tiered_model(obj) == s.load_tiered_model(document())
    # A v1alpha1 object converts to the same; a current one is left as it is.
    old = {"apiVersion": "tiered.dev/v1alpha1", "kind": "TieredModel",
           "metadata": {"name": "digits", "labels": {"a": "b"}},
           "spec": {k: v for k, v in document().items() if k != "name"}}
    assert s.as_resource(old) == {**obj, "metadata": {"name": "digits", "labels": {"a": "b"}}}
    assert s.as_resource(obj) == obj
    # Written as the current version, the old spelling is an unknown key, named.
    obj["spec"]["routing"]["slo_ms"] = 20
    with pytest.raises(ConfigError, match=r"spec\.routing: unknown key 'slo_ms'; expected "
                       r"one of cascade, policy, sloMilliseconds"):
        s.load_tiered_model(obj)


def test_errors_name_the_field_as_the_document_writes_it():
    obj = s.as_resource(document())
    obj["spec"]["rollout"]["analysis"]["minSamples"] = 0
    with pytest.raises(ConfigError, match=r"spec\.rollout\.analysis\.minSamples: must be >= 1"):
        s.load_tiered_model(obj)
    flat = document()
    flat["rollout"]["analysis"]["min_samples"] = 0
    with pytest.raises(ConfigError, match=r"rollout\.analysis\.min_samples: must be >= 1"):
        s.load_tiered_model(flat)


def test_status_times_are_rfc3339_and_read_back_to_the_microsecond():
    status = TieredModelStatus(
        rollout=RolloutStatus(stable_version=1, stage_started_at=1796148819.25),
        retiring=(Retirement(version=1, after=1796148820.5),))
    plain = to_plain(status)
    assert plain["rollout"]["stageStartedAt"] == "2026-12-01T18:13:39.250000Z"
    assert plain["retiring"] == [{"version": 1, "after": "2026-12-01T18:13:40.500000Z"}]
    assert "observedGeneration" in plain and "stageSamples" in plain
    assert load_status(plain, "status") == status
    # v1alpha1 wrote seconds and snake_case; it still reads.
    assert load_status(to_plain(status, spell=None), "status", "v1alpha1") == status
    plain["rollout"]["stageStartedAt"] = "yesterday"
    with pytest.raises(ConfigError, match=r"status\.rollout\.stageStartedAt: expected an RFC "
                       r"3339 time"):
        load_status(plain, "status")
    plain["rollout"]["stageStartedAt"] = "2026-12-01T18:13:39"
    with pytest.raises(ConfigError, match="has no time zone"):
        load_status(plain, "status")


def test_a_metric_set_to_null_is_not_judged():
    data = document()
    data["rollout"]["analysis"]["energy_per_inference"] = None
    assert s.load_tiered_model(data).rollout.analysis.energy_per_inference is None


def _set(path: str, value):
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return edit


_DELETE = object()

INVALID = {
    "no stages": (_set("rollout.stages", []), "TieredModel.rollout.stages: needs at least 1"),
    "weight above 100": (_set("rollout.stages.0.weights", {"edge": 150}),
                         "rollout.stages[0].weights['edge']: must be <= 100"),
    "negative weight": (_set("rollout.stages.0.weights", {"edge": -1}),
                        "weights['edge']: must be >= 0"),
    "unknown tier in weights": (_set("rollout.stages.0.weights", {"moon": 5}),
                                "weights: unknown key 'moon'"),
    "weights on a tier the model lacks": (
        _set("rollout.stages.0.weights", {"regional": 5}),
        "rollout.stages[0].weights: tier 'regional' is not one the model runs on"),
    "min duration above max": (_set("rollout.stages.0.min_duration_s", 900),
                               "stages[0].max_duration_s: must be at least the minimum duration"),
    "unknown tier": (_set("tiers.moon", {}), "TieredModel.tiers: unknown key 'moon'"),
    "unknown engine": (_set("tiers.edge.engine", "tflite"),
                       "TieredModel.tiers.edge.engine: 'tflite' is not one of"),
    "zero batch": (_set("tiers.edge.batching.max_batch_size", 0),
                   "tiers.edge.batching.max_batch_size: must be >= 1"),
    # settings.load_dataclass joins paths only for names without digits.
    "bad sha256": (_set("artifact.sha256", "xyz"),
                   "TieredModel.artifact.sha256: 'xyz' does not match"),
    "empty uri": (_set("artifact.uri", ""), "artifact.uri: must not be empty"),
    "unknown policy": (_set("routing.policy", "random"), "routing.policy: 'random' is not"),
    "cascade over a missing tier": (_set("routing.cascade.tiers", ["regional"]),
                                    "routing.cascade.tiers: tier 'regional'"),
    "confidence of 1": (_set("rollout.analysis.confidence", 1.0),
                        "analysis.confidence: must be < 1"),
    "zero min samples": (_set("rollout.analysis.min_samples", 0),
                         "analysis.min_samples: must be >= 1"),
    "ratio below 1": (_set("rollout.analysis.latency_p95.max_ratio", 0.9),
                      "latency_p95.max_ratio: must be >= 1"),
    "error max above 1": (_set("rollout.analysis.error_rate.max", 2),
                          "error_rate.max: must be <= 1"),
    "unknown on_failure": (_set("rollout.on_failure", "panic"), "on_failure: 'panic' is not"),
    "unknown on_undecided": (_set("rollout.on_undecided", "wait"),
                             "on_undecided: 'wait' is not one of pause, rollback"),
    "typo in a key": (_set("rollout.stages.0.min_request", 5),
                      "stages[0]: unknown key 'min_request'"),
    "string for a number": (_set("rollout.stages.0.min_requests", "many"),
                            "stages[0].min_requests: expected an integer"),
    "duplicate stage names": (_set("rollout.stages.1.name", "edge-5"),
                              "stages[1]: name 'edge-5' is used twice"),
    "missing artifact": (_set("artifact", _DELETE), "artifact"),
    "no tiers": (_set("tiers", {}), "tiers: needs at least one tier"),
}


@pytest.mark.parametrize("case", INVALID)
def test_an_invalid_spec_is_refused_naming_the_field(case):
    edit, message = INVALID[case]
    data = copy.deepcopy(document())
    edit(data)
    with pytest.raises(ConfigError) as raised:
        s.load_tiered_model(data)
    assert message in str(raised.value)


# name: (edit of the current version's spec, the error names the field as written)
INVALID_AS_WRITTEN = {
    "min duration above max": (
        _set("rollout.stages.0.minDurationSeconds", 900),
        "TieredModel.spec.rollout.stages[0].maxDurationSeconds: must be at least the minimum"),
    "zero min requests": (_set("rollout.stages.0.minRequests", 0),
                          "TieredModel.spec.rollout.stages[0].minRequests: must be >= 1"),
    "unknown onUndecided": (_set("rollout.onUndecided", "wait"),
                            "TieredModel.spec.rollout.onUndecided: 'wait' is not one of pause, "
                            "rollback"),
    "unknown onFailure": (_set("rollout.onFailure", "panic"),
                          "TieredModel.spec.rollout.onFailure: 'panic' is not"),
    "the old spelling": (_set("rollout.on_undecided", "pause"),
                         "TieredModel.spec.rollout: unknown key 'on_undecided'"),
    "allowModeled not a bool": (
        _set("rollout.analysis.energyPerInference", {"allowModeled": 3}),
        "TieredModel.spec.rollout.analysis.energyPerInference.allowModeled: expected true"),
    "limit of failures": (_set("rollout.analysis.consecutiveFailureLimit", 0),
                          "TieredModel.spec.rollout.analysis.consecutiveFailureLimit: must be "
                          ">= 1"),
    "every metric of the kind null": (
        _set("rollout.analysis", {"latencyP95": None, "latencyShift": None,
                                  "errorRate": None, "energyPerInference": None,
                                  "agreement": None}),
        "every metric a predictive model is judged on (latencyP95, latencyP99, latencyShift, "
        "errorRate, energyPerInference, agreement) is null"),
    "every metric null": (
        _set("rollout.analysis", {m: None for m in (
            "latencyP95", "latencyShift", "errorRate", "energyPerInference", "agreement",
            "ttftP95", "ttftShift", "tpotP95", "energyPerToken")}),
        "TieredModel.spec.rollout.analysis: every metric is null"),
}


@pytest.mark.parametrize("case", INVALID_AS_WRITTEN)
def test_an_invalid_object_is_refused_naming_the_field_as_the_yaml_writes_it(case):
    edit, message = INVALID_AS_WRITTEN[case]
    obj = s.as_resource(document())
    edit(obj["spec"])
    with pytest.raises(ConfigError) as raised:
        s.load_tiered_model(obj)
    assert message in str(raised.value)
    snake = re.search(r"\b[a-z]+_[a-z0-9_]+\b", str(raised.value).replace("on_undecided", ""))
    assert snake is None, str(raised.value)


def test_a_kubernetes_object_of_another_kind_is_refused():
    obj = {"apiVersion": "tiered.dev/v1alpha1", "kind": "Rollout",
           "metadata": {"name": "x"}, "spec": {}}
    with pytest.raises(ConfigError, match="kind: expected TieredModel"):
        s.load_tiered_model(obj)


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_the_crd_schema_has_types_required_fields_enums_and_bounds():
    root = crd_validation()["openAPIV3Schema"]
    json.dumps(root)  # plain JSON data
    spec = root["properties"]["spec"]
    assert spec["type"] == "object"
    assert "name" not in spec["properties"]  # metadata.name in Kubernetes
    assert set(spec["required"]) == {"artifact", "tiers", "rollout"}
    stage = spec["properties"]["rollout"]["properties"]["stages"]
    assert stage["type"] == "array" and stage["minItems"] == 1
    items = stage["items"]
    assert set(items["required"]) == {"name", "weights"}
    assert items["properties"]["weights"]["properties"]["edge"] == {
        "type": "number", "minimum": 0.0, "maximum": 100.0}
    assert items["properties"]["minRequests"] == {
        "type": "integer", "minimum": 1, "default": 1000,
        "description": "canary requests needed before the stage can pass"}
    edge = spec["properties"]["tiers"]["properties"]["edge"]
    assert edge["properties"]["engine"]["enum"] == ["onnxruntime", "torch", "tensorrt"]
    assert edge["properties"]["batching"]["default"] == {"maxBatchSize": 8,
                                                         "maxQueueDelayMicroseconds": 1000}
    analysis = spec["properties"]["rollout"]["properties"]["analysis"]["properties"]
    assert analysis["latencyP95"]["properties"]["maxMilliseconds"]["nullable"] is True
    assert analysis["confidence"]["exclusiveMaximum"] is True
    assert spec["properties"]["rollout"]["properties"]["onFailure"]["enum"] == [
        "rollback", "pause"]
    undecided = spec["properties"]["rollout"]["properties"]["onUndecided"]
    assert (undecided["enum"], undecided["default"]) == (["pause", "rollback"], "pause")
    assert "maxDurationSeconds" in undecided["description"]
    assert "onUndecided" in items["properties"]["maxDurationSeconds"]["description"]
    assert spec["properties"]["artifact"]["properties"]["sha256"]["pattern"].startswith("^")
    status = root["properties"]["status"]["properties"]
    assert status["artifacts"]["items"]["properties"]["version"]["minimum"] == 1
    status = status["rollout"]["properties"]
    assert status["phase"]["enum"] == list(names.Phase)
    # A metric may be NotJudged; a run's verdict never is.
    last = status["lastAnalysis"]["properties"]
    assert last["metrics"]["items"]["properties"]["outcome"]["enum"] == list(names.Outcome)
    assert last["verdict"]["enum"] == [o for o in names.Outcome if o != "NotJudged"]
    # Structural: every node has a type (or preserves unknown fields, or is a
    # quantity: int-or-string, as Kubernetes declares its own).
    for path, node in _walk(root):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields") or \
            node.get("x-kubernetes-int-or-string"), path
        assert node.get("type") in {"object", "array", "string", "integer", "number",
                                    "boolean", None}, path


def test_schema_defaults_pass_the_same_validation():
    # A default that the validation would refuse would be a schema bug.
    spec = openapi_schema(s.TieredModel)
    analysis = spec["properties"]["rollout"]["properties"]["analysis"]
    s.AnalysisSpec(**{k: v["default"] for k, v in analysis["properties"].items()
                      if k in ("confidence", "min_samples", "consecutive_failure_limit")})


def test_resources_take_quantities_written_as_numbers_or_strings():
    doc = document()
    doc["tiers"]["datacenter"]["resources"] = yaml.safe_load(
        "{requests: {cpu: 2, memory: 4Gi}, limits: {nvidia.com/gpu: 1, cpu: 2.5}}")
    resources = s.load_tiered_model(doc).tiers["datacenter"].resources
    assert dict(resources.limits) == {"nvidia.com/gpu": "1", "cpu": "2.5"}
    assert dict(resources.requests) == {"cpu": "2", "memory": "4Gi"}
    for wrong in (True, "lots", "4 Gi", "-1", "4GiB", "1.2.3"):
        doc["tiers"]["datacenter"]["resources"] = {"limits": {"memory": wrong}}
        with pytest.raises(ConfigError, match="memory: expected a quantity"):
            s.load_tiered_model(doc)


@pytest.mark.parametrize(("written", "amount"), [
    ("4Gi", 4 * 2**30), ("500m", "0.5"), ("2", 2), ("2.5", "2.5"), (".5", "0.5"),
    ("1e3", 1000), ("1E", 10**18), ("128Gi", 128 * 2**30), ("999Ti", 999 * 2**40),
    ("1k", 1000), ("1Ki", 1024), ("250u", "0.00025"),
])
def test_a_quantity_reads_as_kubernetes_reads_it(written, amount):
    from decimal import Decimal

    from tiered.settings import Quantity

    assert Quantity(written).value() == Decimal(amount)


def test_the_crd_has_no_yaml_anchors_and_quantities_are_int_or_string():
    from tiered.controller.crd import render

    text = render()
    assert "&id" not in text and "*id" not in text
    assert text.count("x-kubernetes-int-or-string: true") >= 2
