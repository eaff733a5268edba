"""Example TieredModels are valid against the CRD the chart installs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart import helm, openapi
from tiered.rollout.wire import API_GROUP, API_VERSION

EXAMPLES = helm.ROOT / "examples"
CRD = helm.CHART / "crds" / "tieredmodels.tiered.dev.yaml"
EXAMPLE_FILES = sorted([*EXAMPLES.glob("digits*.yaml"), *EXAMPLES.glob("kubernetes/*.yaml")])


@pytest.fixture(scope="module")
def validator():
    return openapi.crd_validator(openapi.load_crd(CRD), API_VERSION)


def tiered_models(path: Path) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return [doc for doc in docs if doc.get("kind") == "TieredModel"]


def test_there_are_examples_for_local_and_kubernetes_use():
    names = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLE_FILES}
    assert {"digits.yaml", "kubernetes/digits.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_example_is_a_valid_tiered_model(path, validator):
    models = tiered_models(path)
    assert models, f"{path} holds no TieredModel"
    for model in models:
        assert model["apiVersion"] == f"{API_GROUP}/{API_VERSION}"
        assert openapi.errors(validator, model) == []


def test_kubernetes_example_places_every_tier(validator):
    (model,) = tiered_models(EXAMPLES / "kubernetes" / "digits.yaml")
    spec = model["spec"]
    assert spec["artifact"]["uri"].startswith("https://")
    assert len(spec["artifact"]["sha256"]) == 64
    for tier in ("edge", "regional", "datacenter"):
        placement = spec["tiers"][tier]
        assert placement["nodeSelector"] and placement["tolerations"], tier
        assert placement["resources"]["limits"], tier
    assert spec["tiers"]["edge"]["perNode"] is True
    assert spec["tiers"]["datacenter"]["engine"] == "torch"
    assert spec["tiers"]["datacenter"]["precision"] == "fp16"


def _model(**spec_changes: Any) -> dict[str, Any]:
    (model,) = tiered_models(EXAMPLES / "kubernetes" / "digits.yaml")
    return {**model, "spec": helm.deep_merge(model["spec"], spec_changes)}


@pytest.mark.parametrize("changes,path", [
    ({"tiers": {"edge": {"precision": "fp64"}}}, "spec.tiers.edge.precision"),
    ({"tiers": {"edge": {"node_selector": {"a": "b"}}}}, "spec.tiers.edge"),  # v1alpha1's
    ({"artifact": {"sha256": "not-a-digest"}}, "spec.artifact.sha256"),
    ({"routing": {"sloMilliseconds": 0}}, "spec.routing.sloMilliseconds"),
    ({"rollout": {"stages": []}}, "spec.rollout.stages"),
], ids=["bad-enum", "unknown-field", "bad-digest", "exclusive-minimum", "min-items"])
def test_schema_rejects_invalid_models(validator, changes, path):
    found = openapi.errors(validator, _model(**changes))
    assert any(error.startswith(f"{path}:") for error in found), found


def test_nullable_fields_accept_null(validator):
    model = _model(tiers={"regional": {"engine": None, "precision": None}},
                   artifact={"sha256": None},
                   rollout={"analysis": {"latencyP95": None}})
    assert openapi.errors(validator, model) == []
