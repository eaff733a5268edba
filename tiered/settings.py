"""Strict loading of settings dataclasses from YAML mappings.

Settings are data: profiles, model configs and (later) TieredModel specs are
frozen dataclasses, and this is the one place that turns a parsed YAML mapping
into one. Unknown keys and wrong types are errors that name the field's path,
so a typo in a config never passes silently.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from decimal import Decimal
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


def load_dataclass(cls: type[T], data: Any, where: str,
                   spelling: Callable[[str], str] | None = None) -> T:
    """Build dataclass `cls` from `data`, checking keys and types recursively.

    `spelling` turns a field's name into its key as written (the TieredModel's
    camelCase); by default keys are the field names."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    spell = spelling or _as_is
    hints = type_hints(cls)
    fields = {spell(f.name): f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; expected one of {', '.join(sorted(fields))}"
        )
    values = {
        fields[key]: _convert(hints[fields[key]], value, f"{where}.{key}", spelling)
        for key, value in data.items()
    }
    try:
        return cls(**values)
    except TypeError as error:  # a required field is missing
        missing = re.search(r"argument: '(\w+)'", str(error))
        if missing:
            raise ConfigError(f"{where}.{spell(missing[1])}: required") from error
        raise ConfigError(f"{where}: {error}") from error
    except ConfigError as error:  # raised by the dataclass's own checks
        message = str(error)
        named = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]+\])?: ", message)
        if not named:
            raise ConfigError(f"{where}: {message}") from error
        field = spell(named[1]) if named[1] in {f.name for f in dataclasses.fields(cls)} \
            else named[1]  # a check names its field in Python; say it as the data does
        raise ConfigError(f"{where}.{field}{message[len(named[1]):]}") from error


def _as_is(name: str) -> str:
    return name


# A Kubernetes quantity: a decimal number and a binary (Ki..Ei) or decimal
# (n, u, m, k..E) suffix, or an exponent.
_QUANTITY = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                       r"(?P<suffix>[eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?")
_SCALE = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
          **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
          **{f"{s}i": Decimal(1024) ** (i + 1) for i, s in enumerate("KMGTPE")}}


class Quantity(str):
    """A Kubernetes quantity, written as a number or a string (`nvidia.com/gpu: 1`,
    `memory: 4Gi`); kept as its string."""

    def value(self) -> Decimal:
        """Its amount: `4Gi` is 4294967296, `500m` 0.5."""
        number, suffix = _QUANTITY.fullmatch(self).group("number", "suffix")
        if suffix and suffix[0] in "eE" and len(suffix) > 1:
            return Decimal(number).scaleb(int(suffix[1:]))
        return Decimal(number) * _SCALE[suffix or ""]


class Timestamp(float):
    """A point in time: seconds since the epoch in Python, an RFC 3339 string
    (`2026-12-01T18:13:39.25Z`) as written; a bare number is read as seconds."""


def rfc3339(seconds: float) -> str:
    """`seconds` since the epoch as an RFC 3339 UTC time, to the microsecond."""
    text = datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="microseconds")
    return text.replace("+00:00", "Z")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of `cls`'s fields."""
    return typing.get_type_hints(cls)


def strip_optional(hint: Any) -> tuple[Any, bool]:
    """`hint` without its `| None`, and whether it had one."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _convert(hint: Any, value: Any, where: str,
             spelling: Callable[[str], str] | None = None) -> Any:
    hint, optional = strip_optional(hint)
    if optional and value is None:
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return load_dataclass(hint, value, where, spelling)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        item = args[0]
        return tuple(_convert(item, v, f"{where}[{i}]", spelling) for i, v in enumerate(value))
    if origin in (Mapping, dict, typing.Mapping) or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        value_hint = args[1] if len(args) == 2 else Any
        return {str(k): _convert(value_hint, v, f"{where}.{k}", spelling)
                for k, v in value.items()}
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
    if hint is Timestamp and isinstance(value, str):
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an RFC 3339 time such as "
                              f"2026-12-01T18:13:39Z, got {value!r}") from None
        if when.tzinfo is None:
            raise ConfigError(f"{where}: {value!r} has no time zone (end it with Z)")
        return when.timestamp()
    if hint in (float, Timestamp):
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
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) \
                or not _QUANTITY.fullmatch(str(value)):
            raise ConfigError(f"{where}: expected a quantity such as 2, 500m or 4Gi, "
                              f"got {value!r}")
        return str(value)
    raise TypeError(f"settings field {where} has an unsupported type {hint!r}")
