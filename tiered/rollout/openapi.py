"""The TieredModel CRD's openAPIV3Schema, made from the spec and status
dataclasses: types, defaults and the constraints `check_fields` enforces."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from tiered.rollout.spec import TieredModel
from tiered.rollout.status import TieredModelStatus
from tiered.rollout.wire import API_VERSION, spelling, to_plain, wire_key
from tiered.settings import Quantity, Timestamp, strip_optional, type_hints

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


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
    hint, optional = strip_optional(hint)
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
    hints = type_hints(cls)
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
