"""The TieredModel CustomResourceDefinition, made from the spec's one schema.

`tiered crds` writes it into the Helm chart (helm/tiered/crds/); a test fails
when the file there differs from what this module makes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tiered.rollout.openapi import crd_validation
from tiered.rollout.wire import API_GROUP, API_VERSION, KIND, OLD_VERSIONS

PLURAL = "tieredmodels"
SINGULAR = "tieredmodel"
CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
HEADER = "# Made by `tiered crds` from tiered/rollout/spec.py; do not edit.\n"

PRINTER_COLUMNS = (
    ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status',
     "whether a version serves"),
    ("Phase", "string", ".status.rollout.phase", "where the rollout stands"),
    ("Stage", "string", ".status.stage", "the live stage"),
    ("Stable", "integer", ".status.rollout.stableVersion", "version serving the rest"),
    ("Canary", "integer", ".status.rollout.canaryVersion", "version being rolled out"),
    ("Weights", "string", ".status.weightsSummary", "canary percent per tier"),
)


def custom_resource_definition() -> dict[str, Any]:
    """The CRD: the current version, served and stored, and the older ones,
    served read-only so that objects stored at them can be read and rewritten
    (the Kubernetes backend does on its first read of each: `KubeBackend.read`).
    Every version a release has stored stays listed: an API server refuses a
    CRD update that drops one of its `status.storedVersions`."""
    columns = [{"name": name, "type": kind, "jsonPath": path, "description": doc}
               for name, kind, path, doc in PRINTER_COLUMNS]
    columns.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
    old = [{"name": version, "served": True, "storage": False, "deprecated": True,
            "deprecationWarning": f"{API_GROUP}/{version} {KIND} is deprecated; the controller "
            f"rewrites such objects as {API_GROUP}/{API_VERSION}",
            "schema": _read_only(crd_validation(version), version),
            "subresources": {"status": {}}}
           for version in OLD_VERSIONS]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": SINGULAR, "kind": KIND,
                      "shortNames": ["tm"], "categories": ["tiered"]},
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                "schema": crd_validation(),
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
            }, *old],
        },
    }


def _read_only(validation: dict[str, Any], version: str) -> dict[str, Any]:
    """An older version's schema, served so that objects stored at it can be
    read (and rewritten at the current version), refusing writes: with
    conversion None a write at it would be stored with its renamed fields
    pruned."""
    validation["openAPIV3Schema"]["x-kubernetes-validations"] = [{
        "rule": "false",
        "message": f"{API_GROUP}/{version} is read-only; write {API_GROUP}/{API_VERSION} "
                   f"(`tiered apply` converts a {version} file)"}]
    return validation


class _NoAliases(yaml.SafeDumper):
    """Writes a repeated schema out again instead of as an anchor (&id001) and
    alias, which some tools reading CRDs do not follow."""

    def ignore_aliases(self, data) -> bool:
        return True


def render() -> str:
    return HEADER + yaml.dump(custom_resource_definition(), Dumper=_NoAliases,
                              sort_keys=False, width=100)


def write_crds(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CRD_FILE
    path.write_text(render())
    return path
