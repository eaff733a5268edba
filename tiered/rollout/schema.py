"""One schema definition for the spec and status dataclasses.

Each field's constraints (range, enum, pattern, item count, allowed mapping
keys) and description are declared once, in its metadata, with `spec_field`.
`check_fields` enforces them when a `Checked` dataclass is built (so
`tiered.settings.load_dataclass` reports a bad value with its field path) and
`tiered.rollout.openapi` turns the same declarations into the CRD's
openAPIV3Schema.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from tiered.errors import ConfigError

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


class Checked:
    """Base for spec dataclasses: declared constraints are checked on build."""

    def __post_init__(self) -> None:
        _freeze_mappings(self)
        check_fields(self)
