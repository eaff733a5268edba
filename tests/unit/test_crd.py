"""The CRD in the Helm chart is the one the spec's schema makes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tiered.controller import crd

CHART_CRD = Path(__file__).resolve().parents[2] / "helm" / "tiered" / "crds" / crd.CRD_FILE


def test_the_chart_crd_is_not_stale():
    assert CHART_CRD.read_text() == crd.render(), (
        "helm/tiered/crds is stale: run `tiered crds` after changing tiered/rollout/spec.py")


def test_the_crd_has_a_status_subresource_and_printer_columns():
    version, *old = crd.custom_resource_definition()["spec"]["versions"]
    assert version["name"] == "v1alpha2" and version["storage"] and version["served"]
    assert [(v["name"], v["storage"]) for v in old] == [("v1alpha1", False)]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.rollout.phase"
    assert columns["Weights"] == ".status.weightsSummary"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for column in crd.PRINTER_COLUMNS:  # every column names a field the schema has
        node = {"properties": {"status": {"properties": status}}}
        for part in re.split(r"\.(?![^\[]*\])", column[2].strip(".")):  # not in [...]
            name, _, selector = part.partition("[")
            node = node["properties"][name]
            if selector:  # a list filtered by one of its fields: the items' schema
                assert selector.startswith("?(@.") and node["type"] == "array", column
                node = node["items"]
        assert node["type"] == column[1], column
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'


def test_the_file_is_yaml_of_one_crd():
    document = yaml.safe_load(CHART_CRD.read_text())
    assert document["kind"] == "CustomResourceDefinition"
    assert document["metadata"]["name"] == "tieredmodels.tiered.dev"
