"""Check TieredModels against the CRD's openAPIV3Schema with `jsonschema`.

A CRD's schema is OpenAPI 3.0, not JSON Schema: `nullable: true` and the
boolean `exclusiveMinimum`/`exclusiveMaximum` mean something else there, so
the schema is translated first. Objects that list their properties get
`additionalProperties: false`, the way `kubectl apply` (strict field
validation) rejects unknown fields instead of letting the API server prune them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

# Keys whose values are schemas, or maps/lists of schemas.
_SCHEMA = ("items", "additionalProperties", "not")
_SCHEMA_MAP = ("properties", "patternProperties", "definitions")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf")


def to_json_schema(node: Any) -> Any:
    """The JSON Schema (draft-07) meaning of one OpenAPI v3 structural schema."""
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key in _SCHEMA:
            out[key] = to_json_schema(value)
        elif key in _SCHEMA_MAP:
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LIST:
            out[key] = [to_json_schema(sub) for sub in value]
        else:
            out[key] = value
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(flag) is True:
            out[flag] = out.pop(bound)
        elif out.get(flag) is False:
            del out[flag]
    if (out.get("type") == "object" and "properties" in out
            and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def crd_validator(crd: Mapping[str, Any], version: str) -> jsonschema.Draft7Validator:
    """A validator for resources of `crd` at API `version` (e.g. v1alpha1)."""
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            schema = to_json_schema(served["schema"]["openAPIV3Schema"])
            jsonschema.Draft7Validator.check_schema(schema)
            return jsonschema.Draft7Validator(schema)
    raise KeyError(f"{crd['metadata']['name']} serves no version {version}")


def load_crd(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def errors(validator: jsonschema.Draft7Validator, resource: Mapping[str, Any]) -> list[str]:
    """Every schema error in `resource`, each as `path: message`."""
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(resource), key=lambda e: [str(p) for p in e.absolute_path])
    ]
