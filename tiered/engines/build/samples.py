"""The data a build calibrates and is judged on: model inputs stacked along
axis 0, read from an npz or drawn at random from the model's own shapes.

Pure apart from reading the npz; it never runs an engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered.engines import TensorSpec
from tiered.errors import ConfigError

LABEL_KEYS = ("label", "labels")  # optional keys of an eval npz holding integer class labels


@dataclass(frozen=True)
class Samples:
    """Model inputs stacked along axis 0 (one sample per row), maybe with labels."""

    feeds: Mapping[str, np.ndarray]
    labels: np.ndarray | None
    origin: str  # the npz file, or "random"

    @property
    def count(self) -> int:
        return next(iter(self.feeds.values())).shape[0]

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {name: np.ascontiguousarray(array[index]) for name, array in self.feeds.items()}

    def batches(self, size: int) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, self.count, size):
            yield self.rows(np.arange(start, min(start + size, self.count)))


def batch_step(inputs: Sequence[TensorSpec]) -> int | None:
    """Rows per run: None when every input has a variable leading (batch) dim, 1 when fixed at 1."""
    leading = {spec.shape[0] if spec.shape else 0 for spec in inputs}
    if leading == {-1}:
        return None
    if leading == {1}:
        return 1
    raise ConfigError(
        "inputs: a build feeds samples along the leading dimension, which must be a "
        f"variable batch dimension or 1; the model has {[list(s.shape) for s in inputs]}"
    )


def load_samples(path: Path, inputs: Sequence[TensorSpec], limit: int, where: str) -> Samples:
    """An npz with one array per model input (keyed by input name) and optional
    integer class labels (`label` or `labels`, one per sample).

    A model with a single input may name its array anything.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: cannot read {path} as an npz archive: {error}") from error
    found = [key for key in LABEL_KEYS if key in arrays]
    if len(found) > 1:
        raise ConfigError(f"{where}: {path} has both {' and '.join(found)}; keep one")
    label_key = found[0] if found else "label"
    labels = arrays.pop(label_key, None)
    if len(inputs) == 1 and inputs[0].name not in arrays and len(arrays) == 1:
        arrays = {inputs[0].name: next(iter(arrays.values()))}
    feeds = {}
    for spec in inputs:
        if spec.name not in arrays:
            raise ConfigError(
                f"{where}: {path} has no array {spec.name!r} for model input {spec.name!r} "
                f"(it has {', '.join(sorted(arrays)) or 'none'})"
            )
        array = arrays[spec.name]
        if array.dtype != spec.dtype:
            raise ConfigError(
                f"{where}.{spec.name}: dtype {array.dtype}, the model takes {spec.dtype}"
            )
        if array.ndim != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape[1:], array.shape[1:])
        ):
            raise ConfigError(
                f"{where}.{spec.name}: shape {list(array.shape)} does not fit the model's "
                f"{list(spec.shape)} (samples along the first dimension)"
            )
        feeds[spec.name] = array[:limit]
    counts = {array.shape[0] for array in feeds.values()}
    if len(counts) != 1 or 0 in counts:
        raise ConfigError(f"{where}: arrays of {path} hold different or zero sample counts: "
                          f"{sorted(counts)}")
    if labels is not None:
        labels = labels[:limit]
        if labels.ndim != 1 or labels.shape[0] != counts.pop() or labels.dtype.kind not in "iu":
            raise ConfigError(
                f"{where}.{label_key}: expected one integer class label per sample, got "
                f"{labels.dtype} of shape {list(labels.shape)}"
            )
    return Samples(feeds, labels, str(path))


def random_samples(inputs: Sequence[TensorSpec], count: int, rng: np.random.Generator) -> Samples:
    """Inputs drawn at random from the model's own shapes (agreement only; no labels)."""
    feeds = {}
    for spec in inputs:
        dims = spec.shape[1:]
        if any(d < 0 for d in dims):
            raise ConfigError(
                f"input {spec.name!r}: shape {list(spec.shape)} has variable dimensions past "
                "the batch; random data cannot guess them: pass --eval and --calibration"
            )
        shape = (count, *dims)
        if spec.dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, 10, shape).astype(spec.dtype)
        elif spec.dtype.kind == "b":
            feeds[spec.name] = rng.random(shape) < 0.5
        else:
            raise ConfigError(
                f"input {spec.name!r}: cannot draw random {spec.dtype} data: pass --eval "
                "and --calibration"
            )
    return Samples(feeds, None, "random")



def load_or_draw(path: Path | None, inputs: Sequence[TensorSpec], limit: int,
                 random_count: int, rng: np.random.Generator, where: str) -> Samples:
    """The npz at `path` when one is given, else random inputs."""
    if path is not None:
        return load_samples(path, inputs, limit, where)
    return random_samples(inputs, min(limit, random_count), rng)
