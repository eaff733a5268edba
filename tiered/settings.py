"""Strict loading of settings dataclasses from YAML mappings.

Settings are data: profiles, model configs and (later) TieredModel specs are
frozen dataclasses, and this is the one place that turns a parsed YAML mapping
into one. Unknown keys and wrong types are errors that name the field's path,
so a typo in a config never passes silently.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tiered.errors import ConfigError

T = TypeVar("T")


def read_yaml(path: Path | Traversable) -> Mapping[str, Any]:
    """A YAML file's top-level mapping; errors name the file and line."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from error
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError) as error:  # bad !!int, dates, nesting
        raise ConfigError(f"{path}: invalid YAML: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_dataclass(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass `cls` from `data`, checking keys and types recursively."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; expected one of {', '.join(sorted(fields))}"
        )
    values = {
        name: _convert(hints[name], value, f"{where}.{name}") for name, value in data.items()
    }
    try:
        return cls(**values)
    except TypeError as error:  # a required field is missing
        raise ConfigError(f"{where}: {error}") from error
    except ConfigError as error:  # raised by the dataclass's own checks
        message = str(error)
        names_a_field = re.match(r"^[a-z_][a-z0-9_]*(\[[^\]]+\])?: ", message)
        raise ConfigError(f"{where}{'.' if names_a_field else ': '}{message}") from error


class Quantity(str):
    """A Kubernetes quantity, written as a number or a string (`nvidia.com/gpu: 1`,
    `memory: 4Gi`); kept as its string."""


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if dataclasses.is_dataclass(hint):
        return load_dataclass(hint, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        item = args[0]
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict, typing.Mapping) or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        value_hint = args[1] if len(args) == 2 else Any
        return {str(k): _convert(value_hint, v, f"{where}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:  # int64, as in the CRD
            raise ConfigError(f"{where}: expected a 64-bit integer, got one of "
                              f"{value.bit_length()} bits")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer beyond float's range
            raise ConfigError(f"{where}: expected a finite number, got an integer of "
                              f"{value.bit_length()} bits") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if hint is Quantity:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: expected a quantity such as 2, 500m or 4Gi, "
                              f"got {value!r}")
        return str(value)
    raise TypeError(f"settings field {where} has an unsupported type {hint!r}")
