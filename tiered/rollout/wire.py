"""How a TieredModel is written, and documents of older API versions read.

As written (API version v1alpha2) keys are camelCase, Kubernetes' convention,
with units spelled out (`interval_s` is `intervalSeconds`, `slo_ms` is
`sloMilliseconds`; `wire_key` is the one rule), and times are RFC 3339
strings. The fields keep their snake_case names in Python. Documents of
v1alpha1 (the same fields in snake_case) are still read; `to_plain` writes the
current version.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping
from typing import Any

from tiered.settings import Timestamp, rfc3339, strip_optional, type_hints

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


def spelling(version: str):
    """How the fields of `version` of the API are written."""
    return wire_key if version == API_VERSION else None


def to_plain(value: Any, spell: Any = wire_key) -> Any:
    """A spec or status as plain data, written as API version `spell` writes
    keys (the current one by default; None: the Python field names, as
    v1alpha1 did, with times as seconds)."""
    if isinstance(value, enum.Enum):  # a tiered.names member: its plain string
        return value.value
    if dataclasses.is_dataclass(value):
        hints = type_hints(type(value))
        plain = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if spell is None:
                plain[f.name] = to_plain(item, spell)
            elif strip_optional(hints[f.name])[0] is Timestamp and item is not None:
                plain[spell(f.name)] = rfc3339(item)
            else:
                plain[spell(f.name)] = to_plain(item, spell)
        return plain
    if isinstance(value, tuple):
        return [to_plain(v, spell) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_plain(v, spell) for k, v in value.items()}
    return value


def respell(hint: Any, value: Any) -> Any:
    """`value`, read as `hint` with Python field names, with its keys as written now."""
    hint, _ = strip_optional(hint)
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        hints, known = type_hints(hint), {f.name for f in dataclasses.fields(hint)}
        return {(wire_key(k) if k in known else k):
                (respell(hints[k], v) if k in known else v) for k, v in value.items()}
    if origin is tuple and isinstance(value, (list, tuple)):
        return [respell(typing.get_args(hint)[0], v) for v in value]
    if origin in (Mapping, dict) and isinstance(value, Mapping):
        inner = typing.get_args(hint)[1]
        return {k: respell(inner, v) for k, v in value.items()}
    return value
